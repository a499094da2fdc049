"""The parallel layout: degrees resolved against the world size and checked against the model."""

from __future__ import annotations

from dataclasses import dataclass

from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    dp_replicate: int
    dp_shard: int
    cp: int
    pp: int
    ep: int

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        return (f"world {self.world_size} = dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x "
                f"cp {self.cp} x pp {self.pp} (ep {self.ep} inside dp_shard x cp)")


def resolve_layout(par, world_size: int, args: KimiK3ModelArgs) -> ParallelLayout:
    """Resolve ``-1`` degrees and check what depends on the model (the config layer has already checked the
    degrees against the world size, ``titan_kimi.config.rules.check_world_size``)."""
    rep, cp, pp, ep = (par.data_parallel_replicate_degree, par.context_parallel_degree,
                       par.pipeline_parallel_degree, par.expert_parallel_degree)
    shard = par.data_parallel_shard_degree
    if shard == -1:
        shard = world_size // (rep * cp * pp)
    if args.num_experts % ep:
        raise ValueError(
            f"parallelism.expert_parallel_degree = {ep} must divide the number of experts ({args.num_experts})"
        )
    units = args.num_attn_res_blocks or args.n_layers
    if pp > units:
        what = f"{units} AttnRes blocks" if args.num_attn_res_blocks else f"{units} layers"
        raise ValueError(
            f"parallelism.pipeline_parallel_degree = {pp} exceeds the model's {what}: stages hold whole blocks"
        )
    return ParallelLayout(world_size, rep, shard, cp, pp, ep)


def reject_unbuilt(layout: ParallelLayout) -> None:
    """Training runs data parallelism (FSDP2 / HSDP) today; the other degrees pass only ``--job.dry_run``."""
    for name, degree in (("expert_parallel_degree", layout.ep), ("pipeline_parallel_degree", layout.pp),
                         ("context_parallel_degree", layout.cp)):
        if degree > 1:
            raise ValueError(
                f"parallelism.{name} = {degree}: titan_kimi.train runs data parallelism (FSDP2/HSDP) only so far; "
                f"set it to 1 to train, or use --job.dry_run to validate the full-scale layout"
            )
