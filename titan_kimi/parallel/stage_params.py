"""Parameter counts of a pipeline stage by how FSDP2 and expert parallelism store them, and the bytes one rank
holds for them: what the memory estimates of the dry run and the rank-slice benchmark both start from.

Dense parameters are sharded over the ``fsdp`` ranks, routed experts over ``ep x efsdp`` (so ``1 / fsdp`` of a
layer's experts per rank, ``1 / efsdp`` of a rank's local experts), the fp32-by-design parameters are whole on
every rank (``titan_kimi.parallel.fsdp.replicated_parameters``). Under pipeline parallelism FSDP keeps every
gathered unit until the step's last backward (``reshard_after_forward`` off by default), and the gradients of
the gathered weights accumulate unsharded over the microbatches until the reduce-scatter at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from titan_kimi.models.kimi_k3.init import fp32_parameter_names


@dataclass(frozen=True)
class StageParams:
    """Element counts: ``dense`` / ``experts`` (trained, frozen) of the stage's whole layers, ``fp32`` (trained,
    frozen) the replicated ones; ``units`` the dense elements of each FSDP unit (embedding, vision blocks,
    projector, decoder blocks without their experts, head)."""

    dense: int
    dense_frozen: int
    experts: int
    experts_frozen: int
    fp32: int
    fp32_frozen: int
    units: tuple[int, ...]


def count_stage_params(model: nn.Module) -> StageParams:
    """Counts of a stage model (any device, meta included) whose experts hold every routed expert."""
    keep = fp32_parameter_names(model)
    counts = dict(dense=0, dense_frozen=0, experts=0, experts_frozen=0, fp32=0, fp32_frozen=0)
    for name, p in model.named_parameters():
        kind = "fp32" if name in keep else ("experts" if ".experts." in f".{name}" else "dense")
        counts[kind + ("" if p.requires_grad else "_frozen")] += p.numel()
    units = []
    for name, module in model.named_children():
        if name == "layers":
            for block in module.values():
                units.append(sum(p.numel() for n, p in block.named_parameters() if ".experts." not in f".{n}"))
        elif name == "vision_tower" and module is not None:
            units += [sum(p.numel() for p in b.parameters()) for b in module.encoder.blocks]
        elif module is not None and any(True for _ in module.parameters()):
            units.append(sum(p.numel() for p in module.parameters()))
    return StageParams(**counts, units=tuple(units))


@dataclass(frozen=True)
class RankBytes:
    """Bytes one rank holds for a stage's parameters: the shards (weights, gradients, Adam moments), the
    gathered dense weights and their unsharded gradients."""

    shards: float
    gathered: float
    gathered_grads: float

    @property
    def total(self) -> float:
        return self.shards + self.gathered + self.gathered_grads


def rank_bytes(p: StageParams, *, fsdp: int, efsdp: int, weight_bytes: int, state_bytes: int,
               keep_gathered: bool, reduce_bytes: int | None = None) -> RankBytes:
    """``keep_gathered``: every gathered unit stays until the step's end (pipeline parallelism without
    ``reshard_after_forward``), with its unsharded gradients, which FSDP2 accumulates over the microbatches in
    the reduce dtype (``reduce_bytes``, default the weights'; fp32 gradients of bf16 weights take twice their
    bytes: ``FSDPParam.to_accumulated_grad_if_needed``); else two units are in flight (one computing, one
    prefetched) and gradients are reduce-scattered as they come."""
    dense, dense_all = p.dense / fsdp, (p.dense + p.dense_frozen) / fsdp
    experts, experts_all = (p.experts / fsdp), (p.experts + p.experts_frozen) / fsdp
    shards = (dense_all + experts_all) * weight_bytes + (dense + experts) * (weight_bytes + 2 * state_bytes)
    shards += (p.fp32 + p.fp32_frozen) * 4 + p.fp32 * 4 * 3  # whole on every rank: weight, gradient, 2 moments
    if fsdp == 1:
        return RankBytes(shards, 0.0, 0.0)
    if keep_gathered:
        grad_bytes = max(weight_bytes, reduce_bytes or weight_bytes)
        gathered = sum(p.units) * weight_bytes
        grads = sum(p.units) * grad_bytes * p.dense / max(1, p.dense + p.dense_frozen)
        if efsdp > 1:  # the local experts are gathered over efsdp as well
            gathered += experts_all * efsdp * weight_bytes
            grads += experts * efsdp * grad_bytes
        return RankBytes(shards, gathered, grads)
    return RankBytes(shards, sum(sorted(p.units)[-2:]) * weight_bytes, 0.0)
