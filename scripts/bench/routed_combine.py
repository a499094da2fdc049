"""The MoE's dispatch and combine rows, plain torch indexing against the gather-sum kernels: python3 scripts/bench/routed_combine.py --out DIR

Defaults: k31.toml's rank, 4,096 tokens x top-16, latent 3,584. routed_combine = reference (plain torch indexing,
eager and compiled by Inductor) against = triton (lowerings/kernels/routed_combine.py), forward and forward +
backward.

The dispatch is ``z[order // k]`` (its backward sums each token's k rows); the combine unsorts the experts'
outputs and sums them with the router weights in fp32. Writes ``routed_combine.json`` and ``.md`` (medians of
``--reps`` CUDA-event timings after warm-up) with each path's error against fp32.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from timing import median_cuda_ms, rel_err, write_markdown, write_rows  # scripts/bench/ is sys.path[0]
from lowerings.ops import routed_combine as rc
from lowerings.ops.registry import install_backends, resolved_backends


def paths(order, top_k: int, dtype: torch.dtype) -> dict:
    """name -> (dispatch fn, combine fn) under each backend, plus the compiled reference."""
    def backend(name):
        def dispatch(z):
            return rc.dispatch_rows(z, rc.route_rows(order, top_k))

        def combine(rows, weights):
            return rc.combine_rows(rows, rc.route_rows(order, top_k), weights, dtype)
        return name, dispatch, combine

    out = {name: (d, c) for name, d, c in (backend("reference"), backend("triton"))}
    d, c = out["reference"]
    out["reference, compiled"] = (torch.compile(d, fullgraph=True), torch.compile(c, fullgraph=True))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--experts", type=int, default=896)
    parser.add_argument("--latent", type=int, default=3584)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, required=True)
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("routed_combine.py needs a CUDA GPU", file=sys.stderr)
        return 2
    opts.out.mkdir(parents=True, exist_ok=True)
    T, k, L, dtype = opts.tokens, opts.top_k, opts.latent, torch.bfloat16
    torch.manual_seed(0)
    choices = torch.rand(T, opts.experts, device="cuda").topk(k, dim=-1).indices
    order = torch.argsort(choices.view(-1), stable=True)
    z = torch.randn(T, L, device="cuda", dtype=dtype, requires_grad=True)
    rows = torch.randn(T * k, L, device="cuda", dtype=dtype, requires_grad=True)
    weights = torch.rand(T, k, device="cuda", requires_grad=True)
    cot_rows, cot_out = torch.randn_like(rows), torch.randn_like(z)
    exact_combine = rc.combine_rows(rows.float(), rc.route_rows(order, k), weights, torch.float32)  # fp32 rows
    exact_dispatch_grad = rc.routed_gather_sum_op(cot_rows.float(), rc.routing_slots(order, k), None, torch.float32)

    saved = resolved_backends()
    results = []
    try:
        for name, (dispatch, combine) in paths(order, k, dtype).items():
            install_backends(saved.replaced({"routed_combine": "triton" if name == "triton" else "reference"}))

            def dispatch_fwd_bwd():
                z.grad = None
                dispatch(z).backward(cot_rows)

            def combine_fwd_bwd():
                rows.grad = weights.grad = None
                combine(rows, weights).backward(cot_out)

            with torch.no_grad():
                combined = combine(rows, weights)
            dispatch_fwd_bwd()
            row = {"path": name, "error_combine": rel_err(combined, exact_combine),
                   "error_dispatch_grad": rel_err(z.grad, exact_dispatch_grad)}
            for key, fn in (("dispatch_fwd", lambda: dispatch(z)), ("dispatch_fwd_bwd", dispatch_fwd_bwd),
                            ("combine_fwd", lambda: combine(rows, weights)), ("combine_fwd_bwd", combine_fwd_bwd)):
                row[f"{key}_ms"] = median_cuda_ms(fn, warmup=3, repeats=opts.reps)
            results.append(row)
            print(row, flush=True)
    finally:
        install_backends(saved)
    write_rows(str(opts.out / "routed_combine.json"), results, torch.device("cuda"))
    print(write_markdown(
        str(opts.out / "routed_combine.md"),
        f"routed_combine at {T} tokens x top-{k}, latent {L}, bf16 ({torch.cuda.get_device_name()}, torch "
        f"{torch.__version__})",
        [("path", "path", ""), ("dispatch fwd ms", "dispatch_fwd_ms", ".3f"),
         ("dispatch fwd + bwd ms", "dispatch_fwd_bwd_ms", ".3f"), ("combine fwd ms", "combine_fwd_ms", ".3f"),
         ("combine fwd + bwd ms", "combine_fwd_bwd_ms", ".3f"), ("combine error vs fp32", "error_combine", ".2e"),
         ("dispatch grad error", "error_dispatch_grad", ".2e")], results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
