"""Launcher-level runs: the README main job, and torchrun data parallelism against one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(cmd, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def losses(folder):
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_main_recipe_loss_falls_by_30_percent(tmp_path):
    out = run([sys.executable, "-m", "titan_kimi.train", "--job.config_file", "train_configs/k31_debug.toml",
               "--job.dump_folder", str(tmp_path)], tmp_path)
    curve = losses(tmp_path)
    assert len(curve) == 50
    assert curve[-1] <= 0.7 * curve[0], curve
    assert "summary: steps=50" in out


@pytest.mark.slow
def test_torchrun_data_parallel_matches_one_process(tmp_path):
    common = ["--job.config_file", "train_configs/k31_debug.toml", "--model.dtype", "float32",
              "--training.mixed_precision", "false", "--training.steps", "4", "--training.seq_len", "64",
              "--training.global_batch_size", "4", "--data.shuffle", "false",
              "--lr_scheduler.warmup_steps", "1"]
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "titan_kimi.train", *common,
         "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path / "dp2")], tmp_path)
    run([sys.executable, "-m", "titan_kimi.train", *common, "--training.local_batch_size", "4",
         "--job.dump_folder", str(tmp_path / "single")], tmp_path)
    dp2, single = losses(tmp_path / "dp2"), losses(tmp_path / "single")
    assert len(dp2) == len(single) == 4
    # Same global batch and initial weights: step 1 agrees to fp32 rounding; later steps drift by summation
    # order (gloo reduce-scatter vs one process), amplified by Adam's sign-like first updates.
    assert dp2[0] == pytest.approx(single[0], rel=1e-6)
    for a, b in zip(dp2[1:], single[1:]):
        assert a == pytest.approx(b, rel=1e-3)
