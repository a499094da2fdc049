"""config.json both ways: our model args to the HF text config (the inverse of ``hf_config_to_kwargs``) and back.

Not part of the HF config, so not exported: ``mla_norm_eps``, ``index_norm_eps`` (the sources fix neither) and
``max_seq_len`` (a training setting).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from titan_kimi.models.kimi_k3.args import HF_RENAMES, KimiK3ModelArgs

COMPOSITE_MODEL_TYPE = "kimi_k3"
TEXT_MODEL_TYPE = "kimi_linear"
# Our convention for an MXFP4 export; the public checkpoint's exact quantization_config is unknown (spec §9.4).
MXFP4_QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "format": "mxfp4-pack-quantized",
    "group_size": 32,
    "scale_format": "e8m0",
    "targets": ["language_model.model.layers.*.block_sparse_moe.experts.*.w1",
                "language_model.model.layers.*.block_sparse_moe.experts.*.w2",
                "language_model.model.layers.*.block_sparse_moe.experts.*.w3"],
}
_OWNED_TEXT_KEYS = set(HF_RENAMES) | {
    "q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size", "linear_attn_config", "num_key_value_heads",
    "tie_word_embeddings", "mla_use_nope", "num_nextn_predict_layers", "model_type", "architectures",
    "quantization_config", "torch_dtype",
}


def hf_text_config(args: KimiK3ModelArgs) -> dict[str, Any]:
    """The HF text config (``KimiK3TextConfig``) that ``KimiK3ModelArgs.from_hf_config`` maps back to ``args``."""
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


def hf_config(
    args: KimiK3ModelArgs,
    *,
    base: dict[str, Any] | None = None,
    torch_dtype: str = "bfloat16",
    quantization_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The config.json to export. With ``base`` (e.g. the source checkpoint's config) its other fields, such as
    ``vision_config``, are kept and its text fields replaced; without one, a composite ``kimi_k3`` config."""
    text = hf_text_config(args)
    text["torch_dtype"] = torch_dtype
    if base is None:
        out: dict[str, Any] = {
            "model_type": COMPOSITE_MODEL_TYPE,
            "architectures": ["KimiK3ForConditionalGeneration"],
            "text_config": text,
        }
    elif isinstance(base.get("text_config"), dict):
        out = copy.deepcopy(base)
        kept = {k: v for k, v in base["text_config"].items() if k not in _OWNED_TEXT_KEYS}
        out["text_config"] = {**kept, **text}
    else:  # a bare text config stays bare
        out = {**{k: v for k, v in base.items() if k not in _OWNED_TEXT_KEYS}, **text}
    out.pop("quantization_config", None)
    out["torch_dtype"] = torch_dtype
    if quantization_config is not None:
        out["quantization_config"] = copy.deepcopy(quantization_config)
    return out


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """config.json from a file or a checkpoint folder."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"no config.json at {str(file)!r}; pass the checkpoint folder or the config file")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: invalid JSON ({err})") from None


def model_args_from_hf(path_or_config: str | Path | dict[str, Any], **overrides: Any) -> KimiK3ModelArgs:
    """Model args from a checkpoint folder, a config.json path, or a config dict; errors name the file."""
    if isinstance(path_or_config, dict):
        return KimiK3ModelArgs.from_hf_config(path_or_config, **overrides)
    path = Path(path_or_config)
    file = path / "config.json" if path.is_dir() else path
    config = read_hf_config(file)
    try:
        return KimiK3ModelArgs.from_hf_config(config, **overrides)
    except ValueError as err:
        raise ValueError(f"{file}: {str(err).removeprefix('config.json: ')}") from None
