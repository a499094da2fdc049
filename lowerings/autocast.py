"""What autocast would do for a matmul, for the ops it does not see (custom ops, grouped GEMMs)."""

from __future__ import annotations

import torch


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on ``x`` computes in: autocast's when it is on for ``x``'s device, else ``x``'s own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype
