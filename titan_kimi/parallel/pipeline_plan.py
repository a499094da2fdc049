"""Which layers each pipeline stage holds, and which stages each pipeline rank runs.

Stages hold whole AttnRes blocks (the bank a stage hands on is only defined at block boundaries): K3's 93 layers
in 12-layer blocks are 8 blocks, so at most 8 stages, virtual stages included. Blocks are split as evenly as
possible, earlier stages taking the extra ones (as the reference does): PP2 = [0, 48), [48, 93).
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_kimi.config.schedules import LOOPED_SCHEDULES, SCHEDULES, SINGLE_STAGE_SCHEDULES, V_SCHEDULES


@dataclass(frozen=True)
class PipelinePlan:
    schedule: str
    pp: int
    stages_per_rank: int
    ranges: tuple[tuple[int, int], ...]  # [first, last) layers of every stage, in pipeline order

    @property
    def num_stages(self) -> int:
        return len(self.ranges)

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        """The stage indices pipeline rank ``pp_rank`` runs, in the order the schedule expects them."""
        if self.schedule in V_SCHEDULES:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + k * self.pp for k in range(self.stages_per_rank)]

    def describe(self) -> list[str]:
        owners = {s: r for r in range(self.pp) for s in self.stages_of_rank(r)}
        return [f"stage {s}: layers [{a}, {b}) on pp rank {owners[s]}" for s, (a, b) in enumerate(self.ranges)]


def default_stages_per_rank(schedule: str) -> int:
    return 1 if schedule in SINGLE_STAGE_SCHEDULES else 2


def plan_pipeline(
    *,
    n_layers: int,
    block_size: int,
    pp: int,
    schedule: str,
    stages_per_rank: int = 0,
    split: list[int] | tuple[int, ...] = (),
) -> PipelinePlan:
    """The stage ranges for ``pp`` ranks running ``schedule``; ``split`` (optional) names the first layer of every
    stage after the first. Raises ValueError naming the numbers when the layout cannot work."""
    if schedule not in SCHEDULES:
        raise ValueError(f"parallelism.pipeline_parallel_schedule = {schedule!r}; valid: {list(SCHEDULES)}")
    per_rank = stages_per_rank or default_stages_per_rank(schedule)
    if schedule in SINGLE_STAGE_SCHEDULES and per_rank != 1:
        raise ValueError(
            f"parallelism.pipeline_parallel_stages_per_rank = {per_rank}: {schedule} runs one stage per rank; "
            f"valid: 0 or 1, or a multi-stage schedule ({', '.join(LOOPED_SCHEDULES + V_SCHEDULES)})")
    if schedule in V_SCHEDULES and per_rank != 2:
        raise ValueError(
            f"parallelism.pipeline_parallel_stages_per_rank = {per_rank}: {schedule} places exactly 2 stages "
            f"on each rank (a V); valid: 0 or 2")
    if schedule in LOOPED_SCHEDULES and per_rank < 2:
        raise ValueError(
            f"parallelism.pipeline_parallel_stages_per_rank = {per_rank}: {schedule} needs at least 2 stages "
            f"per rank; valid: 0 (= 2) or an integer >= 2")
    stages = pp * per_rank
    unit = block_size or 1
    units = -(-n_layers // unit)
    what = f"{units} AttnRes blocks of {block_size} layers" if block_size else f"{units} layers"
    if stages > units:
        raise ValueError(
            f"parallelism.pipeline_parallel_degree = {pp} with {per_rank} stage(s) per rank ({schedule}) is "
            f"{stages} stages, but the model's {n_layers} layers are {what} and every stage holds whole blocks; "
            f"valid: at most {units} stages (pipeline_parallel_degree x stages per rank)")
    if split:
        bounds = [0, *split, n_layers]
        if len(split) != stages - 1:
            raise ValueError(
                f"parallelism.pipeline_parallel_split = {list(split)} names {len(split) + 1} stages, but "
                f"pipeline_parallel_degree {pp} x {per_rank} stage(s) per rank is {stages}; valid: "
                f"{stages - 1} increasing layer indices")
        for a, b in zip(bounds, bounds[1:]):
            if not a < b:
                raise ValueError(
                    f"parallelism.pipeline_parallel_split = {list(split)} is not strictly increasing inside "
                    f"(0, {n_layers}); valid: {stages - 1} increasing layer indices")
        bad = [s for s in split if s % unit]
        if bad:
            raise ValueError(
                f"parallelism.pipeline_parallel_split = {list(split)}: {bad} cut(s) an AttnRes block; "
                f"valid: multiples of {unit} (the attn_res_block_size)")
        ranges = tuple(zip(bounds, bounds[1:]))
    else:
        base, extra = divmod(units, stages)
        ranges, first = [], 0
        for s in range(stages):
            count = base + (1 if s < extra else 0)
            last = min(n_layers, first + count * unit)
            ranges.append((first, last))
            first = last
        ranges = tuple(ranges)
    return PipelinePlan(schedule, pp, per_rank, ranges)
