"""The step-time model's collectives timed beside the model: torchrun ... scripts/bench/collectives.py --out DIR

    torchrun --nnodes N --nproc-per-node G scripts/bench/collectives.py --out DIR [--sizes-mb 64 470] [--repeats 10]

Over all ranks of the launch (NCCL on GPUs, gloo on CPU): an all-gather and a reduce-scatter of a whole tensor of
each size (FSDP's gathers and reduce-scatters; ``--reduce-dtype float32`` for FSDP's fp32 gradients), and an
all-to-all sending each size from every rank, split evenly (the EP exchanges). Each is timed ``--repeats`` times
after ``--warmup`` untimed calls; the median of each rank, then the slowest rank's, is the measured time. Beside it:
what ``titan_kimi/parallel/step_time/comm.py`` predicts with the ``[step_time]`` bandwidths given here (defaults:
the config's), and the bandwidth of the link that bounds the collective in the model that would reproduce the
measurement, so the estimate can be run with ``--step_time.nvlink_gb_per_s`` / ``--step_time.internode_gb_per_s``
set from it. Rank 0 writes ``collectives.json`` and ``collectives.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from titan_kimi.config.sections import StepTime  # noqa: E402
from titan_kimi.parallel.step_time.comm import Network  # noqa: E402

OPS = ("all_gather", "reduce_scatter", "all_to_all")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = StepTime()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for collectives.json and collectives.md")
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[64.0, 470.0],
                   help="whole tensor of an all-gather / reduce-scatter, bytes each rank sends in an all-to-all (MB)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="all-gather and all-to-all elements")
    p.add_argument("--reduce-dtype", choices=sorted(DTYPES), default="float32", help="reduce-scatter elements")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--nvlink-gb-per-s", type=float, default=defaults.nvlink_gb_per_s)
    p.add_argument("--internode-gb-per-s", type=float, default=defaults.internode_gb_per_s)
    p.add_argument("--gpus-per-node", type=int, default=0,
                   help="ranks per node; 0 = torchrun's LOCAL_WORLD_SIZE (the model's step_time.gpus_per_node)")
    p.add_argument("--latency-us", type=float, default=defaults.latency_us)
    opts = p.parse_args(argv)
    bad = [s for s in opts.sizes_mb if s <= 0]
    if bad or opts.repeats < 1 or opts.warmup < 0:
        p.error(f"--sizes-mb {bad or opts.sizes_mb} must be > 0, --repeats {opts.repeats} >= 1, "
                f"--warmup {opts.warmup} >= 0")
    return opts


@dataclasses.dataclass
class Measured:
    op: str
    ranks: int
    nodes: int
    tensor_bytes: int  # the whole tensor (all-gather / reduce-scatter) or what each rank sends (all-to-all)
    dtype: str
    measured_ms: float
    model_ms: float
    bound: str  # the [step_time] key whose link bounds the collective in the model
    implied_gb_per_s: float  # that key's value reproducing the measured time (latency included as configured)


def elements(size_mb: float, dtype: torch.dtype, world: int) -> int:
    """Elements of a tensor of about ``size_mb`` MB, a multiple of ``world`` (even shards and splits)."""
    per = max(1, round(size_mb * 1e6 / dtype.itemsize / world))
    return per * world


def collective(op: str, n: int, dtype: torch.dtype, world: int, device: torch.device) -> Callable[[], None]:
    if op == "all_gather":
        shard, whole = torch.randn(n // world, device=device).to(dtype), torch.empty(n, device=device, dtype=dtype)
        return lambda: dist.all_gather_into_tensor(whole, shard)
    if op == "reduce_scatter":
        whole, shard = torch.randn(n, device=device).to(dtype), torch.empty(n // world, device=device, dtype=dtype)
        # reduce_scatter_single is the newer torches' name (reduce_scatter_tensor then warns)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(shard, whole)
    sent, received = torch.randn(n, device=device).to(dtype), torch.empty(n, device=device, dtype=dtype)
    return lambda: dist.all_to_all_single(received, sent)


def time_ms(fn: Callable[[], None], warmup: int, repeats: int, device: torch.device) -> float:
    """The slowest rank's median of ``repeats`` timed calls, each started together (a barrier before)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


def model_seconds(net: Network, op: str, nbytes: int, world: int) -> float:
    """comm.py's time for the collective: the estimate's own formula."""
    return net.all_to_all(nbytes, world) if op == "all_to_all" else net.ring(nbytes, world)


def bounding_key(net: Network, op: str, nbytes: int, world: int) -> str:
    """The ``[step_time]`` bandwidth the model's time rests on: NVLink if a faster NVLink shortens it."""
    faster = dataclasses.replace(net, nvlink_gb_per_s=2 * net.nvlink_gb_per_s)
    nvlink_bounds = model_seconds(faster, op, nbytes, world) < model_seconds(net, op, nbytes, world)
    return "nvlink_gb_per_s" if nvlink_bounds else "internode_gb_per_s"


def implied(net: Network, key: str, model_s: float, measured_s: float) -> float:
    """``key``'s value at which the model gives the measured time (its time less the latency goes as 1/bandwidth)."""
    spent = measured_s - net.latency
    return getattr(net, key) * (model_s - net.latency) / spent if spent > 0 else float("inf")


def markdown(rows: list[Measured], net: Network, device: str) -> str:
    lines = [f"# Collectives against the step-time model ({device})", "",
             f"Model: {net.describe()}. `implied` is the bounding key's value that reproduces the measurement.", "",
             "| op | ranks | nodes | MB | dtype | measured ms | model ms | measured / model | bounding key "
             "| implied GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.op} | {r.ranks} | {r.nodes} | {r.tensor_bytes / 1e6:.1f} | {r.dtype} "
                     f"| {r.measured_ms:.3f} | {r.model_ms:.3f} | {r.measured_ms / r.model_ms:.2f} | {r.bound} "
                     f"| {r.implied_gb_per_s:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        if world < 2:
            raise ValueError(f"collectives.py: {world} rank(s); the collectives need 2+ (torchrun --nproc-per-node 2+)")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        per_node = opts.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        net = Network(opts.nvlink_gb_per_s, opts.internode_gb_per_s, per_node, opts.latency_us)
        rows = []
        for op in opts.ops:
            name = opts.reduce_dtype if op == "reduce_scatter" else opts.dtype
            dtype = DTYPES[name]
            for size in opts.sizes_mb:
                n = elements(size, dtype, world)
                nbytes = n * dtype.itemsize
                measured = time_ms(collective(op, n, dtype, world, device), opts.warmup, opts.repeats, device)
                predicted = model_seconds(net, op, nbytes, world)
                bound = bounding_key(net, op, nbytes, world)
                rows.append(Measured(op, world, net.nodes(world), nbytes, name, measured, predicted * 1e3, bound,
                                     implied(net, bound, predicted, measured * 1e-3)))
        if rank == 0:
            where = torch.cuda.get_device_name(device) if cuda else "CPU, gloo"
            opts.out.mkdir(parents=True, exist_ok=True)
            record = {"device": where, "network": dataclasses.asdict(net), "torch": torch.__version__,
                      "command": " ".join(sys.argv), "rows": [dataclasses.asdict(r) for r in rows]}
            (opts.out / "collectives.json").write_text(json.dumps(record, indent=1) + "\n")
            table = markdown(rows, net, f"{world} ranks on {net.nodes(world)} node(s), {where}")
            (opts.out / "collectives.md").write_text(table)
            print(table, flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
