"""Apply expert parallelism, activation checkpointing, compile and FSDP2 to one built (meta-device) model part, in
torchtitan's order: EP, then checkpoint wrappers, then per-block compile, then FSDP. Context parallelism changes no
module: the trainer passes its ``ContextParallel`` to each forward (``titan_kimi.parallel.context_parallel``)."""

from __future__ import annotations

import functools

import torch

from lowerings.ops.expert_gemm import row_alignment
from titan_kimi.dtypes import DTYPES
from titan_kimi.models.kimi_k3.model import KimiK3Model
from titan_kimi.models.kimi_k3.moe import set_routed_expert_gemm
from titan_kimi.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_kimi.parallel.compile import apply_compile, apply_loss_compile
from titan_kimi.parallel.expert_node_dispatch import shard_by_node
from titan_kimi.parallel.expert_parallel import apply_expert_parallel, set_expert_row_alignment, shard_flat
from titan_kimi.parallel.fsdp import apply_fsdp, reshard_after_forward
from titan_kimi.parallel.mesh import Meshes


def mixed_precision_dtype(cfg) -> torch.dtype | None:
    """The compute dtype when it is lower than the stored parameters' (FSDP's param_dtype, or autocast)."""
    t = cfg.training
    if t.mixed_precision and cfg.model.dtype != t.param_dtype:
        return DTYPES[t.param_dtype]
    return None


def _ac_and_compile(model: KimiK3Model, cfg, *, experts_outside: bool) -> None:
    precision = cfg.training.routed_expert_gemm
    set_routed_expert_gemm(model, precision)
    if experts_outside:  # the EP permutation pads the received rows for the GEMMs
        set_expert_row_alignment(row_alignment(precision))
    ac = cfg.activation_checkpoint
    apply_activation_checkpointing(model, ac.mode, ac.selective_ac_option, ac.uncheckpointed_blocks)
    if cfg.compile.mode != "none":
        if "model" in cfg.compile.components:
            apply_compile(model, cfg.compile.mode, fullgraph=cfg.compile.fullgraph, experts_outside=experts_outside,
                          granularity=cfg.compile.granularity)
        if "loss" in cfg.compile.components and model.output is not None:
            apply_loss_compile(model.output, cfg.compile.mode, fullgraph=cfg.compile.fullgraph)


def parallelize(model: KimiK3Model, cfg, meshes: Meshes, device: torch.device) -> bool:
    """EP on the routed experts (ep > 1), then AC and compile, then FSDP2 (HSDP with dp_replicate > 1) over the
    dense mesh, which includes the CP ranks. Returns whether FSDP was applied (else the caller autocasts: no
    data-parallel mesh to shard over, e.g. pipeline parallelism alone; the layout check makes ep divide
    dp_shard x cp, so expert parallelism always has one)."""
    layout = meshes.layout
    if layout.ep > 1:
        hierarchical = layout.ep_dispatch == "hierarchical"
        apply_expert_parallel(model, meshes.ep, functools.partial(shard_by_node, node_size=layout.ep_node_size)
                              if hierarchical else shard_flat)
    _ac_and_compile(model, cfg, experts_outside=layout.ep > 1)
    dense = meshes.dense
    if dense is None:
        return False
    t = cfg.training
    apply_fsdp(
        model, dense,
        param_dtype=mixed_precision_dtype(cfg),
        reduce_dtype=DTYPES[t.reduce_dtype],
        reshard_after_forward=reshard_after_forward(cfg.parallelism.fsdp_reshard_after_forward,
                                                    pipeline=layout.pp > 1),
        force_sum_reduction=device.type != "cuda",  # gloo has no PREMUL_SUM
        experts_mesh=meshes.experts,
    )
    return True


def apply_single_device(model: KimiK3Model, cfg) -> torch.dtype | None:
    """One process: no sharding. Returns the autocast dtype that plays the role of FSDP mixed precision."""
    _ac_and_compile(model, cfg, experts_outside=False)
    return mixed_precision_dtype(cfg)
