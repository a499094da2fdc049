"""Parameter counts of a pipeline stage by how FSDP2 and expert parallelism store them, and the bytes one rank
holds for them: what the memory estimates of the dry run, the step-time estimate and the rank-slice benchmark
all start from (``holding_from_config`` reads the config once for the three).

Dense parameters are sharded over the ``fsdp`` ranks, routed experts over ``ep x efsdp`` (so ``1 / fsdp`` of a
layer's experts per rank, ``1 / efsdp`` of a rank's local experts), the fp32-by-design parameters are whole on
every rank (``titan_kimi.parallel.fsdp.replicated_parameters``). Under expert parallelism each layer's local
experts are an FSDP unit of their own, also at efsdp 1, where FSDP's "gather" copies them. Under pipeline
parallelism FSDP keeps every gathered unit until the step's last backward (``reshard_after_forward`` off by
default), and with ``pipeline_gradient_sync = step`` the gradients of the gathered weights accumulate unsharded
over the microbatches until the reduce-scatter at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from titan_kimi.dtypes import DTYPES
from titan_kimi.models.kimi_k3.init import fp32_parameter_names
from titan_kimi.parallel.fsdp import reshard_after_forward
from titan_kimi.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class StageParams:
    """Element counts: ``dense`` / ``experts`` (trained, frozen) of the stage's whole layers, ``fp32`` (trained,
    frozen) the replicated ones; ``units`` the dense elements of each FSDP unit (embedding, vision blocks,
    projector, decoder blocks without their experts, head); ``expert_units`` each MoE block's routed experts
    (all of them, trained and frozen)."""

    dense: int
    dense_frozen: int
    experts: int
    experts_frozen: int
    fp32: int
    fp32_frozen: int
    units: tuple[int, ...]
    expert_units: tuple[int, ...] = ()


def count_stage_params(model: nn.Module) -> StageParams:
    """Counts of a stage model (any device, meta included) whose experts hold every routed expert."""
    keep = fp32_parameter_names(model)
    counts = dict(dense=0, dense_frozen=0, experts=0, experts_frozen=0, fp32=0, fp32_frozen=0)
    for name, p in model.named_parameters():
        kind = "fp32" if name in keep else ("experts" if ".experts." in f".{name}" else "dense")
        counts[kind + ("" if p.requires_grad else "_frozen")] += p.numel()
    units, expert_units = [], []
    for name, module in model.named_children():
        if name == "layers":
            for block in module.values():
                units.append(sum(p.numel() for n, p in block.named_parameters() if ".experts." not in f".{n}"))
                experts = sum(p.numel() for n, p in block.named_parameters() if ".experts." in f".{n}")
                if experts:
                    expert_units.append(experts)
        elif name == "vision_tower" and module is not None:
            units += [sum(p.numel() for p in b.parameters()) for b in module.encoder.blocks]
        elif module is not None and any(True for _ in module.parameters()):
            units.append(sum(p.numel() for p in module.parameters()))
    return StageParams(**counts, units=tuple(units), expert_units=tuple(expert_units))


@dataclass(frozen=True)
class RankBytes:
    """Bytes one rank holds for a stage's parameters: the shards (weights, gradients, Adam moments), the
    gathered weights and their unsharded gradients (accumulated for the step, or in flight)."""

    shards: float
    gathered: float
    gathered_grads: float

    @property
    def total(self) -> float:
        return self.shards + self.gathered + self.gathered_grads


@dataclass(frozen=True)
class Holding:
    """How one rank holds a stage's parameters: bytes per element of the shards (``shard``: the stored weights
    and their gradients), the gathered weights (``weight``: the compute dtype), each Adam moment (``state``) and
    the reduced gradients (``reduce``); whether every gathered unit is held at once (``keep_gathered``: for
    the whole step under pipeline parallelism, from the forward to the backward without)
    and whether their unsharded gradients accumulate over its microbatches (``accumulate_grads``)."""

    shard: int
    weight: int
    state: int
    reduce: int
    keep_gathered: bool
    accumulate_grads: bool


def compute_dtype(cfg) -> torch.dtype:
    """The dtype the layers compute in (and FSDP gathers): param_dtype under mixed precision, else the model's."""
    t = cfg.training
    return DTYPES[t.param_dtype] if t.mixed_precision else DTYPES[cfg.model.dtype]


def holding_from_config(cfg, layout: ParallelLayout) -> Holding:
    """The trainer's FSDP handling of ``cfg`` and ``layout``. Under pipeline parallelism torch's stage turns
    gradient sync and the reshard after backward off for every microbatch (``pipeline_gradient_sync = step``):
    every unit stays gathered from its first backward to the step's end whatever ``reshard_after_forward`` says,
    and its gradients accumulate unsharded. ``microbatch`` reduce-scatters in every backward, and the gathered
    units stay only when ``reshard_after_forward`` is off. Without pipeline parallelism a unit that does not
    reshard after its forward stays gathered until its backward: at the backward's start, every unit."""
    t, pipeline = cfg.training, layout.pp > 1
    step_sync = pipeline and cfg.parallelism.pipeline_gradient_sync == "step"
    reshard = reshard_after_forward(cfg.parallelism.fsdp_reshard_after_forward, pipeline=pipeline)
    # parallelize passes reduce_dtype with or without mixed precision
    return Holding(shard=DTYPES[cfg.model.dtype].itemsize, weight=compute_dtype(cfg).itemsize,
                   state=DTYPES[cfg.optimizer.state_dtype].itemsize, reduce=DTYPES[t.reduce_dtype].itemsize,
                   keep_gathered=step_sync or not reshard, accumulate_grads=step_sync)


def rank_bytes(p: StageParams, *, fsdp: int, efsdp: int, holding: Holding) -> RankBytes:
    """Shards: weights, gradients and both moments of the trained ones, the replicated fp32 parameters.
    Gathered: every unit when ``keep_gathered``, else the two largest (one computing, one prefetched); the
    local experts are units of their own (``expert_units / ep``). Their gradients: accumulated unsharded for the
    step in the reduce dtype when ``accumulate_grads`` (fp32 gradients of bf16 weights take twice their bytes:
    ``FSDPParam.to_accumulated_grad_if_needed``), else the two largest units' in flight (the unit reduce-scattering
    and the one computing its backward)."""
    h = holding
    dense, dense_all = p.dense / fsdp, (p.dense + p.dense_frozen) / fsdp
    experts, experts_all = (p.experts / fsdp), (p.experts + p.experts_frozen) / fsdp
    shards = (dense_all + experts_all) * h.shard + (dense + experts) * (h.shard + 2 * h.state)
    shards += (p.fp32 + p.fp32_frozen) * 4 + p.fp32 * 4 * 3  # whole on every rank: weight, gradient, 2 moments
    if fsdp == 1:
        return RankBytes(shards, 0.0, 0.0)
    ep = fsdp // efsdp
    trained = lambda total, frozen: (total - frozen) / max(1, total)  # noqa: E731
    units = [(u, u * trained(p.dense + p.dense_frozen, p.dense_frozen)) for u in p.units]
    units += [(e / ep, e / ep * trained(p.experts + p.experts_frozen, p.experts_frozen)) for e in p.expert_units]
    grad_bytes = max(h.weight, h.reduce)
    largest = sorted(units, reverse=True)[:2]
    gathered = sum(u for u, _ in (units if h.keep_gathered else largest)) * h.weight
    grads = sum(g for _, g in (units if h.accumulate_grads else largest)) * grad_bytes
    return RankBytes(shards, gathered, grads)
