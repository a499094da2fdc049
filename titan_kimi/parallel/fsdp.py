"""FSDP2 / HSDP of one model part: dense parameters over the fsdp mesh, routed experts over their efsdp mesh
(under expert parallelism), fp32-by-design parameters in fp32 units of their own."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from titan_kimi.models.kimi_k3.model import KimiK3Model


# A block passes the AttnRes bank through unchanged between block starts, so FSDP sees its own input view come
# back as an output. Nothing modifies the bank in place (the next block start concatenates a new one).
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")


def _fp32_holders(module: nn.Module) -> list[nn.Module]:
    """Sub-modules that declare fp32 trainable parameters (KDA decay/conv/o_norm): one FSDP unit each."""
    return [m for m in module.modules() if getattr(m, "fp32_params", ()) and any(
        getattr(m, n).requires_grad for n in m.fp32_params)]


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
    the output head and the root. Gradients are summed, not averaged: the loss is already normalised by the
    step's global number of valid tokens."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # fp32 units compute on the block's (bf16) activations and return their dtype: their inputs stay as they are.
    fp32_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                       cast_forward_inputs=False)
    config = dict(mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, **config)
    for block in model.layers.values():
        for holder in _fp32_holders(block):
            fully_shard(holder, **{**config, "mp_policy": fp32_policy})
        if block.moe_enabled:
            # The router computes in fp32 and its selection bias must not be rounded to bf16.
            fully_shard(block.moe.router, **{**config, "mp_policy": fp32_policy})
            if experts_mesh is not None:
                _shard_experts(block.moe.experts, experts_mesh, policy, reshard_after_forward)
        fully_shard(block, **config)
    if model.output is not None:
        # Its own unit: the loss calls the head after the model's forward (the norm and mix belong to the root).
        fully_shard(model.output, **{**config, "reshard_after_forward": False})
    fully_shard(model, **config)
    set_summed_gradients(model, force_sum_reduction)


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
