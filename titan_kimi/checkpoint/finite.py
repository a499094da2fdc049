"""Non-finite weights are caught where they enter (a checkpoint load), not as "the loss is nan" at step 1."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titan_kimi.checkpoint.destinations import canonical_fqn


def check_finite_parameters(model: nn.Module, source: str) -> None:
    """ValueError naming the first parameter (this rank's part of it) with a NaN or an infinity."""
    for name, tensor in model.state_dict().items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            count = int((~torch.isfinite(local)).sum())
            raise ValueError(f"{source}: model key {canonical_fqn(name)!r} holds {count} non-finite value(s); "
                             f"the checkpoint is damaged or was saved after training diverged")
