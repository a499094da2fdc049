"""Per-rank parameter and memory estimate of a layout (the dry run prints it; built on the meta device).

Counted: this rank's shard of the parameters, their gradients and the Adam moments, plus the gathered weights
and their unsharded gradients (``titan_kimi.parallel.stage_params``): under pipeline parallelism FSDP keeps every
gathered unit of the stage for the whole step (unless ``pipeline_gradient_sync = microbatch`` with
``reshard_after_forward = always``), and the unsharded gradients too (unless ``pipeline_gradient_sync =
microbatch``); otherwise the two largest units are in flight (one computing, one prefetched). Activations only on request
(``job.estimate_activations``): measured on fake tensors by ``titan_kimi.parallel.activation_estimate``, for one
(micro)batch per stage (pipeline schedules keep several in flight on early stages). Not counted: communication
buffers, the allocator's slack.
"""

from __future__ import annotations

from titan_kimi.dtypes import DTYPES
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.parallel.layout import ParallelLayout
from titan_kimi.parallel.stage_params import RankBytes, count_stage_params, holding_from_config, rank_bytes
from titan_kimi.training.setup.build import build_meta_model

def _stage_bytes(cfg, args: KimiK3ModelArgs, layout: ParallelLayout, layer_range) -> tuple[int, RankBytes]:
    """(parameters on one rank, bytes one rank holds for them) for one stage."""
    model = build_meta_model(args, DTYPES[cfg.model.dtype], indexer_mode=cfg.indexer.mode,
                             warmup_trains=cfg.indexer.warmup_trains,
                             layer_range=layer_range)
    counts = count_stage_params(model)
    held = rank_bytes(counts, fsdp=layout.fsdp, efsdp=layout.efsdp, holding=holding_from_config(cfg, layout))
    total = counts.dense + counts.dense_frozen + counts.experts + counts.experts_frozen
    return int(total / layout.fsdp + counts.fp32 + counts.fp32_frozen), held


def _activations(cfg, args: KimiK3ModelArgs, layout: ParallelLayout, ranges) -> tuple[float, float]:
    from lowerings.catalog import BACKEND_OPS
    from lowerings.ops.registry import planned_backends
    from titan_kimi.parallel.activation_estimate import estimate_activations

    kernels = planned_backends({op: getattr(cfg.kernels, op) for op in BACKEND_OPS})
    rows = layout.microbatch_size if layout.pipeline is not None else cfg.training.local_batch_size
    ac = cfg.activation_checkpoint
    acts = scores = 0.0
    for layer_range in ranges:
        est = estimate_activations(args, kernels=kernels, rows=rows, seq_len=cfg.training.seq_len, cp=layout.cp,
                                   cp_layout=layout.cp_layout, layer_range=layer_range, ac_mode=ac.mode,
                                   ac_option=ac.selective_ac_option, ep=layout.ep,
                                   uncheckpointed=ac.uncheckpointed_blocks)
        acts, scores = acts + est["activations"], max(scores, est["indexer_scores"])
    return acts, scores


def describe_ranks(cfg, args: KimiK3ModelArgs, layout: ParallelLayout, *, activations: bool = False) -> list[str]:
    """One line per pipeline rank (all ranks of one pipeline rank hold the same shapes); with ``activations``,
    a second line with the measured activation peak and the total."""
    plan = layout.pipeline
    ranks = range(plan.pp) if plan is not None else [0]
    lines, h = [], holding_from_config(cfg, layout)
    for rank in ranks:
        ranges = [plan.ranges[s] for s in plan.stages_of_rank(rank)] if plan is not None else [None]
        params = states = gathered = 0.0
        for layer_range in ranges:
            p, held = _stage_bytes(cfg, args, layout, layer_range)
            params, states = params + p, states + held.shards / 2**30
            gathered += (held.gathered + held.gathered_grads) / 2**30
        where = f"pp rank {rank}" if plan is not None else "every rank"
        kept = ("gathered weights and their unsharded gradients, kept for the whole step" if h.accumulate_grads
                else f"gathered weights, kept {'for the whole step' if plan else 'from forward to backward'}, and "
                "unsharded gradients in flight"
                if h.keep_gathered else "gathered weights and unsharded gradients in flight")
        lines.append(f"{where}: {params / 1e9:.3f} B params per rank, {states:.1f} GiB params + grads + Adam "
                     f"moments, + {gathered:.1f} GiB {kept} = {states + gathered:.1f} GiB "
                     f"(activations not included)")
        if activations:
            acts, scores = _activations(cfg, args, layout, ranges)
            t = cfg.training
            rows = layout.microbatch_size if plan is not None else t.local_batch_size
            cp = f"cp {layout.cp} {layout.cp_layout}" if layout.cp > 1 else "cp 1"
            lines.append(
                f"{where}: activations {acts:.3g} GiB for {rows} x {t.seq_len // layout.cp} local tokens of "
                f"{t.seq_len} ({cp}, activation_checkpoint {cfg.activation_checkpoint.mode}"
                f"{', one microbatch per stage' if plan is not None else ''}) + indexer score chunk <= "
                f"{scores:.3g} GiB -> peak about {states + gathered + acts + scores:.3g} GiB per rank")
    return lines
