"""What autocast would do for a matmul, for the ops it does not see (custom ops, grouped GEMMs), and turning it off
inside a custom op's body."""

from __future__ import annotations

import torch


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on ``x`` computes in: autocast's when it is on for ``x``'s device, else ``x``'s own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def autocast_operands(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The operands of a matmul a custom op computes (autocast does not see into it), cast as autocast casts a
    matmul's when it is on for the first one's device (fp32 master weights with bf16 compute); else unchanged."""
    if not torch.is_autocast_enabled(tensors[0].device.type):
        return tensors
    dtype = torch.get_autocast_dtype(tensors[0].device.type)
    return tuple(t.to(dtype) for t in tensors)


def autocast_off(x: torch.Tensor) -> torch.autocast:
    """For the body of a custom op: autocast off on ``x``'s device, so the body computes in the precision it was
    written for (the op decides its own). Autocast does not cast a custom op's inputs, but its state stays on
    inside the body, where it would run a reference's fp32 matmuls in bf16."""
    return torch.autocast(x.device.type, enabled=False)
