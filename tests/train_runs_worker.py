"""Several trainer runs in one launch (plain or under torchrun): ``python tests/train_runs_worker.py RUNS.json``.

RUNS.json is a list of ``[argv, copies]``: each run is ``titan_kimi.train.main(argv)``, the same function the
command line calls, one after another in this process. ``copies``: ``[source, destination]`` folders rank 0
copies before that run starts (a checkpoint an earlier run of this launch saved). Rank 0 prints ``TRAIN_RUN <index>``
as each run starts. Starting Python, torch and
torchtitan once instead of once per run is what this saves.

Under torchrun each run gets a process group set up here on its own key prefix of the launcher's store (the
trainer keeps a group it finds and destroys it at its end): a second default group on the first one's keys would
meet their stale entries and hang.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch.distributed as dist
from tests.worker_exit import run_and_exit


def launcher_store() -> dist.Store | None:
    """The torchrun store every rank reaches (hosted by the agent, or else by rank 0); None for a plain process."""
    if "MASTER_ADDR" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                         is_master=not agent_hosts and os.environ["RANK"] == "0")


def main() -> None:
    from titan_kimi.trainer import main as train_main

    store = launcher_store()
    rank = int(os.environ.get("RANK", "0"))
    for index, (argv, copies) in enumerate(json.loads(Path(sys.argv[1]).read_text())):
        if store is not None:
            dist.init_process_group("gloo", store=dist.PrefixStore(f"train_run_{index}", store), rank=rank,
                                    world_size=int(os.environ["WORLD_SIZE"]))
        if rank == 0:
            for source, destination in copies:
                shutil.copytree(source, destination)
        if store is not None:
            dist.barrier()
        if rank == 0:
            print(f"TRAIN_RUN {index}", flush=True)  # what follows on stdout is this run's
        if train_main(argv) != 0:
            raise SystemExit(f"titan_kimi.train {' '.join(argv)} did not exit 0")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_and_exit(main)
