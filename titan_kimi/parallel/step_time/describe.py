"""The dry run's step-time lines (``job.estimate_step_time``): the configured layout under each pipeline
schedule, then for each GPU count of ``step_time.gpu_counts`` the fastest valid layouts that fit and the
recommended one."""

from __future__ import annotations

import copy
import dataclasses
import math

from titan_kimi.config.parallelism import cp_chunks
from titan_kimi.config.rules import checkpoints_every_block
from titan_kimi.config.validation import validate_job_config
from titan_kimi.parallel.layout import ParallelLayout, resolve_layout
from titan_kimi.parallel.step_time.comm import Network
from titan_kimi.parallel.step_time.estimate import Settings, StepEstimate, StepTimeModel
from titan_kimi.parallel.step_time.sweep import SCHEDULES, sweep, variant
from titan_kimi.parallel.step_time.table import Table


def settings_from_config(cfg) -> Settings:
    st = cfg.step_time
    return Settings(Network(st.nvlink_gb_per_s, st.internode_gb_per_s, st.gpus_per_node, st.latency_us),
                    Table.load(st.table or None), st.expert_load, st.fallback_mfu, cfg.metrics.peak_flops,
                    st.memory_gib)


def short(e: StepEstimate) -> str:
    """``pp 8 1F1B x dp_shard 32 x cp 1, ep 32, microbatch 1[, FSDP settings]``."""
    layout, plan = e.layout, e.layout.pipeline
    pipe = f"pp {layout.pp} {plan.schedule}" if plan is not None else "pp 1"
    return (f"{pipe} x dp_shard {layout.dp_shard} x cp {layout.cp}, ep {layout.ep}{layout.ep_dispatch_note}, "
            f"microbatch {layout.microbatch_size if plan is not None else '-'}" + (f", {e.fsdp}" if e.fsdp else ""))


def line(e: StepEstimate, limit: float) -> str:
    memory = "memory unknown" if e.memory_gib is None else (
        f"{e.memory_gib:.1f} GiB{'' if e.memory_gib <= limit else f' (over {limit:g})'}")
    terms = ", ".join(f"{k} {v:.3g}" for k, v in e.terms.items() if v >= 0.005 * e.step_s)
    return (f"{short(e)}: step {e.step_s:.3g} s, {e.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU "
            f"{e.mfu:.1%}, {memory}; dominant {e.dominant} ({e.terms[e.dominant]:.3g} s) [{terms} s]")


def fits(e: StepEstimate, limit: float) -> bool:
    """Known to fit: a layout whose memory the model cannot tell is never recommended."""
    return e.memory_gib is not None and e.memory_gib <= limit


TRIM_MULTIPLE = 128  # the hint's training.pad_to_multiple_of: few compiled lengths, whole tiles of the kernels


def _trimmed_rows(cfg, model: StepTimeModel, probe: StepEstimate, limit: float) -> list[str]:
    """Where the rows end in padding and the config runs them whole: the fastest layout that fits at the
    configured GPU count with ``training.pad_to_multiple_of`` set."""
    t = cfg.training
    if t.pad_to_multiple_of:
        return [f"step time: rows run at {model.row_len} of {t.seq_len} tokens (training.pad_to_multiple_of = "
                f"{t.pad_to_multiple_of}); memory is sized for whole rows"]
    trimmed = copy.copy(cfg)
    trimmed.training = dataclasses.replace(t, pad_to_multiple_of=TRIM_MULTIPLE)
    cut = model.with_config(trimmed)
    if cut.row_len == t.seq_len:
        return []
    real = round(cut.real_fraction * cut.row_len)
    head = (f"rows hold {real} real tokens of {t.seq_len}: with --training.pad_to_multiple_of {TRIM_MULTIPLE} "
            f"they run at {cut.row_len}")
    if TRIM_MULTIPLE % cp_chunks(probe.layout.cp_layout, probe.layout.cp) == 0:  # the configured layout, trimmed
        here = cut.estimate(probe.layout)
        if here.step_s and probe.step_s:
            over = "" if fits(here, limit) else (f", {here.memory_gib:.1f} GiB: over {limit:g}"
                                                 if here.memory_gib is not None else ", memory unknown")
            head += f"; the configured layout {here.step_s:.3g} s ({probe.step_s / here.step_s:.2f}x its step{over})"
    fit = [e for e in sweep(cut, probe.layout.world_size)[0] if fits(e, limit)]
    if not fit:
        return [f"{head}; no such layout fits in {limit:g} GiB at {probe.layout.world_size} GPUs"]
    best = fit[0]
    measured = cut.s.table.tokens_measured(cut.geometry, "layers")
    near = any(abs(math.log(t / cut.row_len)) < math.log(1.5) for t in measured)
    caveat = "" if near or not measured else (
        f"; the table holds no layer measured near {cut.row_len} tokens (it has {sorted(measured)}): the nearest "
        "rates stand in, and short rows run less efficiently")
    return [f"{head}; the fastest that fits: {line(best, limit)} ({probe.step_s / best.step_s:.2f}x the configured "
            f"layout's step){caveat}"]


def with_uncheckpointed(model: StepTimeModel, e: StepEstimate, blocks: int) -> StepEstimate:
    """Layout ``e`` re-estimated with ``activation_checkpoint.uncheckpointed_blocks = blocks``."""
    c = copy.copy(e.config)
    c.activation_checkpoint = dataclasses.replace(e.config.activation_checkpoint, uncheckpointed_blocks=blocks)
    return model.with_config(c).estimate(e.layout)


