"""One rank's time and memory in a context-parallel K3.1 DSA layer on one GPU: python scripts/bench/cp_dsa_layer.py [--cp 1 2 4] [--out FILE.json]

    python scripts/bench/cp_dsa_layer.py                        # k31_small layer, 32K tokens, CP 1 / 2 / 4, zigzag
    python scripts/bench/cp_dsa_layer.py --cp 1 2 4 8 --layout contiguous --T 65536 --out cp_dsa.json
    python scripts/bench/cp_dsa_layer.py --tiny --T 256 --cp 1 2   # smoke test on CPU with the k31_debug layer

The layer is the model's GatedMLA with the flavor's geometry (k31_small: hidden 2048, 16 heads, kv latent 512,
indexer 64 x 128, top-2048), bf16, with the GPU backends (triton indexer with row-chunked scores, triton
sparse MLA). Rank r of a CP group of W runs exactly what it runs in training: its T / W queries (two pieces
under zigzag) at their global positions, the indexer's top-k over the whole row's keys, sparse MLA over the
whole row's latent. The other ranks' pieces of the gathered latent and keys are computed beforehand on the same
GPU and spliced around this rank's (an all-gather would bring the same values: for k31_small at 32K, 37 MB of
latent and 8 MB of keys per layer, not timed here). Reported per rank (the first and the last of the group;
zigzag balances them, contiguous does not): median ms of forward + backward and the peak memory above the
inputs, as in scripts/bench/dsa_layer.py, and the rank's outputs against the whole row's (relative).
"""

from __future__ import annotations

import argparse
import sys

import torch

from lowerings.ops import configure_backends
from lowerings.ops.indexer_topk import SCORE_BYTES_CAP
from lowerings.settings import configure_kernel_settings
from titan_kimi.models.kimi_k3 import model_args_for
from titan_kimi.parallel.context_parallel import ContextParallel
from dsa_layer import gated_mla_layer  # scripts/bench/ is sys.path[0]
from timing import wall_ms_and_peak, write_rows  # scripts/bench/ is sys.path[0]


class RecordingExchange:
    """A whole row on one rank, taking the context-parallel code path: gather is the identity and records."""

    def __init__(self, global_len: int) -> None:
        self.global_len, self.part_starts, self.recorded = global_len, (0,), []

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        self.recorded.append(x.detach())
        return x


class SplicedExchange:
    """Rank r's view of the gathers: the recorded whole rows with this rank's pieces (with grad) put back."""

    def __init__(self, recorded: list[torch.Tensor], positions: torch.Tensor, part_starts, global_len) -> None:
        self.recorded, self.positions = recorded, positions
        self.part_starts, self.global_len = part_starts, global_len
        self.calls = 0

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        whole = self.recorded[self.calls % len(self.recorded)].clone()
        self.calls += 1
        whole[:, self.positions] = x
        return whole


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="k31_small")
    parser.add_argument("--T", type=int, default=32768, help="tokens of the whole sequence (one row)")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="the k31_debug layer (CPU smoke test)")
    parser.add_argument("--out", default="")
    parser.add_argument("--no-autotune", action="store_true",
                        help="the Triton kernels' default configs (kernels.triton_autotune = false)")
    opts = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not opts.tiny:
        print("cp_dsa_layer.py needs a CUDA GPU (use --tiny on CPU)", file=sys.stderr)
        return 2
    configure_backends({"indexer_topk": "auto", "sparse_mla": "auto"})
    if opts.no_autotune:
        configure_kernel_settings(triton_autotune=False)
    args = model_args_for("k31_debug" if opts.tiny else opts.flavor)
    if not args.has_indexer:
        print(f"--flavor {opts.flavor} has no indexer (use a k31_* flavor)", file=sys.stderr)
        return 2
    mla, dtype, params = gated_mla_layer(args, device)
    T = opts.T
    x_whole = torch.randn(1, T, args.dim, device=device, dtype=dtype)
    grad_whole = torch.randn_like(x_whole)
    doc = torch.ones(1, T, dtype=torch.int32, device=device)
    rows = []
    print(f"{opts.flavor if not opts.tiny else 'k31_debug'} DSA layer, T = {T}, {opts.layout}, {dtype}\n"
          "| cp | rank | queries | fwd+bwd ms | peak MiB | indexer score chunk MiB | output vs whole row |\n"
          "|---|---|---|---|---|---|---|")
    for world in opts.cp:
        whole_seq = ContextParallel(None, "contiguous", rank=0, world=1).build_sequence(1, T, device, doc)
        recording = RecordingExchange(T)
        whole_seq.exchange = recording
        with torch.no_grad():
            y_whole = mla(x_whole, whole_seq).float()
        for rank in sorted({0, world - 1}):
            cp = ContextParallel(None, opts.layout, rank=rank, world=world)
            seq = cp.build_sequence(1, T // world, device, doc)
            pos = cp.positions(T, device=device)
            seq.exchange = SplicedExchange(recording.recorded, pos, seq.exchange.part_starts, T)
            x = x_whole[:, pos].clone().requires_grad_()
            grad = grad_whole[:, pos]

            with torch.no_grad():
                check = ((mla(x, seq).float() - y_whole[:, pos]).norm() / y_whole[:, pos].norm()).item()

            def step():
                torch.autograd.grad(mla(x, seq), [x, *params], grad)

            ms, mem = wall_ms_and_peak(step, opts.reps, device)
            end = T  # the last piece's queries reach every key: the widest score chunk
            chunk = min(SCORE_BYTES_CAP, 4 * (T // world) * end) / 2**20
            rows.append(dict(T=T, cp=world, rank=rank, layout=opts.layout, queries=T // world, ms=ms, peak_mib=mem,
                             score_chunk_mib=chunk, rel_diff=check))
            print(f"| {world} | {rank} | {T // world} | {ms:.2f} | {mem:.0f} | <= {chunk:.0f} | {check:.1e} |",
                  flush=True)
    if opts.out:
        write_rows(opts.out, rows, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
