"""config.json files: the composite export config around the text config, reading one from a folder, and model
args from it (the field mapping itself: ``titan_kimi.models.kimi_k3.state_dict_adapter``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.state_dict_adapter import (EXPERTS_MODULE, MODEL_PREFIX, OWNED_TEXT_KEYS,
                                                          args_from_hf_config, hf_text_config)

COMPOSITE_MODEL_TYPE = "kimi_k3"
# Our convention for an MXFP4 export; the public checkpoint's exact quantization_config is unknown (spec §9.4).
MXFP4_QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "format": "mxfp4-pack-quantized",
    "group_size": 32,
    "scale_format": "e8m0",
    "targets": [f"{MODEL_PREFIX}layers.*.{EXPERTS_MODULE}.*.{w}" for w in ("w1", "w2", "w3")],
}
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
        kept = {k: v for k, v in base["text_config"].items() if k not in OWNED_TEXT_KEYS}
        out["text_config"] = {**kept, **text}
    else:  # a bare text config stays bare
        out = {**{k: v for k, v in base.items() if k not in OWNED_TEXT_KEYS}, **text}
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
        return args_from_hf_config(path_or_config, **overrides)
    path = Path(path_or_config)
    file = path / "config.json" if path.is_dir() else path
    config = read_hf_config(file)
    try:
        return args_from_hf_config(config, **overrides)
    except ValueError as err:
        raise ValueError(f"{file}: {str(err).removeprefix('config.json: ')}") from None
