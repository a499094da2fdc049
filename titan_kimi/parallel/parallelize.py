"""Apply activation checkpointing, compile and data parallelism to a built (meta-device) model."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from titan_kimi.dtypes import DTYPES
from titan_kimi.models.kimi_k3.model import KimiK3Model
from titan_kimi.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_kimi.parallel.compile import apply_compile
from titan_kimi.parallel.fsdp import apply_fsdp
from titan_kimi.parallel.layout import ParallelLayout


def _ac_and_compile(model: KimiK3Model, cfg) -> None:
    # Order as in torchtitan: checkpoint wrappers first, then per-block compile, then FSDP.
    apply_activation_checkpointing(model, cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option)
    if "model" in cfg.compile.components:
        apply_compile(model, cfg.compile.mode, fullgraph=cfg.compile.fullgraph)


def parallelize(model: KimiK3Model, cfg, layout: ParallelLayout, device: torch.device) -> None:
    """FSDP2 (HSDP when data_parallel_replicate_degree > 1) over all ranks."""
    _ac_and_compile(model, cfg)
    mesh = init_device_mesh(device.type, (layout.dp_replicate, layout.dp_shard),
                            mesh_dim_names=("dp_replicate", "dp_shard"))
    t = cfg.training
    mixed = t.mixed_precision and cfg.model.dtype != t.param_dtype
    policy = cfg.parallelism.fsdp_reshard_after_forward
    apply_fsdp(
        model, mesh if layout.dp_replicate > 1 else mesh["dp_shard"],
        param_dtype=DTYPES[t.param_dtype] if mixed else None,
        reduce_dtype=DTYPES[t.reduce_dtype],
        reshard_after_forward=policy != "never",
        force_sum_reduction=device.type != "cuda",  # gloo has no PREMUL_SUM
    )


def apply_single_device(model: KimiK3Model, cfg) -> torch.dtype | None:
    """One process: no sharding. Returns the autocast dtype that plays the role of FSDP mixed precision."""
    _ac_and_compile(model, cfg)
    t = cfg.training
    if t.mixed_precision and cfg.model.dtype != t.param_dtype:
        return DTYPES[t.param_dtype]
    return None
