"""Whether cuDNN frontend's DeepSeek-sparse-attention kernels (CuTe DSL, sm90) can run here: shared by the
``cudnn`` backends of ``indexer_topk`` and ``sparse_mla``."""

from __future__ import annotations

import importlib
import importlib.util

import torch

# the frontend's DSA kernels and the CuTe-DSL runtime they are written in (nvidia-cutlass-dsl[cu13], whose
# runtime imports tvm_ffi from apache-tvm-ffi)
_MODULES = ("cudnn", "cutlass", "tvm_ffi")


def dsa_unavailable_reason(what: str, module: str, symbol: str) -> str | None:
    """None when ``module.symbol`` of cuDNN's DSA package imports on an sm90 GPU, else why not (``what`` names the
    backend in the message)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    capability = torch.cuda.get_device_capability()
    if capability != (9, 0):  # the sm100 kernels exist but were never run by this project
        return (f"{what} is validated on compute capability 9.0 only; this GPU ({torch.cuda.get_device_name()}) "
                f"has {capability[0]}.{capability[1]}")
    for name in _MODULES:
        if importlib.util.find_spec(name) is None:
            return (f"python module {name!r} is not installed ({what} needs nvidia-cudnn-frontend, "
                    "nvidia-cutlass-dsl[cu13] and apache-tvm-ffi: pip install 'titan_kimi[gpu]')")
    try:
        getattr(importlib.import_module(module), symbol)  # imports CuTe DSL: a broken runtime fails here, not mid-step
    except Exception as err:
        return f"{module}.{symbol} does not import: {type(err).__name__}: {err}"
    return None
