"""The parallel layout: degrees resolved against the world size and checked against the model and batch, before
any work starts (the config layer has already checked that the degrees multiply to the world size,
``titan_kimi.config.rules.check_world_size``)."""

from __future__ import annotations

from dataclasses import dataclass

from lowerings.ops.sequence_shards import num_chunks
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.parallel.pipeline_plan import PipelinePlan, plan_pipeline


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

    def describe(self) -> str:
        cp = f"cp {self.cp} ({self.cp_layout})" if self.cp > 1 else "cp 1"
        text = (f"world {self.world_size} = dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x "
                f"{cp} x pp {self.pp}; ep {self.ep} x efsdp {self.efsdp} inside dp_shard x cp")
        if self.pipeline is not None:
            p = self.pipeline
            text += (f"; {p.schedule}, {p.num_stages} stages ({p.stages_per_rank} per rank), microbatches of "
                     f"{self.microbatch_size}")
        return text


def resolve_layout(par, world_size: int, args: KimiK3ModelArgs, *, local_batch_size: int = 1,
                   seq_len: int | None = None) -> ParallelLayout:
    """Resolve ``-1`` degrees and check what depends on the model: experts per EP rank, the pipeline's stages
    (whole AttnRes blocks) and its microbatches. Each error names the numbers and what would divide."""
    rep, cp, pp, ep = (par.data_parallel_replicate_degree, par.context_parallel_degree,
                       par.pipeline_parallel_degree, par.expert_parallel_degree)
    shard = par.data_parallel_shard_degree
    if shard == -1:
        shard = world_size // (rep * cp * pp)
    if rep * shard * cp * pp != world_size:
        raise ValueError(
            f"parallelism: data_parallel_replicate {rep} x data_parallel_shard {shard} x context_parallel {cp} x "
            f"pipeline_parallel {pp} = {rep * shard * cp * pp}, not the world size {world_size}")
    if rep > 1 and shard * cp == 1:
        raise ValueError(
            f"parallelism.data_parallel_replicate_degree = {rep} with data_parallel_shard x context_parallel = 1: "
            f"replication alone (DDP) is not built; valid: shard instead (data_parallel_shard_degree = {rep}, "
            f"replicate 1), or HSDP with data_parallel_shard_degree > 1")
    if args.num_experts % ep:
        raise ValueError(
            f"parallelism.expert_parallel_degree = {ep} must divide the number of routed experts "
            f"({args.num_experts}); valid: a divisor of {args.num_experts} that divides dp_shard x cp = {shard * cp}")
    if (shard * cp) % ep:
        raise ValueError(
            f"parallelism.expert_parallel_degree = {ep} must divide data_parallel_shard x context_parallel = "
            f"{shard} x {cp} = {shard * cp}, the ranks experts are spread over")
    if cp > 1:
        _check_context_parallel(args, cp, par.context_parallel_layout, seq_len)
    plan = None
    mb = par.pipeline_parallel_microbatch_size
    if pp > 1:
        plan = plan_pipeline(n_layers=args.n_layers, block_size=args.attn_res_block_size, pp=pp,
                             schedule=par.pipeline_parallel_schedule,
                             stages_per_rank=par.pipeline_parallel_stages_per_rank,
                             split=list(par.pipeline_parallel_split))
        _check_microbatches(plan, local_batch_size, mb)
    elif par.pipeline_parallel_split:
        raise ValueError(
            f"parallelism.pipeline_parallel_split = {list(par.pipeline_parallel_split)} needs "
            f"pipeline_parallel_degree > 1 (it is {pp}); valid: [] without pipeline parallelism")
    return ParallelLayout(world_size, rep, shard, cp, pp, ep, plan, mb, par.context_parallel_layout)


def _check_context_parallel(args: KimiK3ModelArgs, cp: int, layout: str, seq_len: int | None) -> None:
    """Each rank's pieces of a sequence must hold the W-1 rows a KDA short convolution reads before a token
    (they come from the previous piece only)."""
    chunks = num_chunks(layout, cp)  # that seq_len divides into them is a config rule (batch_shapes_divide)
    if seq_len is None:
        return
    window = args.kda_conv_size - 1
    if seq_len // chunks < window:
        raise ValueError(
            f"training.seq_len = {seq_len} over context_parallel_degree {cp} ({layout}) gives pieces of "
            f"{seq_len // chunks} tokens, shorter than the {window} earlier tokens a KDA short convolution "
            f"reads; valid: seq_len >= {chunks * window}, fewer ranks, or the contiguous layout")


def _check_microbatches(plan: PipelinePlan, local_batch_size: int, microbatch_size: int) -> None:
    if local_batch_size % microbatch_size:
        raise ValueError(
            f"parallelism.pipeline_parallel_microbatch_size = {microbatch_size} must divide "
            f"training.local_batch_size = {local_batch_size}")
    n = local_batch_size // microbatch_size
    need = {"1F1B": plan.pp, "DualPipeV": plan.num_stages}.get(plan.schedule, 1)
    if n < need:
        raise ValueError(
            f"training.local_batch_size {local_batch_size} / pipeline_parallel_microbatch_size {microbatch_size} = "
            f"{n} microbatches, but {plan.schedule} over {plan.num_stages} stages needs at least {need}; valid: "
            f"local_batch_size >= {need * microbatch_size}, a smaller microbatch, or GPipe")
    if plan.schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n // plan.pp)
        if n % rounds:
            raise ValueError(
                f"{n} microbatches (local_batch_size / pipeline_parallel_microbatch_size): {plan.schedule} needs "
                f"a multiple of {rounds} (microbatches // pipeline_parallel_degree); valid: e.g. "
                f"{rounds * plan.pp} microbatches")
