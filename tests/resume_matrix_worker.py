"""Launched by tests/test_resume_layouts.py under torchrun on 2 gloo ranks (argument: a folder every rank sees).

For EP2, PP2 (1F1B and ZBV) and CP2, the shipped recipe (tests/resume_runs.py) 2 steps straight against 1 step
+ resume + 1 step from the same folder (the first run's final save, extended to 2 steps), compared exactly on
every rank. FSDP2 the same in fp32, whose step-1 checkpoint also resumes under EP2 and under PP2 (it reshards):
compared with the FSDP2 run within CROSS_LAYOUT_RTOL.

Rank 0 prints one line per check: ``RESUME <name> ok`` (across layouts ``... ok worst <relative error>``), or
``RESUME <name> FAIL <what differs, per rank>``.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from resume_runs import SHIPPED, STEPS, build, differences, relative_errors, run
from titan_kimi.training.process.distributed import DistEnv
from tests.worker_exit import run_and_exit

LAYOUTS = {
    "fsdp2": ["--training.local_batch_size", "1"],
    "ep2": ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "1"],
    "pp2_1f1b": ["--parallelism.pipeline_parallel_degree", "2"],
    # Two stages per rank in a V: 2-layer AttnRes blocks, 4 microbatches.
    "pp2_zbv": ["--model.flavor", "k31_debug_pp", "--parallelism.pipeline_parallel_degree", "2",
                "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "--training.local_batch_size", "4"],
    "cp2": ["--parallelism.context_parallel_degree", "2"],
}
EXACT = ("ep2", "pp2_1f1b", "pp2_zbv", "cp2")  # the shipped recipe (bf16 compute); FSDP2 runs in fp32 below
EXTENDED = ("--checkpoint.enable", "true", "--checkpoint.interval", "1")
FP32 = ("--training.mixed_precision", "false")  # the recipe keeps fp32 weights: fp32 compute too
# fp32 layouts give one process's gradients to 1e-4 (tests/test_parallel.py); one step from the same state keeps
# the runs as close.
CROSS_LAYOUT_RTOL = 1e-4


def report(name: str, problems: list[str], env: DistEnv, suffix: str = "") -> None:
    gathered: list[list[str]] = [[] for _ in range(env.world_size)]
    dist.all_gather_object(gathered, problems)
    failed = [f"rank {rank}: {'; '.join(p)}" for rank, p in enumerate(gathered) if p]
    if env.rank == 0:
        print(f"RESUME {name} " + (f"FAIL {' | '.join(failed)}" if failed else f"ok{suffix}"), flush=True)


def extended_run(root: Path, name: str, argv: list[str], env: DistEnv) -> list[str]:
    straight = run(build(root / f"{name}_straight", argv, "--training.steps", str(STEPS), env=env))
    short = run(build(root / name, argv, *EXTENDED, "--training.steps", "1", env=env))
    longer = build(root / name, argv, *EXTENDED, "--training.steps", str(STEPS), env=env)
    if longer.step != 1:
        return [f"resumed at step {longer.step}, not 1"]
    return differences(straight, [short, run(longer)])


def fsdp2_and_across_layouts(root: Path, env: DistEnv) -> None:
    """FSDP2 in fp32: its step-1 save extended under FSDP2 (exact), then copied and resumed under EP2 and PP2."""
    fsdp2 = [*SHIPPED, *FP32, *LAYOUTS["fsdp2"]]
    straight = run(build(root / "fsdp2_straight", fsdp2, "--training.steps", str(STEPS), env=env), whole=True)
    short = run(build(root / "fsdp2", fsdp2, *EXTENDED, "--training.steps", "1", env=env))
    for target in ("ep2", "pp2_1f1b"):
        folder = root / f"fsdp2_to_{target}"
        if env.rank == 0:
            shutil.copytree(root / "fsdp2" / "checkpoint" / "step-1", folder / "checkpoint" / "step-1")
    longer = build(root / "fsdp2", fsdp2, *EXTENDED, "--training.steps", str(STEPS), env=env)
    report("fsdp2", differences(straight, [short, run(longer, whole=True)]) if longer.step == 1
           else [f"resumed at step {longer.step}, not 1"], env)
    for target in ("ep2", "pp2_1f1b"):
        trainer = build(root / f"fsdp2_to_{target}", [*SHIPPED, *FP32, *LAYOUTS[target]], *EXTENDED,
                        "--training.steps", str(STEPS), env=env)
        errors = relative_errors(straight, run(trainer, whole=True)) if trainer.step == 1 else {"resumed": 1.0}
        worst = max(errors.values())
        problems = [f"{k} {v:.2e}" for k, v in errors.items() if v > CROSS_LAYOUT_RTOL]
        worst_all: list[float] = [0.0] * env.world_size
        dist.all_gather_object(worst_all, worst)
        report(f"fsdp2_to_{target}", problems, env, suffix=f" worst {max(worst_all):.2e}")


def main() -> None:
    env = DistEnv.from_environ()
    root = Path(sys.argv[1])
    names = sys.argv[2:] or [*EXACT, "fsdp2"]
    for name in names:
        if name == "fsdp2":
            fsdp2_and_across_layouts(root, env)
        else:
            report(name, extended_run(root, name, [*SHIPPED, *LAYOUTS[name]], env), env)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_and_exit(main)
