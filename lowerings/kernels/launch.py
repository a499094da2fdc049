"""Launch helpers shared by the Triton kernels of this package."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lowerings.settings import kernel_settings


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotune_enabled(t: torch.Tensor) -> bool:
    """Autotune only on a real GPU (the CPU interpreter has no driver to benchmark with), and only while the
    ``kernels.triton_autotune`` setting is on (lowerings/settings.py)."""
    return t.is_cuda and not interpreting() and kernel_settings().triton_autotune


@triton.jit
def as_fp32(x):
    """A float scalar argument as fp32. torch.library.wrap_triton (the triton_op path Inductor compiles) types a
    Python float argument fp64 where Triton's own launcher types it fp32; left as is, that one fp64 scalar
    promotes the kernel's arithmetic to fp64 (software exp/log on the GPU: SiTU-GLU ran 8x slower)."""
    return tl.cast(x, tl.float32)


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


def dedup_configs(cfgs: list[dict]) -> list[dict]:
    """Drop repeated config dicts (a size-derived config can coincide with a fixed one), keeping the order."""
    out, seen = [], set()
    for c in cfgs:
        key = tuple(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def config_key(cfgs: list[dict]) -> tuple:
    """A hashable form of a config list (the argument of the lru-cached autotuner factories)."""
    return tuple(tuple(sorted(c.items())) for c in cfgs)


def make_autotuner(kernel, cfg_key: tuple, key: list[str], **kwargs):
    """``triton.autotune`` over ``cfg_key`` (see `config_key`): ``num_warps`` / ``num_stages`` go to the
    Config, every other entry is a kernel meta-parameter. ``kwargs`` reach triton.autotune (e.g. reset_to_zero)."""
    configs = [triton.Config({k: v for k, v in c if not k.startswith("num_")},
                             num_warps=dict(c)["num_warps"], num_stages=dict(c)["num_stages"]) for c in cfg_key]
    return triton.autotune(configs=configs, key=key, **kwargs)(kernel)
