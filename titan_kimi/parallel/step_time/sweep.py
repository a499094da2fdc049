"""The layouts a GPU count allows for a recipe, each estimated, and the fastest that fits.

Candidates keep the recipe's global batch, sequence length, model and activation checkpointing, and vary
pipeline degree and schedule, context parallelism, expert parallelism and its dispatch (hierarchical where the
EP group spans 2+ whole nodes) and the microbatch size (dp_shard takes the ranks left, dp_replicate stays 1).
Whether one is valid is decided where the trainer decides it: the layout's one check (``resolve_layout``, with
the model and whether it is image-text) and the other config rules (``validate_job_config`` at that world size);
nothing is re-checked here.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from titan_kimi.config.parallelism import node_groups_problem, planned_node_size
from titan_kimi.config.validation import validate_job_config
from titan_kimi.parallel.layout import ParallelLayout, resolve_layout
from titan_kimi.parallel.step_time.estimate import StepEstimate, StepTimeModel

PIPELINE_DEGREES = (1, 2, 4, 8)
CONTEXT_DEGREES = (1, 2, 4)
EXPERT_DEGREES = (8, 16, 32, 64, 128)  # with the configured one: below 8 the experts' gathers dominate
MICROBATCH_SIZES = (1, 2, 4)
SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")


@dataclass
class Candidate:
    cfg: object
    layout: ParallelLayout


def variant(cfg, world_size: int, *, pp: int, cp: int, ep: int, microbatch: int, schedule: str,
            fsdp: tuple[str, bool, str] | None = None, dispatch: str = "flat"):
    """``cfg`` with these degrees at ``world_size`` GPUs (the recipe's global batch spread over the data-parallel
    ranks), or None when the batch does not spread. ``fsdp``: (fsdp_reshard_after_forward,
    pipeline_prefetch_weights, pipeline_gradient_sync); None keeps the recipe's (the prefetch and the gradient
    sync only under pipeline parallelism). ``dispatch``: parallelism.expert_parallel_dispatch."""
    t = cfg.training
    dp = world_size // (pp * cp)
    global_batch = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * dp
    if world_size % (pp * cp) or global_batch % dp:
        return None
    p = cfg.parallelism
    reshard, prefetch, sync = fsdp or (p.fsdp_reshard_after_forward, p.pipeline_prefetch_weights and pp > 1,
                                       p.pipeline_gradient_sync if pp > 1 else "step")
    out = copy.copy(cfg)  # the sections that change are new objects; the others are shared
    out.parallelism = dataclasses.replace(
        cfg.parallelism, pipeline_parallel_degree=pp, context_parallel_degree=cp, expert_parallel_degree=ep,
        expert_parallel_dispatch=dispatch, data_parallel_shard_degree=-1, data_parallel_replicate_degree=1,
        expert_parallel_node_size=cfg.parallelism.expert_parallel_node_size if dispatch == "hierarchical" else 0,
        pipeline_parallel_schedule=schedule if pp > 1 else "1F1B", pipeline_parallel_stages_per_rank=0,
        pipeline_parallel_split=[], pipeline_parallel_microbatch_size=microbatch if pp > 1 else 1,
        fsdp_reshard_after_forward=reshard, pipeline_prefetch_weights=prefetch, pipeline_gradient_sync=sync)
    out.training = dataclasses.replace(cfg.training, local_batch_size=global_batch // dp,
                                       global_batch_size=global_batch)
    out.job = dataclasses.replace(cfg.job, world_size=world_size)
    return out


def candidates(cfg, args, world_size: int, *, image_text: bool = False) -> tuple[list[Candidate], int]:
    """The valid layouts of ``world_size`` GPUs, and how many were rejected by the trainer's checks."""
    found, rejected, seen = [], 0, set()
    experts = sorted({*EXPERT_DEGREES, cfg.parallelism.expert_parallel_degree})
    for pp in PIPELINE_DEGREES:
        for cp in CONTEXT_DEGREES:
            for ep, dispatch in [(ep, d) for ep in experts for d in _dispatches(cfg, ep)]:
                for mb, schedule, fsdp in _pipelines(cfg, pp):
                    c = variant(cfg, world_size, pp=pp, cp=cp, ep=ep, microbatch=mb, schedule=schedule, fsdp=fsdp,
                                dispatch=dispatch)
                    if c is None:
                        continue
                    try:  # the layout's own checks first: they are the cheaper ones
                        layout = resolve_layout(c, world_size, args, image_text=image_text)
                        validate_job_config(c, None, world_size, check_registry=False)
                    except ValueError:
                        rejected += 1
                        continue
                    key = (layout.describe(), fsdp)
                    if key not in seen:
                        seen.add(key)
                        found.append(Candidate(c, layout))
    return found, rejected


def _dispatches(cfg, ep: int) -> list[str]:
    """The EP dispatches an EP degree allows: hierarchical where the group is 2+ whole nodes (of the recipe's
    expert_parallel_node_size, else step_time.gpus_per_node)."""
    node = planned_node_size(cfg.parallelism.expert_parallel_node_size, cfg.step_time.gpus_per_node)
    return ["flat"] if ep == 1 or node_groups_problem(ep, node) else ["flat", "hierarchical"]


def _pipelines(cfg, pp: int) -> list[tuple[int, str, tuple[str, bool, str]]]:
    """(microbatch size, schedule, FSDP handling) of a pipeline degree: under pipeline parallelism the gathered
    weights kept for the step (the recipe's ``default`` or ``never``; ``default`` when it frees them), with and
    without the weight prefetch, and regathered every microbatch (``always``), each with the gradients
    reduce-scattered once per step; and kept or regathered with them reduce-scattered every microbatch (less
    memory). Without it, the recipe's setting (the gradient sync is a pipeline setting)."""
    reshard = cfg.parallelism.fsdp_reshard_after_forward
    if pp == 1:
        return [(1, "1F1B", (reshard, False, "step"))]
    kept = reshard if reshard != "always" else "default"
    fsdp = [(kept, False, "step"), (kept, True, "step"), ("always", False, "step"), (kept, False, "microbatch"),
            ("always", False, "microbatch")]
    return [(mb, s, f) for mb in MICROBATCH_SIZES for s in SCHEDULES for f in fsdp]


def sweep(model: StepTimeModel, world_size: int) -> tuple[list[StepEstimate], int]:
    """Every valid layout of ``world_size`` GPUs estimated, fastest first; and the count rejected."""
    found, rejected = candidates(model.cfg, model.args, world_size, image_text=model.vision is not None)
    estimates = []
    for c in found:
        estimates.append(model.with_config(c.cfg).estimate(c.layout))
    estimates.sort(key=lambda e: -e.tokens_per_s_per_gpu)
    return estimates, rejected
