"""The kda op's overhead (fla backend) over calling FLA's chunk_kda directly: python scripts/bench/kda_op_overhead.py [--T 8192] [--out FILE.json]

    python scripts/bench/kda_op_overhead.py [--T 8192] [--heads 96] [--dim 128] [--reps 20] [--out result.json]

Both run forward + backward on the same bf16 inputs (B=1, the K3 gate computed in the kernel with
lower_bound -5, L2-normalised q/k); CUDA events, warm-up first (FLA autotunes at a new shape), median of reps.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from timing import median_cuda_ms  # scripts/bench/ is sys.path[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=96)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default="")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("kda_op_overhead.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from fla.ops.kda import chunk_kda

    from lowerings.ops import configure_backends, kda

    configure_backends({"kda": "fla"})
    torch.manual_seed(0)
    T, H, K = opts.T, opts.heads, opts.dim
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v, u = mk(1, T, H, K), mk(1, T, H, K), mk(1, T, H, K), mk(1, T, H, K)
    beta = torch.rand(1, T, H, device="cuda", requires_grad=True)
    A_log = torch.empty(H, device="cuda").uniform_(1, 16).log().requires_grad_()
    dt_bias = (torch.randn(H * K, device="cuda") * 0.1).requires_grad_()
    do = torch.randn(1, T, H, K, device="cuda", dtype=torch.bfloat16)
    inputs = [q, k, v, u, beta, A_log, dt_bias]

    def ours():
        o, _ = kda(q, k, v, u, beta, scale=K**-0.5, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
        torch.autograd.grad(o, inputs, do)

    def direct():
        o, _ = chunk_kda(q, k, v, u, beta, scale=K**-0.5, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
                         safe_gate=True, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True)
        torch.autograd.grad(o, inputs, do)

    for fn in (direct, ours):  # warm-up, autotuning included
        fn()
        fn()
    torch.cuda.synchronize()
    rows = {}
    for name, fn in (("fla_direct", direct), ("titan_kimi_op", ours), ("fla_direct_again", direct)):
        rows[name] = median_cuda_ms(fn, warmup=0, repeats=opts.reps)
    base = min(rows["fla_direct"], rows["fla_direct_again"])
    overhead = rows["titan_kimi_op"] / base - 1
    print(f"| path | fwd+bwd ms (median of {opts.reps}) |\n|---|---|")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.3f} |")
    print(f"overhead of the op over direct FLA: {100 * overhead:+.2f}%  (T={T}, H={H}, d={K})")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"T": T, "H": H, "d": K, "reps": opts.reps, "ms": rows, "overhead": overhead}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
