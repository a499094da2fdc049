"""Activation checkpointing of decoder blocks: full, every N-th block, per-op selective, or full but for the
token mixers' outputs ("mixers")."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import lowerings.ops  # noqa: F401 - registers the torch.ops.titan_kimi ops named below
from titan_kimi.config.rules import checkpoints_every_block
from titan_kimi.models.kimi_k3.model import KimiK3Model

# The token mixers: each output is small beside the pass over the sequence's keys or states that makes it (at
# K3's width a KDA layer's output and FLA's residuals ~200 MB per 4,096 tokens, a DSA layer's ~440 MB, against
# the whole layer's GEMMs), so keeping them takes the costliest non-GEMM part out of a layer's recompute.
TOKEN_MIXERS = {
    torch.ops.titan_kimi.kda.default,
    torch.ops.titan_kimi.kda_cp.default,
    torch.ops.titan_kimi.sparse_mla.default,
    torch.ops.titan_kimi.sparse_mla_distilled.default,
    torch.ops.titan_kimi.indexer_topk.default,
    # indexer distillation: a whole pass over the keys each, small outputs ([T], [T, k])
    torch.ops.titan_kimi.attention_lse.default,
    torch.ops.titan_kimi.indexer_dense_kl.default,
    torch.ops.titan_kimi.indexer_sparse_target.default,
    torch.ops.titan_kimi.indexer_scores_at.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._flash_attention_forward.default,  # the varlen document-causal attention of MLA layers
}
# Outputs worth keeping per op ("op"): the token mixers and the expert GEMMs are the expensive ops to recompute.
_ALWAYS_SAVE = TOKEN_MIXERS | {
    torch.ops.aten._grouped_mm.default,
    # the router's fp32 logits ([T, E]): a few MB, and its tensor-core GEMMs are not among the counted mm's
    torch.ops.titan_kimi.router_logits.default,
}
# The expert-parallel exchanges (rows, their counts, the hierarchical dispatch's weights and expert ids): a
# recompute would repeat them on the network and the dispatch's host sync; torchtitan's op-SAC saves them too.
EXPERT_EXCHANGE = torch.ops._c10d_functional.all_to_all_single.default
_ALWAYS_SAVE.add(EXPERT_EXCHANGE)


def saves_expert_exchanges(mode: str, option: str) -> bool:
    """Whether checkpointing ``mode`` / ``option`` keeps the expert-parallel exchanges' outputs, so that its
    recompute repeats none (the step-time estimate counts the exchanges by this)."""
    return mode == "selective" and option == "op" and EXPERT_EXCHANGE in _ALWAYS_SAVE


def _ignore_profiler_ranges() -> None:
    """Per-op SAC replays every dispatched op of a region in backward, profiler ranges included. FSDP and the
    expert all-to-all open ``record_function`` ranges whose number differs between the forward and the
    recompute (the expert weights are gathered by prefetch before the forward's region but inside the
    recompute), which SAC reports as a mismatch. The ranges compute nothing: SAC passes them through."""
    import torch.utils.checkpoint as checkpoint

    profiler = torch.ops.profiler
    checkpoint.SAC_IGNORED_OPS.update({profiler._record_function_enter_new.default,
                                       profiler._record_function_exit.default,
                                       profiler._record_function_exit._RecordFunction})


def _op_policy():
    """Save the token mixers; save every other matmul (recompute the rest), as torchtitan's op-SAC does."""
    mm_count = defaultdict(int)

    def policy(ctx, op, *args, **kwargs):
        if op in _ALWAYS_SAVE:
            return CheckpointPolicy.MUST_SAVE
        if op == torch.ops.aten.mm.default:
            key = "recompute" if ctx.is_recompute else "forward"
            mm_count[key] += 1
            return CheckpointPolicy.MUST_SAVE if mm_count[key] % 2 == 0 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _mixers_policy():
    """Keep the token mixers' outputs, recompute everything else (the GEMMs and the expert exchanges too)."""

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in TOKEN_MIXERS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


SELECTIVE_POLICIES = {"op": _op_policy, "mixers": _mixers_policy}


def checkpointed_blocks(n_blocks: int, mode: str, option: str, uncheckpointed: int = 0) -> list[bool]:
    """Which of a stage's ``n_blocks`` decoder blocks, in order, run under checkpointing: all under ``full``,
    ``op`` and ``mixers``, every N-th under digits N, none under ``none``; but the last ``uncheckpointed`` (their
    backward runs first, so their kept activations are freed before any checkpointed block recomputes)."""
    if mode == "none":
        return [False] * n_blocks
    if not checkpoints_every_block(mode, option):
        return [position % int(option) == 0 for position in range(n_blocks)]
    kept_from = n_blocks - min(uncheckpointed, n_blocks)
    return [position < kept_from for position in range(n_blocks)]


def apply_activation_checkpointing(model: KimiK3Model, mode: str, option: str, uncheckpointed: int = 0) -> None:
    """``mode`` none | full | selective; ``option`` "op", "mixers" or a block frequency N (checkpoint every
    N-th); the last ``uncheckpointed`` blocks of the stage without it (``checkpointed_blocks``)."""
    if mode == "none":
        return
    policy = SELECTIVE_POLICIES.get(option) if mode == "selective" else None
    if policy is not None:
        _ignore_profiler_ranges()
    which = checkpointed_blocks(len(model.layers), mode, option, uncheckpointed)
    for checkpointed, (name, block) in zip(which, list(model.layers.items())):
        if not checkpointed:
            continue
        if policy is not None:
            wrapped = checkpoint_wrapper(block, context_fn=policy, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        model.layers[name] = wrapped
