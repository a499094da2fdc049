"""FLA's graph-mode buffers as fresh tensors per call, so the fla KDA op can run inside torch's CUDA graphs.

The adapter runs FLA 0.6.0's graph mode (``use_graph=True``): its kernels skip the sentinel rows of the static
chunk indices, which is what removes the host sync. The same flag makes FLA's backward take its scratch and
gradient buffers (``wy_dq``, ``wy_dA``, ``dhu_dh``, ...) from ``fla.ops.utils.graph.get_static_buffer``: a
process-wide cache keyed by name and shape, one set shared by every KDA layer and kept for the process's life.
Under cudagraph trees (``compile.mode = reduce-overhead``) the first capture allocates them in the graph pool,
where they outlive the graph without being its outputs: the warm-up run fails with "12 tensor(s) in the
cudagraph pool not tracked as outputs", one per KDA layer of k3_small (seen on the H200 with allocation
histories on, 2026-12-01). And a gradient FLA returns straight from such a buffer (``dv`` in bf16) aliases memory the
next layer's backward overwrites. Fresh tensors are what FLA's non-graph path allocates (``new_empty``); the
kernels write every element they read back, so nothing depends on the buffers' earlier contents.
"""

from __future__ import annotations

import sys

import torch

# the modules that bind get_static_buffer by name (FLA 0.6.0)
_MODULES = ("fla.ops.kda.chunk_bwd", "fla.ops.kda.chunk_intra", "fla.ops.common.chunk_delta_h")


def fresh_buffer(name: str, shape: tuple, dtype: torch.dtype, device: torch.device | str,
                 zero: bool = False) -> torch.Tensor:
    """``get_static_buffer``'s signature, a new tensor each call (``name`` only named the cache slot)."""
    return (torch.zeros if zero else torch.empty)(tuple(shape), dtype=dtype, device=device)


def use_fresh_graph_buffers() -> list[str]:
    """Point the FLA modules that bind ``get_static_buffer`` at :func:`fresh_buffer` (idempotent; imports them).
    Returns the modules patched. Raises ValueError when FLA no longer has the name where 0.6.0 had it, so an
    FLA upgrade that moves it is noticed instead of silently sharing buffers again."""
    import importlib

    patched = []
    for name in _MODULES:
        module = sys.modules.get(name) or importlib.import_module(name)
        if not hasattr(module, "get_static_buffer"):
            raise ValueError(f"{name} has no get_static_buffer (FLA {_fla_version()}); the fla KDA adapter was "
                             "written against FLA 0.6.0's graph buffers")
        if module.get_static_buffer is not fresh_buffer:
            module.get_static_buffer = fresh_buffer
            patched.append(name)
    return patched


def _fla_version() -> str:
    import fla

    return getattr(fla, "__version__", "?")
