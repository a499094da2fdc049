"""The mapping between this model and the public Hugging Face checkpoint (spec §9), in both directions:
config.json fields <-> ``KimiK3ModelArgs`` and ``KimiK3VisionArgs``, and model tensor FQNs <-> HF tensor keys.

Tensors: a key plan says, for one model tensor, which HF tensors make it up and which box of the model tensor
each one fills (renames, the fused [gate | up] rows, the stacked experts, A_log's padding). Plans depend only on
the FQN and the model tensor's global shape, so a pipeline stage, an FSDP shard or an expert-parallel rank plans
exactly the keys it owns; the checkpoint package loads by reading plans forwards and exports by reading them
backwards.

Config: ``args_from_hf_config`` reads a checkpoint config.json (rejecting settings the model cannot build) and
``hf_text_config`` writes the text config that maps back to the same args; ``vision_args_from_hf_config`` and
``hf_vision_config`` do the same for its ``vision_config`` and ``KimiK3VisionArgs``. Not in the HF config, so not
exported: ``mla_norm_eps``, ``index_norm_eps`` (the sources fix neither) and the training settings
(``max_seq_len``, ``index_training``, ``dsa_dense_shortcut``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.vision_args import KimiK3VisionArgs

TEXT_MODEL_TYPE = "kimi_linear"

# ------------------------------------------------------------------ config.json
HF_RENAMES = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "rms_norm_eps": "norm_eps",
    "pad_token_id": "pad_token_id",
    "initializer_range": "init_std",
    "num_attention_heads": "n_heads",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "mla_use_output_gate": "mla_output_gate",
    "intermediate_size": "inter_dim",
    "first_k_dense_replace": "first_k_dense_replace",
    "moe_layer_freq": "moe_layer_freq",
    "num_experts": "num_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "num_shared_experts",
    "moe_intermediate_size": "moe_inter_dim",
    "latent_moe_use_norm": "latent_moe_use_norm",
    "moe_router_activation_func": "router_score_func",
    "moe_renormalize": "route_norm",
    "routed_scaling_factor": "route_scale",
    "num_expert_group": "num_expert_groups",
    "topk_group": "topk_groups",
    "activation_situ_beta": "situ_beta",
    "activation_situ_linear_beta": "situ_linear_beta",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "index_rope": "index_rope",
}


_VALUE_KINDS = {int: ((int,), "an integer"), float: ((int, float), "a number"), bool: ((bool,), "true or false"),
                str: ((str,), "a string")}


def _check_kind(hf: str, ours: str, value: Any) -> None:
    """A config value of the field's type (a wrong one fails later with an unrelated TypeError otherwise)."""
    default = KimiK3ModelArgs.__dataclass_fields__[ours].default
    if isinstance(default, tuple):
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        word = "a list of integers"
    elif ours == "kda_gate_lower_bound":
        ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
        word = "a number or null"
    else:
        kinds, word = _VALUE_KINDS[type(default)]
        ok = isinstance(value, kinds) and (type(default) is bool or not isinstance(value, bool))
    if not ok:
        raise ValueError(f"config.json: {hf} = {value!r} must be {word}")


def args_from_hf_config(config: dict[str, Any], **overrides: Any) -> KimiK3ModelArgs:
    """Map a checkpoint ``config.json`` (composite ``kimi_k3`` with ``text_config``, or a bare text config)."""
    return KimiK3ModelArgs(**{**hf_config_to_kwargs(config), **overrides})


def hf_section(config: dict[str, Any], name: str) -> dict[str, Any]:
    """``config[name]`` of a composite ``kimi_k3`` config.json (``text_config``, ``vision_config``), or the config
    itself when it is a bare one."""
    if not isinstance(config, dict):
        raise ValueError(f"config.json: must be a JSON object, got {type(config).__name__}")
    section = config.get(name, config)
    if not isinstance(section, dict):
        raise ValueError(f"config.json: {name} must be an object, got {type(section).__name__}")
    return section


