"""The routed experts' CUDA row alignment, our gather against torchtitan's permutation: python scripts/bench/moe_alignment.py

Both paths: same weights and tokens, fwd + bwd of the grouped-GEMM experts (torchtitan's uses its Triton index kernel).

    python3 scripts/bench/moe_alignment.py            # k31_small shapes: 8,192 tokens x top-6, 64 experts
Prints the median of ``--reps`` timed repetitions (CUDA events) and the peak memory of each path.
"""

from __future__ import annotations

import argparse
import sys

import torch

from timing import median_cuda_ms  # scripts/bench/ is sys.path[0]
from titan_kimi.models.kimi_k3 import model_args_for
from titan_kimi.models.kimi_k3.moe import GroupedExperts, _aligned_for_grouped_mm


def torchtitan_aligned(run, w13, w2, x, counts):
    from torchtitan.models.moe.utils import _permute, _unpermute

    shape, x, permuted, aligned = _permute(x, counts, 1, w13.shape[0])
    return _unpermute(run(w13, w2, x, aligned), shape, permuted)


def measure(path, experts, x, counts, cot, reps: int) -> tuple[float, float]:
    def once():
        out = path(experts.run, experts.w13, experts.w2, x, counts)
        out.backward(cot)

    for _ in range(3):
        once()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = median_cuda_ms(once, warmup=0, repeats=reps)
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="k31_small")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=20)
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("moe_alignment.py needs a CUDA GPU", file=sys.stderr)
        return 2
    args = model_args_for(opts.flavor)
    torch.manual_seed(0)
    experts = GroupedExperts(args.num_experts, args.moe_latent_dim or args.dim, args.moe_inter_dim, args.situ_beta,
                             args.situ_linear_beta, args.init_std).cuda().to(torch.bfloat16)
    experts.init_weights()
    rows = opts.tokens * args.num_experts_per_tok
    choice = torch.randint(0, args.num_experts, (rows,), device="cuda").sort().values
    counts = torch.bincount(choice, minlength=args.num_experts)
    x = torch.randn(rows, experts.w13.shape[-1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cot = torch.randn(rows, experts.w2.shape[1], device="cuda", dtype=torch.bfloat16)
    print(f"| path | fwd+bwd ms | extra peak MiB |  ({opts.flavor}: {rows} rows, {args.num_experts} experts)")
    print("|---|---|---|")
    for name, path in (("gather (titan_kimi)", _aligned_for_grouped_mm), ("torchtitan _permute", torchtitan_aligned)):
        ms, mib = measure(path, experts, x, counts, cot, opts.reps)
        print(f"| {name} | {ms:.3f} | {mib:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
