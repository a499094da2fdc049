"""Per-rank peak memory under context parallelism from the dry run's estimate (CPU): python scripts/bench/cp_memory_estimate.py [--T 32768 65536]

    python scripts/bench/cp_memory_estimate.py                       # k31_small, 32K and 64K tokens, CP 1 / 2 / 4
    python scripts/bench/cp_memory_estimate.py --T 131072 --cp 4 8 --ac full

Each row is what ``--job.dry_run --job.estimate_activations`` prints for that layout (world = cp, one sequence
per rank, the recipe's other settings): the parameter, gradient and Adam shards over the FSDP mesh (dp_shard x
cp), the gathered weights in flight, the activations measured on fake tensors for one forward + backward of the
rank's tokens (titan_kimi/parallel/activation_estimate.py), and the indexer's score chunk.
"""

from __future__ import annotations

import argparse
import re
import sys

from titan_kimi.config import load_job_config
from titan_kimi.parallel.estimate import describe_ranks
from titan_kimi.parallel.layout import resolve_layout
from titan_kimi.training.setup.build import model_args_from_config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="train_configs/k31_small.toml")
    parser.add_argument("--T", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    parser.add_argument("--ac", nargs="+", default=["none", "full"], choices=["none", "full", "selective"])
    opts = parser.parse_args()
    print("| tokens | cp | activation checkpointing | params+grads+Adam+in-flight GiB | activations GiB | "
          "indexer chunk GiB | peak GiB per rank |\n|---|---|---|---|---|---|---|")
    for T in opts.T:
        for cp in opts.cp:
            for ac in opts.ac:
                cfg = load_job_config(["--job.config_file", opts.recipe, "--job.dry_run", "--job.world_size", str(cp),
                                       "--parallelism.context_parallel_degree", str(cp),
                                       "--parallelism.context_parallel_layout", opts.layout,
                                       "--training.seq_len", str(T), "--training.local_batch_size", "1",
                                       "--activation_checkpoint.mode", ac, "--job.estimate_activations",
                                       # checkpointed blocks compile whole (module granularity is refused with
                                       # them); compile does not enter the estimate
                                       "--compile.granularity", "module" if ac == "none" else "block"])
                args = model_args_from_config(cfg)
                layout = resolve_layout(cfg, cp, args)
                states_line, act_line = describe_ranks(cfg, args, layout, activations=True)
                states = float(re.search(r"= ([\d.]+) GiB", states_line).group(1))
                number = r"([\d.e+-]+)"
                acts, chunk, peak = (float(x) for x in re.search(
                    rf"activations {number} GiB.*<= {number} GiB -> peak about {number} GiB", act_line).groups())
                where = f"{cp} ({opts.layout})" if cp > 1 else "1"
                print(f"| {T} | {where} | {ac} | {states:.1f} | {acts:.1f} | {chunk:.1f} | {peak:.1f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
