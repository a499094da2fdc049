"""FSDP2 / HSDP of one model part: dense parameters over the fsdp mesh, routed experts over their efsdp mesh
(under expert parallelism), fp32-by-design parameters whole on every rank."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from titan_kimi.checkpoint.destinations import canonical_fqn
from titan_kimi.models.kimi_k3.init import fp32_parameter_names
from titan_kimi.models.kimi_k3.model import KimiK3Model


# A block passes the AttnRes bank through unchanged between block starts, so FSDP sees its own input view come
# back as an output. Nothing modifies the bank in place (the next block start concatenates a new one).
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The fp32-by-design parameters (KDA A_log, dt_bias, short-conv weights, o_norm; the router bias).

    FSDP2 needs one dtype per unit, but a unit nested inside a compiled block breaks the graph (its hooks are
    not traceable), so these tiny tensors are not sharded at all: every rank keeps them whole, in fp32, and
    their gradients are summed by :class:`ReplicatedGradients`. In module order, the same on every rank."""
    names = {canonical_fqn(n) for n in fp32_parameter_names(model)}
    return [p for n, p in model.named_parameters() if canonical_fqn(n) in names]


def reshard_after_forward(policy: str, *, pipeline: bool) -> bool:
    """``default``: free gathered weights after forward, except under pipeline parallelism, where every
    microbatch's forward would gather the stage's weights again (torchtitan's rule)."""
    return {"always": True, "never": False, "default": not pipeline}[policy]


def apply_fsdp(
    model: KimiK3Model,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    force_sum_reduction: bool,
    experts_mesh: DeviceMesh | None = None,
) -> None:
    """Shard embedding, each block (its routed experts on ``experts_mesh`` when experts are expert-parallel),
    the output head and the root; the fp32-by-design parameters stay whole on every rank. Gradients are
    summed, not averaged: the loss is already normalised by the step's global number of valid tokens."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    config = dict(mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                  ignored_params=set(replicated_parameters(model)))
    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, **config)
    vision_tower = getattr(model, "vision_tower", None)  # an image-text model's first stage: a unit per block
    if vision_tower is not None:
        for block in vision_tower.encoder.blocks:
            fully_shard(block, **config)
        fully_shard(model.mm_projector, **config)
    for block in model.layers.values():
        if block.moe_enabled and experts_mesh is not None:
            _shard_experts(block.moe.experts, experts_mesh, policy, reshard_after_forward)
        fully_shard(block, **config)
    if model.output is not None:
        # Its own unit: the loss calls the head after the model's forward (the norm and mix belong to the root).
        fully_shard(model.output, **{**config, "reshard_after_forward": False})
    fully_shard(model, **config)
    set_summed_gradients(model, force_sum_reduction)


class ReplicatedGradients:
    """Sums the gradients of the parameters FSDP leaves whole (``replicated_parameters``) over the data-parallel
    ranks, in one flat fp32 all-reduce per mesh dimension, after the step's backward passes."""

    def __init__(self, parts: list[nn.Module], mesh: DeviceMesh | None) -> None:
        self.mesh = mesh
        self.params = [p for part in parts for p in replicated_parameters(part) if p.requires_grad]

    def sync(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.mesh is None or not grads:
            return
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        for dim in range(self.mesh.ndim):
            dist.all_reduce(flat, group=self.mesh.get_group(dim))
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def _shard_experts(experts: nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy, reshard: bool) -> None:
    # Experts are already Shard(0) over ep; when efsdp x ep exceeds the expert count, dim 0 has too few rows
    # for efsdp to shard it as well, so efsdp shards dim 1 (torchtitan's rule).
    local_experts = experts.w13.to_local().shape[0] if hasattr(experts.w13, "to_local") else experts.w13.shape[0]
    efsdp = mesh.size(-1)
    placement = None if local_experts >= efsdp and local_experts % efsdp == 0 else (lambda p: Shard(1))
    fully_shard(experts, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard, shard_placement_fn=placement)


def set_summed_gradients(module: nn.Module, force_sum_reduction: bool) -> None:
    """Every FSDP unit under ``module`` sums gradients (divide factor 1); gloo has no PREMUL_SUM, so there the
    reduction is forced to a plain sum."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)
            if force_sum_reduction:
                sub.set_force_sum_reduction_for_comms(True)
