"""The dry run's step-time lines (``job.estimate_step_time``): the configured layout under each pipeline
schedule, then for each GPU count of ``step_time.gpu_counts`` the fastest valid layouts that fit and the
recommended one."""

from __future__ import annotations

import copy
import dataclasses

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
        else:
            lines.append(f"recommended for {gpus} GPUs: none fits in {s.memory_gib:g} GiB")
    return lines
