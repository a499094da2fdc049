"""Key plans between our model FQNs and the public HF checkpoint keys (spec §9), in both directions.

A plan says, for one model tensor, which HF tensors make it up and which box of the model tensor each one
fills. Plans depend only on the FQN and the model tensor's global shape, so a pipeline stage, an FSDP shard
or an expert-parallel rank plans exactly the keys it owns, and export reads the same plan backwards.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

TEXT_PREFIX = "language_model."
MODEL_PREFIX = "language_model.model."
# Vision tower and projector keys equal their module names; the adapter passes them through unchanged.
PASSTHROUGH_PREFIXES = ("vision_tower.", "mm_projector.")
A_LOG_PAD_MULTIPLE = 128
MXFP4_PACKED_SUFFIX = ".weight_packed"
MXFP4_SCALE_SUFFIX = ".weight_scale"

_GLOBAL = {
    "tok_embeddings.weight": "language_model.model.embed_tokens.weight",
    "norm.weight": "language_model.model.norm.weight",
    "output.weight": "language_model.lm_head.weight",
    "output_mix.norm_weight": "language_model.model.output_attn_res_norm.weight",
    "output_mix.proj_weight": "language_model.model.output_attn_res_proj.weight",
}
_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention_mix.norm_weight": "self_attention_res_norm.weight",
    "attention_mix.proj_weight": "self_attention_res_proj.weight",
    "ffn_mix.norm_weight": "mlp_res_norm.weight",
    "ffn_mix.proj_weight": "mlp_res_proj.weight",
    "feed_forward.down_proj.weight": "mlp.down_proj.weight",
    "moe.router.gate.weight": "block_sparse_moe.gate.weight",
    "moe.router.e_score_correction_bias": "block_sparse_moe.gate.e_score_correction_bias",
    "moe.routed_expert_down_proj.weight": "block_sparse_moe.routed_expert_down_proj.weight",
    "moe.routed_expert_up_proj.weight": "block_sparse_moe.routed_expert_up_proj.weight",
    "moe.routed_expert_norm.weight": "block_sparse_moe.routed_expert_norm.weight",
    "moe.shared_experts.down_proj.weight": "block_sparse_moe.shared_experts.down_proj.weight",
}
# Our fused [gate | up] rows are two HF tensors stacked along dim 0.
_GATE_UP = {
    "feed_forward.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "moe.shared_experts.gate_up_proj.weight": (
        "block_sparse_moe.shared_experts.gate_proj.weight",
        "block_sparse_moe.shared_experts.up_proj.weight",
    ),
}
_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
# LoRA factors (``<module>.lora_A.weight``, ``<experts>.lora_B_w13``...) are not part of a base checkpoint: loads
# leave them alone and exports write merged weights instead (titan_kimi.lora).
ADAPTER_MARKER = ".lora_"


def is_indexer_key(name: str) -> bool:
    """A K3.1 indexer tensor, by model FQN or HF key (both name the module ``indexer``)."""
    return ".indexer." in f".{name}"


def is_adapter_key(fqn: str) -> bool:
    """Whether a model tensor name is a LoRA adapter factor."""
    return ADAPTER_MARKER in f".{fqn}"


@dataclass(frozen=True)
class HFSource:
    """One logical HF tensor. ``shape`` is logical: after removing A_log's padding and after dequantisation."""

    key: str
    shape: tuple[int, ...]
    expert: bool = False  # a routed-expert weight: stored as bf16 ``.weight`` or an MXFP4 packed/scale pair
    padded: bool = False  # A_log: stored zero-padded to a multiple of 128

    @property
    def packed_key(self) -> str:
        return self.key.removesuffix(".weight") + MXFP4_PACKED_SUFFIX

    @property
    def scale_key(self) -> str:
        return self.key.removesuffix(".weight") + MXFP4_SCALE_SUFFIX

    def disk_names(self) -> tuple[str, ...]:
        """Every HF key this source may be stored under."""
        return (self.key, self.packed_key, self.scale_key) if self.expert else (self.key,)


@dataclass(frozen=True)
class Piece:
    """``source`` fills the box of the model tensor starting at ``offset``; the box has the model tensor's rank,
    with leading singleton dims when the source has fewer dims (one expert of ``w13``)."""

    source: HFSource
    offset: tuple[int, ...]

    @property
    def box_shape(self) -> tuple[int, ...]:
        return (1,) * (len(self.offset) - len(self.source.shape)) + self.source.shape


