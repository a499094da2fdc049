"""The compute actions each pipeline rank runs, in the order torch.distributed.pipelining runs them, and their
timed simulation.

Orders: ``1F1B`` and ``GPipe`` as their single-stage schedules step (1F1B: ``min(n, stages - stage)`` warm-up
forwards, then one backward and one forward in turn); every multi-stage schedule from torch's own
``pipeline_order`` (built with stand-in stages: no process group, no model). ``OVERLAP_F_B`` pairs (DualPipeV)
run their forward and backward one after the other, as torch does when no overlap function is registered (this
project registers none). ``I`` / ``W`` are the zero-bubble schedules' input- and weight-gradient halves.

The simulation starts every action when its rank is free and its inputs have arrived: a stage's forward after
the previous stage's forward of that microbatch plus the transfer, a backward after the next stage's backward
(input half) plus the transfer, a weight half after its input half.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from titan_kimi.config.schedules import SINGLE_STAGE_SCHEDULES, SPLIT_BACKWARD_SCHEDULES
from titan_kimi.parallel.pipeline_plan import PipelinePlan

FORWARD, BACKWARD, INPUT, WEIGHT = "F", "B", "I", "W"


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str  # F | B (full backward) | I (input gradients) | W (weight gradients)
    microbatch: int


def _single_stage_order(schedule: str, stage: int, num_stages: int, n: int) -> list[Action]:
    f = [Action(stage, FORWARD, m) for m in range(n)]
    b = [Action(stage, BACKWARD, m) for m in range(n)]
    if schedule == "GPipe":
        return f + b
    warmup = min(n, num_stages - stage)
    order = f[:warmup]
    for m in range(n - warmup):
        order += [b[m], f[warmup + m]]
    return order + b[n - warmup:]


class _StandInStage:
    """What torch's multi-stage schedules read from their stages while planning the order."""

    def __init__(self, index: int, num_stages: int, pp: int, rank: int) -> None:
        import torch.nn as nn

        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, pp, rank
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.submod = nn.Module()


def _torch_order(plan: PipelinePlan, n: int) -> dict[int, list[Action]]:
    from torch.distributed.pipelining.schedules import get_schedule_class

    cls = get_schedule_class(plan.schedule)
    stages = [_StandInStage(s, plan.num_stages, plan.pp, 0) for s in plan.stages_of_rank(0)]
    try:
        schedule = cls(stages, n_microbatches=n, loss_fn=lambda out, target: out, scale_grads=False)
    except Exception as e:  # a torch release that reads more from its stages than the stand-ins hold
        raise RuntimeError(f"planning {plan.schedule} over {plan.num_stages} stages and {n} microbatches with "
                           f"stand-in stages failed on this torch ({type(e).__name__}: {e})") from e
    out: dict[int, list[Action]] = {}
    for rank, actions in schedule.pipeline_order.items():
        flat = []
        for a in actions:
            if a is None:
                continue
            for sub in (a.sub_actions or (a,)) if a.computation_type.value == "OVERLAP_F_B" else (a,):
                kind = sub.computation_type.value
                if kind in (FORWARD, BACKWARD, INPUT, WEIGHT):
                    flat.append(Action(sub.stage_index, kind, sub.microbatch_index))
        out[rank] = flat
    return out


@functools.lru_cache(maxsize=256)
def rank_orders(plan: PipelinePlan, n_microbatches: int) -> dict[int, list[Action]]:
    """Every pipeline rank's compute actions in the order its schedule runs them (cached: callers must not
    change the lists)."""
    if plan.schedule in SINGLE_STAGE_SCHEDULES:
        return {r: _single_stage_order(plan.schedule, r, plan.num_stages, n_microbatches) for r in range(plan.pp)}
    return _torch_order(plan, n_microbatches)


