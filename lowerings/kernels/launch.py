"""Launch helpers shared by the Triton kernels of this package."""

from __future__ import annotations

import os

import torch
import triton


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotune_enabled(t: torch.Tensor) -> bool:
    """Autotune only on a real GPU: the CPU interpreter has no driver to benchmark with."""
    return t.is_cuda and not interpreting() and os.environ.get("TITAN_KIMI_TRITON_AUTOTUNE", "1") != "0"


def launch(kernel, grid, *args, **kwargs) -> None:
    """Launch a kernel. Under tracing (torch.compile / a torch.library.triton_op being traced, i.e. fake or
    functional tensors) it goes through torch.library.wrap_triton so Inductor sees the kernel; in eager it
    calls the kernel directly, because wrap_triton's HOP dispatch costs ~1 ms per launch in eager mode."""
    traced = torch.compiler.is_compiling() or any(
        isinstance(a, torch.Tensor) and type(a) not in (torch.Tensor, torch.nn.Parameter) for a in args)
    if traced and isinstance(kernel, (triton.runtime.JITFunction, triton.runtime.Autotuner)):
        torch.library.wrap_triton(kernel)[grid](*args, **kwargs)
    else:
        kernel[grid](*args, **kwargs)
