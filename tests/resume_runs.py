"""The real Trainer run straight, and stopped then resumed from the same folder: what every step logged and the
whole state each run ended in, compared exactly (or, across layouts, within a relative tolerance).

The end state is everything the next step reads: each rank's weights and buffers, the optimizer state (moments,
step counts) and its groups' hyperparameters (lr included), the schedule's position, the data position and the
RNG streams. Equal end states mean every later step is equal too. Used in one process by
tests/test_resume_exactness.py and on gloo ranks by tests/resume_matrix_worker.py.
"""

from __future__ import annotations

import os
import random
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from titan_kimi.checkpoint.destinations import canonical_fqn
from titan_kimi.config import load_job_config
from titan_kimi.training.process.distributed import DistEnv
from titan_kimi.parallel.layout import resolve_layout
from titan_kimi.trainer import Trainer
from titan_kimi.training.setup.build import model_args_from_config
from titan_kimi.training.process.exit_codes import RunStopped

STEPS = 2  # a resume at step 1: the first step after it updates the weights, which the end state then holds
# The shipped recipe at its smallest: 2 x 32 tokens per step. warmup 1 of a cosine schedule: a run cut at step 1
# and one of 2 steps share their first lr and differ in every later one (what an extended run must not mix up).
SHIPPED = ["--job.config_file", "train_configs/k31_debug.toml", "--training.seq_len", "32",
           "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
           "--metrics.save_jsonl", "false", "--checkpoint.keep_latest_k", "0"]
IMAGE_TEXT = ["--job.config_file", "train_configs/k31_medpix_debug.toml", "--training.local_batch_size", "2",
              "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--metrics.save_jsonl", "false",
              "--checkpoint.keep_latest_k", "0"]


@dataclass
class Outcome:
    logged: list[tuple]  # per step: (step, loss, grad_norm, lr, skipped)
    state: dict[str, Any]  # this rank's end state, by name (see end_state)


def build(folder: Path, argv: list[str], *extra: str, env: DistEnv | None = None) -> Trainer:
    env = env or DistEnv(0, 1, 0)
    cfg = load_job_config([*argv, "--job.dump_folder", str(folder), *extra])
    args = model_args_from_config(cfg)
    layout = resolve_layout(cfg, env.world_size, args)
    return Trainer(cfg, args, layout, env)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def end_state(trainer: Trainer) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for part, opt in zip(trainer.model_parts, trainer.optimizer.optimizers):
        for key, value in part.state_dict().items():
            state[f"model.{canonical_fqn(key)}"] = _local(value)
        names = {p: canonical_fqn(n) for n, p in part.named_parameters()}
        for param, saved in opt.state.items():
            for key, value in saved.items():
                state[f"optimizer.{names[param]}.{key}"] = _local(value) if torch.is_tensor(value) else value
        for group in opt.param_groups:
            for key, value in group.items():
                if key != "params":
                    state[f"param_group.{names[group['params'][0]]}.{key}"] = value
    state["lr_scheduler"] = trainer.lr_scheduler.state_dict()
    state["last_lr"] = trainer.lr_scheduler.get_last_lr()
    state["dataloader"] = trainer.dataloader.state_dict()
    state["rng.torch"] = torch.get_rng_state()
    state["rng.python"] = random.getstate()
    numpy_state = np.random.get_state()
    state["rng.numpy"] = (numpy_state[1].tobytes(), *numpy_state[2:])
    return state


def run(trainer: Trainer, *, sigterm_at: int | None = None, whole: bool = False) -> Outcome:
    """Train to the end (or, with ``sigterm_at``, deliver SIGTERM during that step: the run saves and stops);
    ``whole``: the end state also holds the whole weights (``full_weights``), for comparisons across layouts."""
    if sigterm_at is not None:
        step = trainer.train_step

        def step_then_signal(data_iter):
            if trainer.step == sigterm_at:
                os.kill(os.getpid(), signal.SIGTERM)  # recorded by the run's handler, acted on after the step
            return step(data_iter)

        trainer.train_step = step_then_signal
    try:
        trainer.train()
    except RunStopped:
        assert sigterm_at is not None and trainer.step == sigterm_at
    finally:
        trainer.close()
    logged = [(m.step, m.loss, m.grad_norm, m.lr, m.skipped) for m in trainer.metrics.history]
    state = end_state(trainer)
    if whole:
        state.update(full_weights(trainer))
    return Outcome(logged, state)


def differences(straight: Outcome, parts: list[Outcome]) -> list[str]:
    """Where a run made of ``parts`` (stopped, resumed, ...) differs from the straight run, exactly."""
    out = []
    logged = [row for part in parts for row in part.logged]
    if logged != straight.logged:
        out.append(f"logged steps differ: {logged} vs straight {straight.logged}")
    a, b = straight.state, parts[-1].state
    if a.keys() != b.keys():
        out.append(f"state keys differ: only straight {sorted(a.keys() - b.keys())[:5]}, "
                   f"only resumed {sorted(b.keys() - a.keys())[:5]}")
    unequal = [key for key in sorted(a.keys() & b.keys()) if not _equal(a[key], b[key])]
    if unequal:
        out.append(f"{len(unequal)} of {len(a)} end-state entries differ: {', '.join(unequal[:6])}"
                   + (" ..." if len(unequal) > 6 else ""))
    return out


def _equal(x: Any, y: Any) -> bool:
    if torch.is_tensor(x):
        return torch.is_tensor(y) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    return x == y


def relative_errors(straight: Outcome, resumed: Outcome) -> dict[str, float]:
    """Across layouts: the relative error of the resumed run's logged losses and grad norms, and of its weights
    (whole tensors by name, ``run(whole=True)``; the norm of the difference over the straight run's norm), against
    the straight run's; a logged lr that differs at all counts as an error of 1."""
    errors = {}
    steps = {row[0]: row for row in straight.logged}
    for step, loss, norm, lr, _ in resumed.logged:
        ref = steps[step]
        errors[f"step {step} loss"] = abs(loss - ref[1]) / abs(ref[1])
        errors[f"step {step} grad norm"] = abs(norm - ref[2]) / abs(ref[2])
        errors[f"step {step} lr"] = float(lr != ref[3])
    for key, value in resumed.state.items():
        if key.startswith("full."):
            ref = straight.state[key].float()
            errors[key] = float((value.float() - ref).norm() / ref.norm().clamp(min=1e-30))
    return errors


def full_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter this rank's parts hold, whole (DTensors gathered: a collective), by canonical name."""
    return {f"full.{canonical_fqn(n)}": (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for part in trainer.model_parts for n, p in part.named_parameters()}
