"""SIGTERM mid-run (what Slurm sends before a kill): the step finishes, a resumable checkpoint is written, the run
exits 143 saying so, and resuming gives exactly the losses of an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
STEPS = 12
ARGS = ["--job.config_file", "train_configs/k31_debug.toml", "--training.steps", str(STEPS), "--training.seq_len",
        "32", "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
        "--checkpoint.enable", "--checkpoint.interval", "1000", "--checkpoint.last_save_model_only", "false"]


def losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]


def start(launcher: list[str], folder: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([*launcher, *ARGS, *extra, "--job.dump_folder", str(folder)], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_to_end(launcher: list[str], folder: Path, *extra: str) -> str:
    proc = start(launcher, folder, *extra)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    return out


def logged_steps(folder: Path) -> int:
    path = folder / "metrics.jsonl"
    return path.read_text().count("\n") if path.is_file() else 0  # complete lines only: the file is being written


def signal_after_two_steps(proc: subprocess.Popen, folder: Path, pid_of=lambda proc: proc.pid) -> str:
    deadline = time.time() + 240
    while logged_steps(folder) < 2:
        assert proc.poll() is None and time.time() < deadline, "the run ended before it could be signalled"
        time.sleep(0.05)
    os.kill(pid_of(proc), signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    return out


def test_sigterm_saves_a_resumable_checkpoint_and_resume_matches(tmp_path):
    single = [sys.executable, "-m", "titan_kimi.train"]
    run_to_end(single, tmp_path / "straight")
    proc = start(single, tmp_path / "stopped")
    out = signal_after_two_steps(proc, tmp_path / "stopped")
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    stopped_at = len(losses(tmp_path / "stopped"))
    assert 2 <= stopped_at < STEPS
    assert "received SIGTERM; finishing the current step" in out
    assert f"stopped by SIGTERM after step {stopped_at} of {STEPS}; resumable checkpoint" in out
    assert (tmp_path / "stopped" / "checkpoint" / f"step-{stopped_at}" / ".metadata").is_file()
    resumed = run_to_end(single, tmp_path / "stopped")
    assert f"resumed from {tmp_path / 'stopped' / 'checkpoint' / f'step-{stopped_at}'}" in resumed
    assert losses(tmp_path / "stopped") == losses(tmp_path / "straight")


def _worker_pids(parent: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            children.append(int(stat.parent.name))
    return sorted(children)


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_after_the_same_step(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "titan_kimi.train"]
    fp32 = ("--model.dtype", "float32", "--training.mixed_precision", "false")
    proc = start(torchrun, tmp_path / "dp2", *fp32)
    # Only the second worker gets the signal; the ranks agree after each step, so both stop and save together.
    out = signal_after_two_steps(proc, tmp_path / "dp2", pid_of=lambda p: _worker_pids(p.pid)[-1])
    assert proc.returncode != 0, out[-3000:]
    stopped_at = len(losses(tmp_path / "dp2"))
    assert f"stopped by SIGTERM after step {stopped_at} of {STEPS}; resumable checkpoint" in out, out[-3000:]
    step = tmp_path / "dp2" / "checkpoint" / f"step-{stopped_at}"
    assert (step / ".metadata").is_file()
    assert json.loads((step / "model_args.json").read_text())["n_layers"] == 8  # a complete, committed save
    resumed = run_to_end(torchrun, tmp_path / "dp2", *fp32)
    assert f"resumed from {step}" in resumed
    assert len(losses(tmp_path / "dp2")) == STEPS
