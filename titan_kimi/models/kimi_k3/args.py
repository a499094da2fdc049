"""Model arguments for Kimi K3 / K3.1 text models, with validation (the HF config.json mapping:
``state_dict_adapter``).

Field names follow torchtitan where one exists (dim, n_layers, n_heads, vocab_size); the rest follow the
checkpoint config (spec/kimi_k3_architecture.md §1, §16a). Layer numbers in ``kda_layers`` and
``full_attn_layers`` are 1-based, as in the checkpoint config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torchtitan.protocols.model import BaseModelArgs


def default_full_attn_layers(n_layers: int) -> tuple[int, ...]:
    """Every 4th layer number, plus the last one when it is not a multiple of 4 (K3: 4, 8, ..., 92, 93)."""
    layers = list(range(4, n_layers + 1, 4))
    if n_layers % 4:
        layers.append(n_layers)
    return tuple(layers)


INDEX_TRAINING_MODES = ("frozen", "warmup", "sparse")


@dataclass
class KimiK3ModelArgs(BaseModelArgs):
    # Embedding / output
    vocab_size: int = 163840
    dim: int = 7168
    n_layers: int = 93
    norm_eps: float = 1e-5
    pad_token_id: int = 0
    init_std: float = 0.02
    # Layer pattern (1-based layer numbers); empty = the K3 default pattern for n_layers
    kda_layers: tuple[int, ...] = ()
    full_attn_layers: tuple[int, ...] = ()
    # Kimi Delta Attention
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    kda_conv_size: int = 4
    kda_gate_lower_bound: float | None = -5.0
    kda_full_rank_gate: bool = True
    # Gated MLA
    n_heads: int = 96
    q_lora_rank: int = 1536  # 0 = direct q projection
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_output_gate: bool = True
    mla_norm_eps: float = 1e-6
    # K3.1 indexer (DSA); index_n_heads = 0 means plain gated MLA (K3)
    index_n_heads: int = 0
    index_head_dim: int = 128
    index_topk: int = 2048
    index_rope: bool = False
    index_norm_eps: float = 1e-6
    # How the indexer trains (titan_kimi.models.kimi_k3.indexer_distillation): "frozen" (hard top-k, no
    # gradient), "warmup" (dense attention; the indexer distils the main attention over every causal key) or
    # "sparse" (sparse attention; the indexer distils it over the keys it selected). A training setting, not a
    # property of the weights: checkpoints of one mode load in another.
    index_training: str = "frozen"
    # K3.1: DSA layers attend densely when the indexer would select every causal key (KimiK3Model.dsa_dense);
    # same losses and gradients. A training setting (model.dsa_dense_shortcut), not a property of the weights.
    dsa_dense_shortcut: bool = True
    # Dense MLP (layers < first_k_dense_replace)
    inter_dim: int = 33792
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    # Stable LatentMoE
    num_experts: int = 896
    num_experts_per_tok: int = 16
    num_shared_experts: int = 2
    moe_inter_dim: int = 3072
    moe_latent_dim: int = 3584  # 0 = experts work in the hidden space (no latent projections)
    latent_moe_use_norm: bool = True
    router_score_func: str = "sigmoid"
    route_norm: bool = True
    route_scale: float = 1.0
    num_expert_groups: int = 1
    topk_groups: int = 1
    # SiTU-GLU
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    # Attention Residuals; 0 = plain pre-norm residual
    attn_res_block_size: int = 12
    # Used for FLOP accounting; set from training.seq_len
    max_seq_len: int = 4096

    def __post_init__(self) -> None:
        self.kda_layers = tuple(int(x) for x in self.kda_layers)
        self.full_attn_layers = tuple(int(x) for x in self.full_attn_layers)
        if not self.kda_layers and not self.full_attn_layers and self.n_layers > 0:
            self.full_attn_layers = default_full_attn_layers(self.n_layers)
            full = set(self.full_attn_layers)
            self.kda_layers = tuple(n for n in range(1, self.n_layers + 1) if n not in full)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def bad(name: str, value: Any, valid: str) -> ValueError:
            return ValueError(f"model args: {name} = {value!r} is invalid; {valid}")

        positive = [
            "vocab_size", "dim", "n_layers", "kda_num_heads", "kda_head_dim", "kda_conv_size", "n_heads",
            "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "inter_dim", "moe_layer_freq",
            "num_experts", "num_experts_per_tok", "moe_inter_dim", "num_expert_groups", "topk_groups", "max_seq_len",
        ]
        for name in positive:
            if getattr(self, name) < 1:
                raise bad(name, getattr(self, name), "must be >= 1")
        for name in ("q_lora_rank", "qk_rope_head_dim", "index_n_heads", "num_shared_experts", "moe_latent_dim",
                     "first_k_dense_replace", "attn_res_block_size"):
            if getattr(self, name) < 0:
                raise bad(name, getattr(self, name), "must be >= 0")
        for name in ("norm_eps", "mla_norm_eps", "index_norm_eps", "init_std", "situ_beta", "situ_linear_beta", "route_scale"):
            if not getattr(self, name) > 0:
                raise bad(name, getattr(self, name), "must be > 0")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise bad("pad_token_id", self.pad_token_id, f"must be in [0, vocab_size={self.vocab_size})")
        kda, full = set(self.kda_layers), set(self.full_attn_layers)
        every = set(range(1, self.n_layers + 1))
        if len(kda) != len(self.kda_layers) or len(full) != len(self.full_attn_layers):
            raise bad("kda_layers/full_attn_layers", (self.kda_layers, self.full_attn_layers), "must not repeat a layer")
        if kda & full:
            raise bad("kda_layers/full_attn_layers", sorted(kda & full), "a layer cannot be both KDA and full attention")
        if (kda | full) != every:
            missing, extra = sorted(every - kda - full), sorted((kda | full) - every)
            raise bad(
                "kda_layers/full_attn_layers", {"missing": missing, "out_of_range": extra},
                f"together they must list every 1-based layer number 1..{self.n_layers} exactly once",
            )
        if self.kda_gate_lower_bound is not None and not -5.0 <= self.kda_gate_lower_bound < 0:
            raise bad("kda_gate_lower_bound", self.kda_gate_lower_bound, "must be in [-5, 0) or None")
        if self.num_experts_per_tok > self.num_experts:
            raise bad("num_experts_per_tok", self.num_experts_per_tok, f"must be <= num_experts={self.num_experts}")
        if self.router_score_func not in ("sigmoid", "softmax"):
            raise bad("router_score_func", self.router_score_func, "valid: 'sigmoid', 'softmax'")
        if self.num_experts % self.num_expert_groups:
            raise bad("num_expert_groups", self.num_expert_groups, f"must divide num_experts={self.num_experts}")
        if self.topk_groups > self.num_expert_groups:
            raise bad("topk_groups", self.topk_groups, f"must be <= num_expert_groups={self.num_expert_groups}")
        if self.index_n_heads:
            if self.index_head_dim < 1 or self.index_topk < 1:
                raise bad("index_head_dim/index_topk", (self.index_head_dim, self.index_topk), "must be >= 1")
            if self.q_lora_rank == 0:
                raise bad("q_lora_rank", 0, "the indexer reads the q-LoRA latent, so q_lora_rank must be > 0")
        if self.index_training not in INDEX_TRAINING_MODES:
            raise bad("index_training", self.index_training, f"valid: {', '.join(map(repr, INDEX_TRAINING_MODES))}")
        if self.index_training != "frozen" and not self.index_n_heads:
            raise bad("index_training", self.index_training, "the model has no indexer (index_n_heads = 0); valid: "
                      "'frozen', or a model with an indexer")
        if self.index_rope:
            raise bad("index_rope", True, "K3 is NoPE: the indexer applies no rotary embedding (must be False)")
        if self.first_k_dense_replace > self.n_layers:
            raise bad("first_k_dense_replace", self.first_k_dense_replace, f"must be <= n_layers={self.n_layers}")

    # ------------------------------------------------------------------ layer pattern
    def is_kda_layer(self, layer: int) -> bool:
        """Whether 0-based ``layer`` is a KDA layer (else gated MLA / DSA)."""
        return (layer + 1) in self.kda_layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def has_indexer(self) -> bool:
        return self.index_n_heads > 0

    @property
    def indexer_trains(self) -> bool:
        return self.index_training != "frozen"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_attn_res_blocks(self) -> int:
        return -(-self.n_layers // self.attn_res_block_size) if self.attn_res_block_size else 0

    def without_indexer(self) -> "KimiK3ModelArgs":
        """The same model as K3: no indexer (so none to train)."""
        return self.replace(index_n_heads=0, index_training="frozen")

    def replace(self, **changes: Any) -> "KimiK3ModelArgs":
        if "n_layers" in changes and "kda_layers" not in changes and "full_attn_layers" not in changes:
            changes.update(kda_layers=(), full_attn_layers=())
        return dataclasses.replace(self, **changes)
