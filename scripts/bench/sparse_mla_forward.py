"""sparse_mla's forward backends at K3's latent shape: python scripts/bench/sparse_mla_forward.py [--out FILE.json]

Ours (`kernels.sparse_mla = triton`: the Gluon warp-specialized kernel on sm90 at these sizes) and DeepSeek
FlashMLA's sm90 sparse prefill forward (`kernels.sparse_mla = flash_mla`, through lowerings/kernels/flash_mla_sparse.py).

T = 8,192 queries, top-2,048 keys per query from the same 8,192 (576-dim latent rows, the value their first 512
columns), bf16, at 16, 96 (K3) and 128 heads. Index layouts: ``causal`` (one document: random keys in [0, t],
ascending, -1 suffix, as the indexer emits; the default) and ``full`` (every slot valid). Per case: median ms over
CUDA events, TFLOP/s as 2 T H top-k (576 + 512) / time (the nominal count; ``*_tflops_valid`` counts only the
valid slots), FlashMLA's first call, and the relative L2 error of out (and the largest lse difference) between
the two. ``flash_mla_raw_ms``: FlashMLA's own function alone where the head count needs no windows (64 / 128),
on the glue's padded indices, to show what the glue costs. Runs without flash_mla too (its reason is reported).

    bash scripts/tools/build_flash_mla.sh build .src/flash_mla_src.tar.xz /tmp/site
    PYTHONPATH=$PWD:/tmp/site python3 scripts/bench/sparse_mla_forward.py --out fwd.json
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

D_QK, D_V = 576, 512
SCALE = 192**-0.5


def lse_max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| where both are finite; inf when their -inf (keyless row) patterns differ."""
    if not torch.equal(torch.isneginf(a), torch.isneginf(b)):
        return float("inf")
    fin = torch.isfinite(a) & torch.isfinite(b)
    return float((a[fin] - b[fin]).abs().max()) if fin.any() else 0.0


def bench_case(T: int, H: int, topk: int, layout: str, warmup: int, repeats: int) -> dict:
    from lowerings.kernels import flash_mla_sparse as fm
    from lowerings.kernels.sparse_mla_fwd import sparse_mla_forward, ws_forward_reason

    gen = torch.Generator(device="cuda").manual_seed(H)
    q = torch.randn(T, H, D_QK, device="cuda", dtype=torch.bfloat16, generator=gen)
    kv = torch.randn(T, D_QK, device="cuda", dtype=torch.bfloat16, generator=gen)
    idx = mla_indices(T, topk, layout, gen)
    n_valid = int((idx >= 0).sum())
    flops, flops_valid = 2.0 * T * H * idx.shape[1] * (D_QK + D_V), 2.0 * H * n_valid * (D_QK + D_V)
    row: dict = {"tokens": T, "heads": H, "topk": idx.shape[1], "layout": layout, "valid_per_row": n_valid / T,
                 "triton_kernel": "gluon" if ws_forward_reason(q, kv, D_V) is None else "triton"}

    def measure(name: str, fn):
        try:
            t0 = time.perf_counter()
            result = fn()
            torch.cuda.synchronize()
            row[f"{name}_first_call_s"] = time.perf_counter() - t0
            ms = median_cuda_ms(fn, warmup, repeats)
            row[f"{name}_ms"] = ms
            row[f"{name}_tflops"] = flops / ms / 1e9
            row[f"{name}_tflops_valid"] = flops_valid / ms / 1e9
            return result
        except Exception as err:  # a refused shape or a broken build: the other backend's numbers still count
            row[f"{name}_error"] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
            return None

    ours = measure("triton", lambda: sparse_mla_forward(q, kv, idx, SCALE, D_V))
    reason = fm.unavailable_reason() or fm.flash_mla_takes(q, kv, idx, D_V)
    if reason is not None:
        row["flash_mla_error"] = reason
        return row
    theirs = measure("flash_mla", lambda: fm.flash_mla_sparse_forward(q, kv, idx, SCALE, D_V))
    if ours is not None and theirs is not None:
        row["out_rel_err_flash_mla_vs_triton"] = rel_err(theirs[0], ours[0])
        row["lse_max_diff_flash_mla_vs_triton"] = lse_max_diff(theirs[1], ours[1])
    if H in fm.SUPPORTED_HEADS:  # the kernel alone, on the indices and row extents the glue would pass
        import flash_mla

        k_pad = -(-idx.shape[1] // fm.TOPK_MULTIPLE) * fm.TOPK_MULTIPLE
        idx3 = torch.nn.functional.pad(idx, (0, k_pad - idx.shape[1]), value=-1).unsqueeze(1).contiguous()
        ext = torch.where(idx >= 0, torch.arange(1, idx.shape[1] + 1, dtype=torch.int32, device="cuda"), 0).amax(1)
        kv3 = kv.unsqueeze(1)
        measure("flash_mla_raw", lambda: flash_mla.flash_mla_sparse_fwd(q, kv3, idx3, SCALE, D_V, topk_length=ext))
    return row


def flash_mla_build() -> str | None:
    """What scripts/tools/build_flash_mla.sh recorded about the importable flash_mla (mode, commits)."""
    try:
        import flash_mla
    except Exception as err:  # noqa: BLE001 - informational only
        return f"not importable: {type(err).__name__}: {err}"
    info = Path(flash_mla.__file__).parent / "BUILD_INFO.txt"
    return info.read_text().strip() if info.exists() else f"{flash_mla.__file__} (no BUILD_INFO.txt)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 96, 128])
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--layouts", nargs="+", default=["causal"], choices=["causal", "full"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from lowerings.kernels.flash_mla_sparse import unavailable_reason

    missing = unavailable_reason()
    if missing is not None:
        print(f"flash_mla: not run ({missing})")
    rows = [bench_case(args.tokens, h, args.topk, layout, args.warmup, args.repeats)
            for h in args.heads for layout in args.layouts]

    print("| heads | layout | ours | ours ms | flash_mla ms | raw flash_mla ms | ours TFLOP/s | flash_mla TFLOP/s | "
          "flash_mla first call s | out rel err | lse max diff |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['heads']} | {r['layout']} | {r['triton_kernel']} | {cell(r, 'triton_ms', '.2f')} | "
              f"{cell(r, 'flash_mla_ms', '.2f')} | {cell(r, 'flash_mla_raw_ms', '.2f')} | "
              f"{cell(r, 'triton_tflops', '.0f')} | {cell(r, 'flash_mla_tflops', '.0f')} | "
              f"{cell(r, 'flash_mla_first_call_s', '.2f')} | {cell(r, 'out_rel_err_flash_mla_vs_triton', '.1e')} | "
              f"{cell(r, 'lse_max_diff_flash_mla_vs_triton', '.1e')} |")
        for key in ("triton_error", "flash_mla_error", "flash_mla_raw_error"):
            if key in r:
                print(f"  {key}: {r[key][:200]}")
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "scale": SCALE, "flash_mla_unavailable": missing,
                "flops": "2 T H topk (576 + 512) (tflops); valid slots only (tflops_valid)",
                "flash_mla_build": flash_mla_build() if missing is None else None,
                "versions": package_versions(("torch", "triton"))}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
