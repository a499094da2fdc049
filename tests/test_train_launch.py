"""Launcher-level runs: the README main job, and torchrun data parallelism against one process."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(cmd, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
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


def test_the_launcher_starts_the_fla_prewarm_before_torch_and_the_trainer_import_starts_nothing(tmp_path):
    """``python -m titan_kimi.train`` (`launch`): FLA's prewarm is spawned before torch is imported and handed
    to the trainer's main, which reaps it; importing the trainer module spawns nothing."""
    record = """
        import json, sys
        from titan_kimi.compile import kernel_prewarm
        seen = {"spawned": []}
        def spawn_early(self, argv, environ=None):
            seen["spawned"].append({"torch imported": "torch" in sys.modules, "argv": list(argv)})
            seen["prewarm"] = id(self)
            return False
        def finish(self, *, stop, quiet=False):
            seen["finished by the trainer"] = id(self) == seen.get("prewarm") and stop
        kernel_prewarm.FlaPrewarm.spawn_early, kernel_prewarm.FlaPrewarm.finish = spawn_early, finish
    """
    launch = record + """
        import titan_kimi.train
        status = titan_kimi.train.launch(["--job.config_file", "train_configs/k31_debug.toml", "--job.dry_run"])
        seen.pop("prewarm")
        print(json.dumps({"status": status, **seen}))
    """
    imported = record + """
        import titan_kimi.trainer
        print(json.dumps(seen))
    """
    results = [json.loads(run([sys.executable, "-c", textwrap.dedent(code)], tmp_path).strip().splitlines()[-1])
               for code in (launch, imported)]
    assert results[0] == {"status": 0, "finished by the trainer": True, "spawned": [
        {"torch imported": False, "argv": ["--job.config_file", "train_configs/k31_debug.toml", "--job.dry_run"]}]}
    assert results[1] == {"spawned": []}
