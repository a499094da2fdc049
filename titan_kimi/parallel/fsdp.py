"""FSDP2 / HSDP over the data-parallel ranks, with the fp32 parameters in fp32 units of their own."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from titan_kimi.models.kimi_k3.model import KimiK3Model


def _fp32_holders(module: nn.Module) -> list[nn.Module]:
    """Sub-modules that declare fp32 trainable parameters (KDA decay/conv/o_norm): one FSDP unit each."""
    return [m for m in module.modules() if getattr(m, "fp32_params", ()) and any(
        getattr(m, n).requires_grad for n in m.fp32_params)]


def apply_fsdp(
    model: KimiK3Model,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    force_sum_reduction: bool,
) -> None:
    """Shard embedding, each block, the output head and the root; gradients are summed (not averaged)
    because the loss is already normalised by the global number of valid tokens."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fp32_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    config = dict(mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, **config)
    for block in model.layers.values():
        for holder in _fp32_holders(block):
            fully_shard(holder, **{**config, "mp_policy": fp32_policy})
        if block.moe_enabled:
            # The router computes in fp32 and its selection bias must not be rounded to bf16.
            fully_shard(block.moe.router, **{**config, "mp_policy": fp32_policy})
        fully_shard(block, **config)
    if model.output is not None:
        head = [m for m in (model.output_mix, model.norm, model.output) if m is not None]
        fully_shard(head, **{**config, "reshard_after_forward": False})
    fully_shard(model, **config)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if force_sum_reduction:
                module.set_force_sum_reduction_for_comms(True)