def hf_config_to_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """Model-args keyword arguments from a checkpoint config dict; rejects settings the model cannot build."""
    text = hf_section(config, "text_config")
    out: dict[str, Any] = {}
    for hf, ours in HF_RENAMES.items():
        if text.get(hf) is not None:
            _check_kind(hf, ours, text[hf])
            out[ours] = text[hf]
    if text.get("tie_word_embeddings"):
        raise ValueError("config.json: tie_word_embeddings = true is not supported (Kimi K3 has an untied lm_head)")
    if text.get("mla_use_nope") is False:
        raise ValueError("config.json: mla_use_nope = false is not supported (Kimi K3 MLA applies no RoPE)")
    n_kv = text.get("num_key_value_heads")
    if n_kv is not None and n_kv != text.get("num_attention_heads", n_kv):
        raise ValueError(f"config.json: num_key_value_heads = {n_kv} must equal num_attention_heads (no GQA in K3 MLA)")
    if text.get("num_nextn_predict_layers"):
        raise ValueError("config.json: num_nextn_predict_layers > 0 (MTP) is not supported")
    out["q_lora_rank"] = text.get("q_lora_rank") or 0
    latent = text.get("routed_expert_hidden_size")
    out["moe_latent_dim"] = latent or 0
    block = text.get("attn_res_block_size", 12)
    out["attn_res_block_size"] = block or 0
    lac = text.get("linear_attn_config") or {}
    if not isinstance(lac, dict):
        raise ValueError(f"config.json: linear_attn_config must be an object, got {type(lac).__name__}")
    for hf in ("q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size"):
        if text.get(hf) is not None and (not isinstance(text[hf], int) or isinstance(text[hf], bool)):
            raise ValueError(f"config.json: {hf} = {text[hf]!r} must be an integer or null")
    if lac:
        out["kda_layers"] = tuple(lac.get("kda_layers") or ())
        out["full_attn_layers"] = tuple(lac.get("full_attn_layers") or ())
        for hf, ours in (("num_heads", "kda_num_heads"), ("head_dim", "kda_head_dim"),
                         ("short_conv_kernel_size", "kda_conv_size"), ("use_full_rank_gate", "kda_full_rank_gate"),
                         ("kda_layers", "kda_layers"), ("full_attn_layers", "full_attn_layers"),
                         ("gate_lower_bound", "kda_gate_lower_bound")):
            if hf in lac:
                _check_kind(f"linear_attn_config.{hf}", ours, lac[hf])
        for hf, ours in (("num_heads", "kda_num_heads"), ("head_dim", "kda_head_dim"),
                         ("short_conv_kernel_size", "kda_conv_size"), ("use_full_rank_gate", "kda_full_rank_gate")):
            if hf in lac:
                out[ours] = lac[hf]
        if "gate_lower_bound" in lac:
            out["kda_gate_lower_bound"] = lac["gate_lower_bound"]
    if text.get("moe_router_activation_func") == "sigmoid_with_bias":
        out["router_score_func"] = "sigmoid"
    return out


# The text-config fields the two directions read and write (an export replaces these in a base config).
OWNED_TEXT_KEYS = set(HF_RENAMES) | {
    "q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size", "linear_attn_config", "num_key_value_heads",
    "tie_word_embeddings", "mla_use_nope", "num_nextn_predict_layers", "model_type", "architectures",
    "quantization_config", "torch_dtype",
}


def hf_text_config(args: KimiK3ModelArgs) -> dict[str, Any]:
    """The HF text config (``KimiK3TextConfig``) that ``args_from_hf_config`` maps back to ``args``."""
    cfg: dict[str, Any] = {"model_type": TEXT_MODEL_TYPE, "architectures": ["KimiK3ForCausalLM"]}
    for hf, ours in HF_RENAMES.items():
        if hf.startswith("index_") and not args.index_n_heads:
            continue  # K3 (no indexer) configs carry no indexer fields
        value = getattr(args, ours)
        cfg[hf] = list(value) if isinstance(value, tuple) else value
    cfg.update(
        num_key_value_heads=args.n_heads,
        q_lora_rank=args.q_lora_rank or None,
        routed_expert_hidden_size=args.moe_latent_dim or None,
        attn_res_block_size=args.attn_res_block_size or None,
        tie_word_embeddings=False,
        mla_use_nope=True,
        num_nextn_predict_layers=0,
        linear_attn_config={
            "kda_layers": list(args.kda_layers),
            "full_attn_layers": list(args.full_attn_layers),
            "num_heads": args.kda_num_heads,
            "head_dim": args.kda_head_dim,
            "short_conv_kernel_size": args.kda_conv_size,
            "use_full_rank_gate": args.kda_full_rank_gate,
            "gate_lower_bound": args.kda_gate_lower_bound,
        },
    )
    return cfg


