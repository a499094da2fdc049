"""The parallel layout of a job: its ``parallelism.*`` degrees resolved against the world size, and the one
function that checks them (``check_layout``).

Every reader takes the layout from here: the config checks (``validate_job_config``, with what is known before the
model exists), the trainer, the dry run and its estimates, the step-time sweep and the rank-slice bench
(``resolve_layout``). torchtitan's ``ParallelDims`` is built from a checked layout only to make the device meshes
(``titan_kimi.parallel.mesh``): it checks by ``assert`` without naming config keys, knows no pipeline plan,
microbatches or CP layout, imports torch (which the config checks must not wait for) and holds process-group
state, while the sweep resolves thousands of layouts without any.

This module imports no torch: the model arguments are only read, and the CP chunk count comes from
``lowerings.ops.sequence_shards`` when context parallelism is on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from titan_kimi.config.errors import ConfigError, bad_value, mention
from titan_kimi.parallel.pipeline_plan import PipelinePlan, plan_pipeline

if TYPE_CHECKING:
    from titan_kimi.config.sections import JobConfig
    from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs

SourceOf = Callable[[str], "str | None"]
_WORLD_KEYS = ("parallelism.data_parallel_replicate_degree", "parallelism.context_parallel_degree",
               "parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree")


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

    def describe(self) -> str:
        cp = f"cp {self.cp} ({self.cp_layout})" if self.cp > 1 else "cp 1"
        text = (f"world {self.world_size} = dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x "
                f"{cp} x pp {self.pp}; ep {self.ep} x efsdp {self.efsdp} inside dp_shard x cp")
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
    world size when given (``world_source`` says where it came from); against the model (routed experts, the
    pipeline's stages of whole AttnRes blocks and its microbatches, the KDA window under CP) when ``args`` are
    given; ``image_text``: the model has a vision tower. Returns the layout when both are given, else None.

    Errors are ``ConfigError`` (a ValueError) naming the config key, its value, where it came from when
    ``source_of`` knows (``validate_job_config``'s sources), and what would be valid."""
    p, t = cfg.parallelism, cfg.training
    check = _Check(cfg, source_of)
    rep, cp, pp, ep = (p.data_parallel_replicate_degree, p.context_parallel_degree, p.pipeline_parallel_degree,
                       p.expert_parallel_degree)
    mb, local = p.pipeline_parallel_microbatch_size, t.local_batch_size
    if args is not None and args.num_experts % ep:  # first: no other degree helps then
        raise check.reject("parallelism.expert_parallel_degree",
                           f"does not divide the number of routed experts ({args.num_experts})",
                           f"a divisor of {args.num_experts} that divides data_parallel_shard x context_parallel")
    # ---- the degrees and the batch, without the world size or the model
    if pp > 1 and local % mb:
        raise check.reject("parallelism.pipeline_parallel_microbatch_size",
                           f"does not divide {check.other('training.local_batch_size')}", f"a divisor of {local}")
    if pp == 1 and p.pipeline_parallel_split:
        raise check.reject("parallelism.pipeline_parallel_split",
                           "needs pipeline_parallel_degree > 1 "
                           f"({check.other('parallelism.pipeline_parallel_degree')})",
                           "[] without pipeline parallelism")
    chunks = _cp_chunks(p.context_parallel_layout, cp)
    if cp > 1 and t.seq_len % chunks:
        raise check.reject("training.seq_len",
                           f"cannot be cut into {chunks} equal chunks for "
                           f"{check.other('parallelism.context_parallel_degree')} with "
                           f"{check.other('parallelism.context_parallel_layout')}", f"a multiple of {chunks}")
    if cp > 1 and image_text:
        raise check.reject("parallelism.context_parallel_degree",
                           "with an image-text model: sharding sequences whose placeholders the model expands into "
                           "image positions is not built", "1 (the image-text recipes train without CP)")
    shard = p.data_parallel_shard_degree
    if shard != -1:
        _experts_fit(check, shard, cp, ep)
    # ---- against the world size
    if world_size is not None:
        fixed = 1
        for key in _WORLD_KEYS:
            fixed *= check.value(key)
        world = f"world size {world_size} ({world_source})"
        if world_size % fixed:
            degrees = ", ".join(check.other(key) for key in _WORLD_KEYS)
            raise ConfigError(f"parallelism: {degrees} multiply to {fixed}, which does not divide {world}; "
                              f"valid: degrees whose product divides {world_size}",
                              key="parallelism", source=check.source(_WORLD_KEYS[-1]), value=fixed)
        if shard != -1 and shard * fixed != world_size:
            raise check.reject("parallelism.data_parallel_shard_degree",
                               f"times the other degrees ({fixed}) is {shard * fixed}, not the {world}",
                               f"-1 or {world_size // fixed}")
        if shard == -1:
            shard = world_size // fixed
            _experts_fit(check, shard, cp, ep)
        if rep > 1 and shard * cp == 1:
            raise check.reject("parallelism.data_parallel_replicate_degree",
                               "with data_parallel_shard x context_parallel = 1: replication alone (DDP) is not "
                               "built", f"shard instead (data_parallel_shard_degree = {rep}, replicate 1), or HSDP "
                               "with data_parallel_shard_degree > 1")
        dp = rep * shard
        if t.global_batch_size != -1 and t.global_batch_size % (local * dp):
            raise check.reject("training.global_batch_size",
                               f"not a multiple of local_batch_size {local} * data-parallel degree {dp} "
                               f"(for the {world})", f"-1 or a multiple of {local * dp}")
    # ---- against the model
    if args is None:
        return None
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
                          global_batch)


class _Check:
    """Renders one config key's value and source into a message (no source when none is known)."""

    def __init__(self, cfg: JobConfig, source_of: SourceOf | None) -> None:
        self.cfg, self.source_of = cfg, source_of

    def value(self, key: str) -> Any:
        section, name = key.split(".")
        return getattr(getattr(self.cfg, section), name)

    def source(self, key: str) -> str | None:
        return self.source_of(key) if self.source_of is not None else None

    def other(self, key: str) -> str:
        return mention(key, self.value(key), self.source(key))

    def reject(self, key: str, problem: str, valid: str) -> ConfigError:
        return bad_value(key, self.value(key), self.source(key), problem, valid)


def _cp_chunks(cp_layout: str, cp: int) -> int:
    if cp == 1:
        return 1
    from lowerings.ops.sequence_shards import num_chunks  # imports torch: only under context parallelism

    return num_chunks(cp_layout, cp)


def _experts_fit(check: _Check, shard: int, cp: int, ep: int) -> None:
    # torchtitan 0.2.2 carves the EP mesh out of the FSDP ranks (data_parallel_shard * context_parallel).
    if (shard * cp) % ep:
        raise check.reject("parallelism.expert_parallel_degree",
                           f"does not divide data_parallel_shard_degree ({shard}) * context_parallel_degree ({cp}) "
                           f"= {shard * cp}, the ranks experts are spread over", f"a divisor of {shard * cp}")


def _check_microbatches(check: _Check, plan: PipelinePlan, local_batch_size: int, microbatch_size: int) -> None:
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
