"""The parallel layout of a job: its ``parallelism.*`` degrees resolved against the world size, and the one
function that checks them (``check_layout``; its checks that need no model are the config's,
``titan_kimi.config.parallelism``, which ``validate_job_config`` runs before the model exists).

Every reader takes the layout from here: the trainer, the dry run and its estimates, the step-time sweep and the
rank-slice bench (``resolve_layout``). torchtitan's ``ParallelDims`` is built from a checked layout only to make the
device meshes (``titan_kimi.parallel.mesh``): it checks by ``assert`` without naming config keys, knows no pipeline
plan, microbatches or CP layout, imports torch (which the config checks must not wait for) and holds process-group
state, while the sweep resolves thousands of layouts without any.

This module imports no torch: the model arguments are only read, and the CP chunk count comes from
``lowerings.ops.sequence_shards`` when context parallelism is on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from titan_kimi.config.parallelism import LayoutCheck, SourceOf, check_degrees, cp_chunks
from titan_kimi.parallel.pipeline_plan import PipelinePlan, plan_pipeline

if TYPE_CHECKING:
    from titan_kimi.config.sections import JobConfig
    from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    dp_replicate: int
    dp_shard: int
    cp: int
    pp: int
    ep: int
    pipeline: PipelinePlan | None = None  # set when pp > 1
    microbatch_size: int = 1  # sequences per pipeline microbatch
    cp_layout: str = "zigzag"  # how each sequence is split over the cp ranks (lowerings.ops.sequence_shards)
    local_batch_size: int = 1  # sequences per rank per micro-step
    global_batch_size: int = 1  # sequences per optimizer step, over all data-parallel ranks
    ep_dispatch: str = "flat"  # parallelism.expert_parallel_dispatch
    ep_node_size: int = 0  # parallelism.expert_parallel_node_size (0: the launcher's ranks per node)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ranks read different batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Ranks a dense parameter is sharded over (torchtitan: dp_shard x cp)."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks an expert is sharded over, inside its expert-parallel group."""
        return self.fsdp // self.ep

    @property
    def accumulation_steps(self) -> int:
        """Micro-steps per optimizer step: the global batch over the data-parallel ranks' local batches."""
        return self.global_batch_size // (self.local_batch_size * self.dp)

    @property
    def ep_dispatch_note(self) -> str:
        """`` (hierarchical[ over nodes of N])`` for the node-level expert dispatch, else nothing."""
        if self.ep_dispatch != "hierarchical":
            return ""
        return f" (hierarchical{f' over nodes of {self.ep_node_size}' if self.ep_node_size else ''})"

    def describe(self) -> str:
        cp = f"cp {self.cp} ({self.cp_layout})" if self.cp > 1 else "cp 1"
        text = (f"world {self.world_size} = dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x "
                f"{cp} x pp {self.pp}; ep {self.ep}{self.ep_dispatch_note} x efsdp {self.efsdp} inside dp_shard x cp")
        if self.pipeline is not None:
            p = self.pipeline
            text += (f"; {p.schedule}, {p.num_stages} stages ({p.stages_per_rank} per rank), microbatches of "
                     f"{self.microbatch_size}")
        return text


def resolve_layout(cfg: JobConfig, world_size: int, args: KimiK3ModelArgs, *,
                   image_text: bool = False) -> ParallelLayout:
    """The checked layout of ``cfg`` on ``world_size`` ranks for the model ``args`` (``check_layout``)."""
    layout = check_layout(cfg, world_size, args, image_text=image_text)
    assert layout is not None  # world size and model given: every check ran
    return layout


def check_layout(cfg: JobConfig, world_size: int | None = None, args: KimiK3ModelArgs | None = None, *,
                 image_text: bool = False, source_of: SourceOf | None = None,
                 world_source: str = "job.world_size") -> ParallelLayout | None:
    """The one check of the parallel layout. Runs what is known: the degrees and batch shapes always; against the
    world size when given (``world_source`` says where it came from); these two are the config's own
    (``titan_kimi.config.parallelism.check_degrees``, which ``validate_job_config`` runs alone); against the model
    (routed experts, the pipeline's stages of whole AttnRes blocks and its microbatches, the KDA window under CP)
    when ``args`` are given; ``image_text``: the model has a vision tower. Returns the layout when both are given,
    else None. Errors are ``ConfigError``s, as ``check_degrees`` raises them."""
    p, t = cfg.parallelism, cfg.training
    check = LayoutCheck(cfg, source_of)
    if args is not None and args.num_experts % p.expert_parallel_degree:  # first: no other degree helps then
        raise check.reject("parallelism.expert_parallel_degree",
                           f"does not divide the number of routed experts ({args.num_experts})",
                           f"a divisor of {args.num_experts} that divides data_parallel_shard x context_parallel")
    shard = check_degrees(cfg, world_size, image_text=image_text, source_of=source_of, world_source=world_source)
    # ---- against the model
    if args is None:
        return None
    rep, cp, pp, ep = (p.data_parallel_replicate_degree, p.context_parallel_degree, p.pipeline_parallel_degree,
                       p.expert_parallel_degree)
    mb, local = p.pipeline_parallel_microbatch_size, t.local_batch_size
    chunks = cp_chunks(p.context_parallel_layout, cp)
    window = args.kda_conv_size - 1  # the earlier tokens a KDA short convolution reads: from the previous piece
    if cp > 1 and t.seq_len // chunks < window:
        raise check.reject("training.seq_len",
                           f"over {check.other('parallelism.context_parallel_degree')} "
                           f"({p.context_parallel_layout}) gives pieces of {t.seq_len // chunks} tokens, shorter "
                           f"than the {window} earlier tokens a KDA short convolution reads",
                           f"seq_len >= {chunks * window}, fewer ranks, or the contiguous layout")
    plan = None
    if pp > 1:
        plan = plan_pipeline(n_layers=args.n_layers, block_size=args.attn_res_block_size, pp=pp,
                             schedule=p.pipeline_parallel_schedule,
                             stages_per_rank=p.pipeline_parallel_stages_per_rank,
                             split=list(p.pipeline_parallel_split))
        _check_microbatches(check, plan, local, mb)
    if world_size is None:
        return None
    global_batch = t.global_batch_size if t.global_batch_size != -1 else local * rep * shard
    return ParallelLayout(world_size, rep, shard, cp, pp, ep, plan, mb, p.context_parallel_layout, local,
                          global_batch, p.expert_parallel_dispatch, p.expert_parallel_node_size)


def _check_microbatches(check: LayoutCheck, plan: PipelinePlan, local_batch_size: int,
                        microbatch_size: int) -> None:
    n = local_batch_size // microbatch_size
    need = {"1F1B": plan.pp, "DualPipeV": plan.num_stages}.get(plan.schedule, 1)
    if n < need:
        raise check.reject("training.local_batch_size",
                           f"/ pipeline_parallel_microbatch_size {microbatch_size} = {n} microbatches, but "
                           f"{plan.schedule} over {plan.num_stages} stages needs at least {need}",
                           f"local_batch_size >= {need * microbatch_size}, a smaller microbatch, or GPipe")
    if plan.schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n // plan.pp)
        if n % rounds:
            raise check.reject("training.local_batch_size",
                               f"/ pipeline_parallel_microbatch_size {microbatch_size} = {n} microbatches: "
                               f"{plan.schedule} needs a multiple of {rounds} (microbatches // "
                               f"pipeline_parallel_degree)", f"e.g. {rounds * plan.pp * microbatch_size}")