def peak_in_flight(order: list[Action]) -> dict[int, int]:
    """Per stage: the most microbatches whose forward ran and whose input-gradient half has not (their
    activations are held)."""
    held: dict[int, int] = {}
    peak: dict[int, int] = {}
    for a in order:
        if a.kind == FORWARD:
            held[a.stage] = held.get(a.stage, 0) + 1
            peak[a.stage] = max(peak.get(a.stage, 0), held[a.stage])
        elif a.kind in (BACKWARD, INPUT):
            held[a.stage] -= 1
    return peak


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one microbatch on one stage: forward, input-gradient and weight-gradient halves of the
    backward (a full backward takes their sum)."""

    forward: float
    backward_input: float
    backward_weight: float

    def of(self, kind: str) -> float:
        return {FORWARD: self.forward, INPUT: self.backward_input, WEIGHT: self.backward_weight,
                BACKWARD: self.backward_input + self.backward_weight}[kind]


@dataclass(frozen=True)
class Timeline:
    end: dict[int, float]  # per rank: when its last action ends
    busy: dict[int, float]  # per rank: seconds computing
    makespan: float
    first_forward_start: dict[int, float]  # per stage: when its first microbatch's forward starts

    def idle(self, rank: int) -> float:
        """The rank's bubble: seconds of the pipeline's span it does not compute."""
        return self.makespan - self.busy[rank]


def simulate(plan: PipelinePlan, n_microbatches: int, times: dict[int, StageTimes],
             transfer: dict[int, float] | None = None, first_forward: dict[int, float] | None = None) -> Timeline:
    """Run every rank's order with ``times[stage]`` per action; ``transfer[s]``: seconds for stage ``s``'s
    output to reach stage ``s + 1`` on another rank (and its gradient to come back); ``first_forward[s]``:
    extra seconds of stage ``s``'s first forward (e.g. the exposed part of its weight all-gather)."""
    transfer, first_forward = transfer or {}, first_forward or {}
    orders = rank_orders(plan, n_microbatches)
    owner = {s: r for r in range(plan.pp) for s in plan.stages_of_rank(r)}
    last = plan.num_stages - 1
    done: dict[Action, float] = {}
    clock = {r: 0.0 for r in orders}
    busy = {r: 0.0 for r in orders}
    pos = {r: 0 for r in orders}
    first_start: dict[int, float] = {}

    def ready(a: Action) -> float | None:
        def after(dep: Action) -> float | None:
            if dep not in done:
                return None
            if owner[dep.stage] == owner[a.stage]:
                return done[dep]
            return done[dep] + transfer.get(min(dep.stage, a.stage), 0.0)

        if a.kind == FORWARD:
            return 0.0 if a.stage == 0 else after(Action(a.stage - 1, FORWARD, a.microbatch))
        if a.kind == WEIGHT:
            return after(Action(a.stage, INPUT, a.microbatch))
        if a.stage == last:
            return after(Action(a.stage, FORWARD, a.microbatch))
        nxt = [after(Action(a.stage + 1, k, a.microbatch)) for k in (BACKWARD, INPUT)]
        nxt = [t for t in nxt if t is not None]
        return min(nxt) if nxt else None

    remaining = sum(len(o) for o in orders.values())
    while remaining:
        progressed = False
        for r, order in orders.items():
            while pos[r] < len(order):
                a = order[pos[r]]
                t = ready(a)
                if t is None:
                    break
                begin = max(clock[r], t)
                cost = times[a.stage].of(a.kind)
                if a.kind == FORWARD and a.microbatch == 0:
                    cost += first_forward.get(a.stage, 0.0)
                    first_start[a.stage] = begin
                clock[r] = begin + cost
                busy[r] += cost
                done[a] = clock[r]
                if a.kind == BACKWARD:  # a full backward holds both halves
                    done[Action(a.stage, INPUT, a.microbatch)] = clock[r]
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: o[pos[r]] for r, o in orders.items() if pos[r] < len(o)}
            raise RuntimeError(f"{plan.schedule}: the simulated schedule cannot progress at {stuck}")
    return Timeline(dict(clock), busy, max(clock.values()), first_start)


def uses_split_backward(schedule: str) -> bool:
    """Whether the schedule runs input and weight gradients as separate actions."""
    return schedule in SPLIT_BACKWARD_SCHEDULES
