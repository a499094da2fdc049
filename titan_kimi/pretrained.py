"""One call from an HF checkpoint folder to a ready model: config.json -> model args -> model -> weights.

    from titan_kimi import from_pretrained
    model = from_pretrained("/ckpt/Kimi-K3.1", dtype=torch.bfloat16, device="cuda")
    logits = model(input_ids, doc_ids=attention_mask)  # an HF-style 0/1 mask is the doc_ids of one document per row
"""

from __future__ import annotations

from pathlib import Path

import torch

from titan_kimi.checkpoint.hf_config import model_args_from_hf, read_hf_config
from titan_kimi.checkpoint.hf_load import load_hf_checkpoint
from titan_kimi.dtypes import DTYPES
from titan_kimi.models.kimi_k3.init import cast_model_dtype
from titan_kimi.models.kimi_k3.model import KimiK3Model


def from_pretrained(
    path: str | Path,
    *,
    dtype: torch.dtype | str = torch.bfloat16,
    device: torch.device | str = "cpu",
    strict: bool = True,
) -> KimiK3Model:
    """The text model of the HF folder ``path`` (its ``config.json`` gives the args; MXFP4 experts are dequantised),
    with parameters in ``dtype`` (the fp32-by-design ones stay fp32) on ``device``, in eval mode.

    Only the owned tensors are allocated, on ``device`` directly (no CPU copy of the whole model first). Without
    ``model.safetensors.index.json`` the folder's ``model.safetensors`` is read. ``strict=False`` tolerates
    missing and unexpected keys (those tensors keep uninitialised memory: use it to inspect, not to train).
    A ValueError names the file and key of any problem.
    """
    path = Path(path)
    if (path / ".metadata").is_file():
        raise ValueError(f"{str(path)!r} is a DCP checkpoint; from_pretrained reads HF folders. Export it with "
                         f"scripts/tools/convert_checkpoint.py dcp-to-hf, or load it into a built model with "
                         f"titan_kimi.checkpoint.load_model_weights")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; valid: {sorted(DTYPES)}")
        dtype = DTYPES[dtype]
    args = model_args_from_hf(read_hf_config(path))
    with torch.device("meta"):
        model = KimiK3Model(args)
    cast_model_dtype(model, dtype)
    model.to_empty(device=torch.device(device))
    load_hf_checkpoint(model, path, strict=strict)
    return model.eval()
