"""What a process owns of each model tensor: the local tensor to fill and the box of the global tensor it covers.

Plain parameters cover the whole tensor; DTensor parameters (FSDP2, expert parallel) cover the box their
placements give; plain expert tensors of an expert-parallel rank cover ``expert_range``. Loaders plan and read
by these boxes, so no process ever materialises more than what it owns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

EXPERT_SUFFIXES = (".moe.experts.w13", ".moe.experts.w2")
# Wrappers that insert a level into parameter names: activation checkpointing and torch.compile.
_WRAPPER_LEVELS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_fqn(fqn: str) -> str:
    """The model's own name for a tensor, whatever wrappers parallelisation put around its modules."""
    for level in _WRAPPER_LEVELS:
        fqn = fqn.replace(level, "")
    return fqn


def owned_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` under canonical names (the keys this process owns)."""
    return {canonical_fqn(fqn): tensor for fqn, tensor in model.state_dict().items()}


@dataclass(frozen=True)
class Destination:
    fqn: str
    local: torch.Tensor  # written in place
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]  # global index of local[0, 0, ...]

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(self.local.shape)


def is_expert_key(fqn: str) -> bool:
    return fqn.endswith(EXPERT_SUFFIXES)


def _dtensor_destination(fqn: str, tensor: DTensor) -> Destination:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = tensor.to_local()
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(shape) != tuple(local.shape):
        raise ValueError(
            f"{fqn}: the local shard has shape {list(local.shape)} but its placements {tensor.placements} give "
            f"{list(shape)}; a padded or strided shard layout is not supported by the HF loader"
        )
    return Destination(fqn, local, tuple(tensor.shape), tuple(offset))


def destination_for(
    fqn: str,
    tensor: torch.Tensor,
    *,
    num_experts: int | None = None,
    expert_range: tuple[int, int] | None = None,
) -> Destination:
    """The destination of one model tensor; ``expert_range`` applies to plain (non-DTensor) expert tensors."""
    if tensor.is_meta:
        raise ValueError(
            f"{fqn} is on the meta device; materialise the model (e.g. model.to_empty(device=...)) before loading"
        )
    if isinstance(tensor, DTensor):
        if expert_range is not None and is_expert_key(fqn):
            raise ValueError(
                f"{fqn} is a DTensor whose placements already say which experts it holds; pass expert_range=None"
            )
        return _dtensor_destination(fqn, tensor)
    shape = tuple(tensor.shape)
    if not is_expert_key(fqn):
        return Destination(fqn, tensor, shape, (0,) * len(shape))
    if expert_range is None:
        if num_experts is not None and shape[0] != num_experts:
            raise ValueError(
                f"{fqn} holds {shape[0]} experts but the model has num_experts={num_experts}; "
                f"pass expert_range=(first, last) naming the experts this rank holds"
            )
        return Destination(fqn, tensor, shape, (0,) * len(shape))
    first, last = expert_range
    total = num_experts if num_experts is not None else last
    if last - first != shape[0]:
        raise ValueError(
            f"{fqn} holds {shape[0]} experts but expert_range={tuple(expert_range)} names {last - first}; "
            f"they must match"
        )
    return Destination(fqn, tensor, (total, *shape[1:]), (first, *(0,) * (len(shape) - 1)))


def model_destinations(
    model: nn.Module, *, expert_range: tuple[int, int] | None = None, num_experts: int | None = None
) -> list[Destination]:
    """One destination per entry of ``model.state_dict()`` (the keys it owns)."""
    if num_experts is None:
        num_experts = getattr(getattr(model, "args", None), "num_experts", None)
    if expert_range is not None:
        first, last = (int(x) for x in expert_range)
        if not (0 <= first < last and (num_experts is None or last <= num_experts)):
            raise ValueError(
                f"expert_range={tuple(expert_range)} is invalid; need 0 <= first < last <= num_experts={num_experts}"
            )
        expert_range = (first, last)
    return [
        destination_for(fqn, tensor, num_experts=num_experts, expert_range=expert_range)
        for fqn, tensor in owned_state(model).items()
    ]