HF_VISION_RENAMES = {
    "patch_size": "patch_size",
    "init_pos_emb_height": "pos_emb_height",
    "init_pos_emb_width": "pos_emb_width",
    "init_pos_emb_time": "pos_emb_time",
    "vt_num_hidden_layers": "n_layers",
    "vt_hidden_size": "dim",
    "vt_num_attention_heads": "n_heads",
    "qkv_hidden_size": "qkv_dim",
    "vt_intermediate_size": "mlp_dim",
    "merge_kernel_size": "merge_kernel",
    "projector_ln_eps": "projector_eps",
    "media_placeholder_token_id": "media_placeholder_token_id",
}
# Settings with one supported value (spec §1.3); any other value is rejected on load.
HF_VISION_FIXED = {
    "pos_emb_type": "divided_fixed",
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2",
    "norm_type": "rmsnorm",
    "mlp_type": "mlp2",
    "activation_func": "gelu_pytorch_tanh",
    "projector_hidden_act": "gelu",
    "pos_emb_interpolation_mode": "bilinear",
    "attn_bias": False,
    "patch_embed_proj_bias": False,
    "linear_bias": False,
}


def vision_args_from_hf_config(config: dict[str, Any], **overrides: Any) -> KimiK3VisionArgs:
    """Map the ``vision_config`` of a composite ``kimi_k3`` config.json (or a bare vision config)."""
    vision = hf_section(config, "vision_config")
    kwargs: dict[str, Any] = {}
    for hf, ours in HF_VISION_RENAMES.items():
        if vision.get(hf) is not None:
            kwargs[ours] = vision[hf]
    for hf, supported in HF_VISION_FIXED.items():
        if vision.get(hf) is not None and vision[hf] != supported:
            raise ValueError(
                f"config.json: vision_config.{hf} = {vision[hf]!r} is not supported; valid: {supported!r}")
    if vision.get("mm_hidden_size") not in (None, kwargs.get("dim", KimiK3VisionArgs.dim)):
        raise ValueError(
            f"config.json: vision_config.mm_hidden_size = {vision['mm_hidden_size']!r} must equal vt_hidden_size "
            "(the projector reads the merged tower output)"
        )
    top = config.get("media_placeholder_token_id")
    if top is not None and "media_placeholder_token_id" not in kwargs:
        kwargs["media_placeholder_token_id"] = top
    return KimiK3VisionArgs(**{**kwargs, **overrides})


def hf_vision_config(vision: KimiK3VisionArgs, text_hidden_size: int) -> dict[str, Any]:
    """The ``vision_config`` that ``vision_args_from_hf_config`` maps back to ``vision``."""
    out: dict[str, Any] = {"model_type": "kimi_k3_vision"}
    for hf, ours in HF_VISION_RENAMES.items():
        value = getattr(vision, ours)
        out[hf] = list(value) if isinstance(value, tuple) else value
    out.update(HF_VISION_FIXED)
    out["mm_hidden_size"] = vision.dim
    out["text_hidden_size"] = text_hidden_size
    return out


# ------------------------------------------------------------------ tensor keys
TEXT_PREFIX = "language_model."
MODEL_PREFIX = "language_model.model."
# Vision tower and projector keys equal their module names; the adapter passes them through unchanged.
PASSTHROUGH_PREFIXES = ("vision_tower.", "mm_projector.")
# A layer's routed experts, one module per expert (``<EXPERTS_MODULE>.<e>.w1``...).
EXPERTS_MODULE = "block_sparse_moe.experts"
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
            base = f"{prefix}{EXPERTS_MODULE}.{e}."
            pieces.append(Piece(HFSource(base + "w1.weight", (half, cols), expert=True), (e, 0, 0)))
            pieces.append(Piece(HFSource(base + "w3.weight", (half, cols), expert=True), (e, half, 0)))
        return KeyPlan(fqn, shape, tuple(pieces))
    if rest == "moe.experts.w2":  # w2[e] = experts.e.w2 [L, F]
        _expect_rank(fqn, shape, 3)
        n_experts, rows, cols = shape
        pieces = [
            Piece(HFSource(f"{prefix}{EXPERTS_MODULE}.{e}.w2.weight", (rows, cols), expert=True), (e, 0, 0))
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
