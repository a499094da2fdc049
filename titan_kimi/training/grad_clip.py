"""Gradient-norm clipping over the global norm of every rank's gradients, checking they are finite before and
after clipping.

The norm covers all parameters of the model wherever they live: FSDP shards (DTensors on the dense mesh),
expert shards (DTensors on the expert mesh, another mesh), and other pipeline stages (other ranks: the squared
norms are summed over the pipeline group).
"""

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


def _by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors grouped by DTensor mesh (plain tensors together): norms of DTensors reduce over their own mesh."""
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


def _total_norm(grads: list[torch.Tensor], pp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """L2 norm over all gradients of all ranks: per mesh (FSDP/EP DTensors reduce over theirs), then summed
    squares over the pipeline stages."""
    squares = []
    for group in _by_mesh(grads):
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=True)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares.append(norm.float().square())
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float32, device=device)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def nonfinite_report(named_params: list[tuple[str, torch.nn.Parameter]], limit: int = 8) -> str:
    """Names of parameters whose (local) gradient has NaN or inf, gathered from every rank."""
    bad = [n for n, p in named_params if p.grad is not None and not torch.isfinite(_local(p.grad)).all()]
    if dist.is_available() and dist.is_initialized():
        gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, bad)
        bad = sorted({n for names in gathered for n in names})
    shown = ", ".join(bad[:limit]) + (f" and {len(bad) - limit} more" if len(bad) > limit else "")
    return shown or "(no single parameter: the norm overflowed)"


def clip_gradients(named_params: list[tuple[str, torch.nn.Parameter]], max_norm: float,
                   pp_group: dist.ProcessGroup | None = None) -> ClipResult:
    """Clip to ``max_norm`` if the global norm is finite and stays finite after clipping (every rank decides
    alike: the norm is global)."""
    grads = [p.grad for _, p in named_params if p.grad is not None]
    norm = _total_norm(grads, pp_group)
    if not torch.isfinite(norm):
        return ClipResult(float(norm), False, nonfinite_report(named_params))
    with_grads = [p for _, p in named_params if p.grad is not None]
    for group in _by_mesh(with_grads):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    after = _total_norm(grads, pp_group)
    if not torch.isfinite(after):
        return ClipResult(float(norm), False, "after clipping: " + nonfinite_report(named_params))
    return ClipResult(float(norm), True, "")
