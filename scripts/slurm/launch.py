"""Starts titan_kimi.train on every node of a Slurm allocation (train.sbatch runs it): srun --ntasks-per-node=1 python scripts/slurm/launch.py ARGS

Run once per node (``srun --ntasks-per-node=1``; ``train.sbatch`` does this):

    srun --ntasks-per-node=1 python scripts/slurm/launch.py --job.config_file train_configs/k3_hellaswag.toml

The first node of ``SLURM_JOB_NODELIST`` hosts the c10d rendezvous (port ``MASTER_PORT``, default 29500);
``--nproc-per-node`` is ``SLURM_GPUS_ON_NODE`` (or the visible GPUs); every other argument goes to
titan_kimi.train. ``--print`` prints the torchrun command instead of running it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys


def expand_nodelist(nodelist: str) -> list[str]:
    """``gpu[01-03,07],login1`` -> ``[gpu01, gpu02, gpu03, gpu07, login1]`` (what ``scontrol show hostnames``
    prints, for the forms Slurm writes; zero padding kept)."""
    hosts, depth, start = [], 0, 0
    parts = []
    for i, ch in enumerate(nodelist + ","):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    for part in filter(None, parts):
        match = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", part)
        if not match:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            first, _, last = item.partition("-")
            width = len(first)
            for n in range(int(first), int(last or first) + 1):
                hosts.append(f"{prefix}{n:0{width}d}{suffix}")
    return hosts


def _require(env: dict, name: str) -> str:
    if name not in env:
        raise SystemExit(f"launch.py: ${name} is not set: run it inside a Slurm allocation (srun/sbatch)")
    return env[name]


def torchrun_command(env: dict, train_args: list[str]) -> list[str]:
    nodes = expand_nodelist(_require(env, "SLURM_JOB_NODELIST"))
    nnodes = int(env.get("SLURM_NNODES", len(nodes)))
    if nnodes != len(nodes):
        raise SystemExit(f"launch.py: SLURM_NNODES={nnodes} but SLURM_JOB_NODELIST names {len(nodes)} nodes")
    gpus = env.get("SLURM_GPUS_ON_NODE") or str(len(env.get("CUDA_VISIBLE_DEVICES", "0").split(",")))
    port = env.get("MASTER_PORT", "29500")
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={gpus}",
            f"--node-rank={_require(env, 'SLURM_NODEID')}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={nodes[0]}:{port}", f"--rdzv-id={env.get('SLURM_JOB_ID', 'titan_kimi')}",
            "-m", "titan_kimi.train", *train_args]


def main(argv: list[str]) -> int:
    show = "--print" in argv
    command = torchrun_command(dict(os.environ), [a for a in argv if a != "--print"])
    if show:
        print(shlex.join(command))
        return 0
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