@dataclass(frozen=True)
class KeyPlan:
    fqn: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def padded_a_log_length(n_heads: int) -> int:
    return -(-n_heads // A_LOG_PAD_MULTIPLE) * A_LOG_PAD_MULTIPLE


def _whole(fqn: str, shape: tuple[int, ...], key: str, **kind: bool) -> KeyPlan:
    return KeyPlan(fqn, shape, (Piece(HFSource(key, shape, **kind), (0,) * len(shape)),))


def _expect_rank(fqn: str, shape: tuple[int, ...], rank: int) -> None:
    if len(shape) != rank:
        raise ValueError(f"model key {fqn!r} has shape {list(shape)}; the HF mapping needs a {rank}-d tensor")


def plan_key(fqn: str, shape: Sequence[int]) -> KeyPlan:
    """The HF tensors that make up model tensor ``fqn`` of global ``shape``."""
    shape = tuple(int(s) for s in shape)
    if fqn.startswith(PASSTHROUGH_PREFIXES):
        return _whole(fqn, shape, fqn)
    if fqn in _GLOBAL:
        return _whole(fqn, shape, _GLOBAL[fqn])
    match = _LAYER_KEY.fullmatch(fqn)
    if match is None:
        raise ValueError(
            f"model key {fqn!r} has no Hugging Face counterpart; valid keys are {sorted(_GLOBAL)}, "
            f"layers.N.<per-layer key> and {', '.join(p + '*' for p in PASSTHROUGH_PREFIXES)}"
        )
    layer, rest = match.groups()
    prefix = f"{MODEL_PREFIX}layers.{layer}."
    if rest in _LAYER:
        return _whole(fqn, shape, prefix + _LAYER[rest])
    if rest in _GATE_UP:
        _expect_rank(fqn, shape, 2)
        if shape[0] % 2:
            raise ValueError(f"model key {fqn!r} has {shape[0]} rows; [gate | up] needs an even number")
        half, (gate, up) = shape[0] // 2, _GATE_UP[rest]
        part = (half, shape[1])
        pieces = (Piece(HFSource(prefix + gate, part), (0, 0)), Piece(HFSource(prefix + up, part), (half, 0)))
        return KeyPlan(fqn, shape, pieces)
    if rest == "attention.decay.A_log":
        return _whole(fqn, shape, prefix + "self_attn.A_log", padded=True)
    if rest == "attention.decay.dt_bias":  # the fp32 decay params sit in their own module (FSDP2 unit)
        return _whole(fqn, shape, prefix + "self_attn.dt_bias")
    if rest.startswith("attention."):
        return _whole(fqn, shape, prefix + "self_attn." + rest.removeprefix("attention."))
    if rest == "moe.experts.w13":  # w13[e] = cat(w1 [F, L], w3 [F, L])
        _expect_rank(fqn, shape, 3)
        n_experts, rows, cols = shape
        if rows % 2:
            raise ValueError(f"model key {fqn!r} has {rows} rows per expert; [w1 | w3] needs an even number")
        half = rows // 2
        pieces = []
        for e in range(n_experts):
            base = f"{prefix}block_sparse_moe.experts.{e}."
            pieces.append(Piece(HFSource(base + "w1.weight", (half, cols), expert=True), (e, 0, 0)))
            pieces.append(Piece(HFSource(base + "w3.weight", (half, cols), expert=True), (e, half, 0)))
        return KeyPlan(fqn, shape, tuple(pieces))
    if rest == "moe.experts.w2":  # w2[e] = experts.e.w2 [L, F]
        _expect_rank(fqn, shape, 3)
        n_experts, rows, cols = shape
        pieces = [
            Piece(HFSource(f"{prefix}block_sparse_moe.experts.{e}.w2.weight", (rows, cols), expert=True), (e, 0, 0))
            for e in range(n_experts)
        ]
        return KeyPlan(fqn, shape, tuple(pieces))
    raise ValueError(
        f"model key {fqn!r} has no Hugging Face counterpart; known per-layer keys: "
        f"{sorted([*_LAYER, *_GATE_UP, 'attention.*', 'moe.experts.w13', 'moe.experts.w2'])}"
    )


def hf_key_names(shapes: dict[str, Sequence[int]]) -> set[str]:
    """Every HF key (dense or MXFP4 form) that a model with these ``{fqn: global shape}`` may be stored under."""
    names: set[str] = set()
    for fqn, shape in shapes.items():
        for piece in plan_key(fqn, shape).pieces:
            names.update(piece.source.disk_names())
    return names
