"""sparse_mla's backward backends at K3's latent shape: python scripts/bench/sparse_mla_backward.py [--out FILE.json]

Our Triton kernel (`kernels.sparse_mla = triton`) and cuDNN frontend's sm90 DSA backward (`kernels.sparse_mla = cudnn`).

T = 8,192 queries, top-2,048 keys per query from the same 8,192 (576-dim latent rows, the value their first
512 columns), bf16, at 96 heads (K3) and 16 (the small flavors). Two index layouts: ``full`` (every slot valid:
2,048 random keys per row) and ``causal`` (random keys in [0, t], ascending, -1 suffix: what the indexer emits
for one document). Per case: median ms over CUDA events, TFLOP/s (2.5x the forward's 2 H n_valid (576 + 512)),
cuDNN's first call (its CuTe-DSL compile, which a first training step pays), and the relative error of each
backward's dq / dkv against an fp32 reference on the first 256 queries' gradient contributions (dq) and
against each other (dkv).

    PYTHONPATH=$PWD:/tmp/site python3 scripts/bench/sparse_mla_backward.py --out bwd.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fused_ops import mla_indices  # noqa: E402  (scripts/bench/ is sys.path[0])
from timing import cell, median_cuda_ms, package_versions, rel_err  # noqa: E402

D_QK, D_V, TOPK = 576, 512, 2048
SCALE = 192**-0.5


def reference_dq(q, kv, idx, out_grad, rows: int) -> torch.Tensor:
    """fp32 dq of the first ``rows`` queries (dq of a query depends on its own row only)."""
    from lowerings.ops.sparse_mla import sparse_mla_reference

    qr = q[:rows].float().requires_grad_()
    out, _ = sparse_mla_reference(qr, kv.float(), idx[:rows], SCALE, D_V)
    out.backward(out_grad[:rows].float())
    return qr.grad


def bench_case(T: int, H: int, layout: str, warmup: int, repeats: int) -> dict:
    from lowerings.kernels.cudnn_sparse_mla_bwd import cudnn_sparse_mla_backward, unavailable_reason
    from lowerings.kernels.sparse_mla_bwd import sparse_mla_backward
    from lowerings.kernels.sparse_mla_fwd import sparse_mla_forward

    gen = torch.Generator(device="cuda").manual_seed(H)
    q = torch.randn(T, H, D_QK, device="cuda", dtype=torch.bfloat16, generator=gen)
    kv = torch.randn(T, D_QK, device="cuda", dtype=torch.bfloat16, generator=gen)
    dout = torch.randn(T, H, D_V, device="cuda", dtype=torch.bfloat16, generator=gen)
    idx = mla_indices(T, TOPK, layout, gen)
    n_valid = int((idx >= 0).sum())
    flops = 2.5 * 2.0 * H * n_valid * (D_QK + D_V)
    row: dict = {"tokens": T, "heads": H, "layout": layout, "valid_per_row": n_valid / T}
    out, lse = sparse_mla_forward(q, kv, idx, SCALE, D_V)
    want_dq = reference_dq(q, kv, idx, dout, 256)

    def measure(name, fn):
        try:
            t0 = time.perf_counter()
            dq, dkv = fn()
            torch.cuda.synchronize()
            row[f"{name}_first_call_s"] = time.perf_counter() - t0
            ms = median_cuda_ms(fn, warmup, repeats)
            row[f"{name}_ms"] = ms
            row[f"{name}_tflops"] = flops / ms / 1e9
            row[f"{name}_dq_err_vs_fp32"] = rel_err(dq[:256], want_dq)
            return dq, dkv
        except Exception as err:  # a refused shape or a missing runtime: the other backend's numbers still count
            row[f"{name}_error"] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
            return None

    triton = measure("triton", lambda: sparse_mla_backward(dout, q, kv, idx, out, lse, SCALE, D_V))
    reason = unavailable_reason()
    if reason is not None:
        row["cudnn_error"] = reason
        return row
    cudnn = measure("cudnn", lambda: cudnn_sparse_mla_backward(dout, q, kv, idx, out, lse, SCALE, D_V))
    if triton is not None and cudnn is not None:
        row["dq_err_cudnn_vs_triton"] = rel_err(cudnn[0], triton[0])
        row["dkv_err_cudnn_vs_triton"] = rel_err(cudnn[1], triton[1])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, nargs="+", default=[96, 16])
    parser.add_argument("--layouts", nargs="+", default=["causal", "full"], choices=["causal", "full"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    rows = [bench_case(args.tokens, h, layout, args.warmup, args.repeats)
            for h in args.heads for layout in args.layouts]

    print("| heads | layout | triton ms | cudnn ms | triton TFLOP/s | cudnn TFLOP/s | cudnn first call s | dq err vs "
          "fp32: triton / cudnn | cudnn vs triton: dq / dkv |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['heads']} | {r['layout']} | {cell(r, 'triton_ms', '.2f')} | {cell(r, 'cudnn_ms', '.2f')} | "
              f"{cell(r, 'triton_tflops', '.0f')} | {cell(r, 'cudnn_tflops', '.0f')} | "
              f"{cell(r, 'cudnn_first_call_s', '.1f')} | {cell(r, 'triton_dq_err_vs_fp32', '.1e')} / "
              f"{cell(r, 'cudnn_dq_err_vs_fp32', '.1e')} | {cell(r, 'dq_err_cudnn_vs_triton', '.1e')} / "
              f"{cell(r, 'dkv_err_cudnn_vs_triton', '.1e')} |")
        if "cudnn_error" in r:
            print(f"  cudnn: {r['cudnn_error'][:200]}")
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "topk": TOPK, "scale": SCALE,
                "versions": package_versions(("torch", "triton", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl"))}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