def most_uncheckpointed(model: StepTimeModel, e: StepEstimate, limit: float) -> tuple[int, StepEstimate] | None:
    """The most blocks per stage ``activation_checkpoint.uncheckpointed_blocks`` can take out of checkpointing
    with layout ``e`` still fitting in ``limit`` GiB, and that estimate; None where none more fits (or the memory
    of blocks out of checkpointing is unknown: the table measured none)."""
    ac = e.config.activation_checkpoint
    if not checkpoints_every_block(ac.mode, ac.selective_ac_option):
        return None
    plan = e.layout.pipeline
    most = max(b - a for a, b in plan.ranges) if plan is not None else model.args.n_layers
    best, low, high = None, ac.uncheckpointed_blocks + 1, most  # memory grows with the blocks kept
    while low <= high:
        mid = (low + high) // 2
        got = with_uncheckpointed(model, e, mid)
        if fits(got, limit):
            best, low = (mid, got), mid + 1
        else:
            high = mid - 1
    return best


def _uncheckpointed_line(model: StepTimeModel, e: StepEstimate, limit: float, what: str,
                         say_unknown: bool = True) -> list[str]:
    found = most_uncheckpointed(model, e, limit)
    if found is None:
        ac = e.config.activation_checkpoint
        if say_unknown and checkpoints_every_block(ac.mode, ac.selective_ac_option):
            one = with_uncheckpointed(model, e, ac.uncheckpointed_blocks + 1)
            if one.memory_gib is None:  # say why the dry run cannot tell
                return [f"{what} with blocks out of checkpointing: memory unknown ({one.memory_note})"]
        return []
    k, kept = found
    return [f"{what} with --activation_checkpoint.uncheckpointed_blocks {k} (the most that fit): {line(kept, limit)} "
            f"({e.step_s / kept.step_s:.2f}x its step)"]


def describe_step_time(cfg, args, layout: ParallelLayout, vision) -> list[str]:
    s = settings_from_config(cfg)
    model = StepTimeModel(cfg, args, vision, s)
    probe = model.estimate(layout)
    lines = [f"step time: {s.network.describe()}; compute {probe.compute_source}; "
             f"expert load {cfg.step_time.expert_load}; equations in docs/step_time_model.md",
             f"step time of the configured layout: {line(probe, s.memory_gib)}"
             + (f" ({probe.memory_note})" if probe.memory_note else "")]
    if layout.pipeline is not None:
        for schedule in SCHEDULES:
            if schedule == layout.pipeline.schedule:
                continue
            c = variant(cfg, layout.world_size, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                        microbatch=layout.microbatch_size, schedule=schedule, dispatch=layout.ep_dispatch)
            try:
                other = resolve_layout(c, layout.world_size, args, image_text=vision is not None)
                validate_job_config(c, None, layout.world_size, check_registry=False)  # the trainer's rules too
            except ValueError as err:
                lines.append(f"step time with {schedule}: not a valid layout ({str(err).split(';')[0]})")
                continue
            lines.append(f"step time with {schedule}: {line(model.with_config(c).estimate(other), s.memory_gib)}")
    lines += _uncheckpointed_line(model, probe, s.memory_gib, "step time of the configured layout")
    lines += _trimmed_rows(cfg, model, probe, s.memory_gib)
    t = cfg.training
    recipe_batch = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * layout.dp
    for gpus in cfg.step_time.gpu_counts or [layout.world_size]:
        batch = recipe_batch
        if cfg.step_time.sweep_batch == "per_gpu" and gpus != layout.world_size:
            batch = recipe_batch * gpus // layout.world_size
        swept = copy.copy(cfg)
        swept.training = dataclasses.replace(t, global_batch_size=batch)
        lines.append(f"{gpus} GPUs at a global batch of {batch} sequences (step_time.sweep_batch = "
                     f"{cfg.step_time.sweep_batch}):")
        estimates, rejected = sweep(model.with_config(swept), gpus)
        fit = [e for e in estimates if fits(e, s.memory_gib)]
        unknown = sum(e.memory_gib is None for e in estimates)
        lines.append(f"  {len(estimates)} valid layouts ({rejected} rejected by the layout checks), "
                     f"{len(fit)} within {s.memory_gib:g} GiB" + (f", {unknown} of unknown memory" if unknown else "")
                     + "; the fastest:")
        lines += [f"    {line(e, s.memory_gib)}" for e in fit[:cfg.step_time.top]]
        if fit:
            best = fit[0]
            gain = best.tokens_per_s_per_gpu / probe.tokens_per_s_per_gpu - 1
            lines.append(f"recommended for {gpus} GPUs: {short(best)} ({best.tokens_per_s_per_gpu:,.0f} "
                         f"tokens/s/GPU, MFU {best.mfu:.1%}"
                         + (f", {gain:+.0%} against the configured layout)" if gpus == layout.world_size else ")"))
            lines += _uncheckpointed_line(model, best, s.memory_gib, f"  the recommended layout for {gpus} GPUs",
                                          say_unknown=False)  # (the configured layout's line says why)
        else:
            lines.append(f"recommended for {gpus} GPUs: none fits in {s.memory_gib:g} GiB")
    return lines
