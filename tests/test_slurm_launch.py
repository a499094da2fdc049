"""The Slurm launcher: node lists, the torchrun command, and a real one-node rendezvous through it."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("slurm_launch", ROOT / "scripts" / "slurm" / "launch.py")
launch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)


def test_nodelists_expand_like_scontrol():
    assert launch.expand_nodelist("gpu[01-03,10],login1") == ["gpu01", "gpu02", "gpu03", "gpu10", "login1"]
    assert launch.expand_nodelist("a[8-11]-ib") == ["a8-ib", "a9-ib", "a10-ib", "a11-ib"]
    assert launch.expand_nodelist("node7") == ["node7"]


def test_command_takes_the_rendezvous_from_slurm():
    env = dict(SLURM_JOB_NODELIST="gpu[001-064]", SLURM_NNODES="64", SLURM_NODEID="5", SLURM_GPUS_ON_NODE="4",
               SLURM_JOB_ID="9")
    cmd = launch.torchrun_command(env, ["--job.config_file", "train_configs/k3_hellaswag.toml"])
    assert cmd[1:] == ["-m", "torch.distributed.run", "--nnodes=64", "--nproc-per-node=4", "--node-rank=5",
                       "--rdzv-backend=c10d", "--rdzv-endpoint=gpu001:29500", "--rdzv-id=9", "-m",
                       "titan_kimi.train", "--job.config_file", "train_configs/k3_hellaswag.toml"]
    with pytest.raises(SystemExit, match="SLURM_NNODES=3 but SLURM_JOB_NODELIST names 64 nodes"):
        launch.torchrun_command({**env, "SLURM_NNODES": "3"}, [])
    with pytest.raises(SystemExit, match=r"\$SLURM_NODEID is not set"):
        launch.torchrun_command({k: v for k, v in env.items() if k != "SLURM_NODEID"}, [])


@pytest.mark.slow
def test_one_node_allocation_trains_through_the_launcher(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SLURM_JOB_NODELIST": "localhost",
           "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "2", "MASTER_PORT": "29641"}
    result = subprocess.run(
        [sys.executable, "scripts/slurm/launch.py", "--job.config_file", "train_configs/k31_debug.toml",
         "--parallelism.expert_parallel_degree", "2", "--training.steps", "2", "--lr_scheduler.warmup_steps", "1",
         "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
