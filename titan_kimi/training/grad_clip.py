"""Gradient-norm clipping that checks the gradients are finite before and after clipping."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class NonFiniteGradientError(RuntimeError):
    """Raised under the ``stop`` policy; the message names the parameters with NaN/inf gradients."""


@dataclass
class ClipResult:
    grad_norm: float  # before clipping
    finite: bool
    report: str  # names of parameters with non-finite gradients, when not finite


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over all gradients, reduced over every rank that holds a shard (FSDP2 DTensors)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def nonfinite_report(named_params: list[tuple[str, torch.nn.Parameter]], limit: int = 8) -> str:
    """Names of parameters whose (local) gradient has NaN or inf, gathered from every rank."""
    bad = [n for n, p in named_params if p.grad is not None and not torch.isfinite(_local(p.grad)).all()]
    if dist.is_available() and dist.is_initialized():
        gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, bad)
        bad = sorted({n for names in gathered for n in names})
    shown = ", ".join(bad[:limit]) + (f" and {len(bad) - limit} more" if len(bad) > limit else "")
    return shown or "(no single parameter: the norm overflowed)"


def clip_gradients(named_params: list[tuple[str, torch.nn.Parameter]], max_norm: float) -> ClipResult:
    """Clip to ``max_norm`` if the total norm is finite and stays finite after clipping."""
    grads = [p.grad for _, p in named_params if p.grad is not None]
    norm = _total_norm(grads)
    if not torch.isfinite(norm):
        return ClipResult(float(norm), False, nonfinite_report(named_params))
    torch.nn.utils.clip_grads_with_norm_([p for _, p in named_params], max_norm, norm, foreach=True)
    after = _total_norm(grads)
    if not torch.isfinite(after):
        return ClipResult(float(norm), False, "after clipping: " + nonfinite_report(named_params))
    return ClipResult(float(norm), True, "")
