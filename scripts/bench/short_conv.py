"""The KDA short convolution, the formula (eager and compiled by Inductor) against the Triton kernels: python3 scripts/bench/short_conv.py --out DIR

Defaults: one k31.toml microbatch at a KDA layer, 4,096 tokens x 12,288 channels (96 heads x 128), 4 taps, bf16,
documents of 1,152 and 2,944 tokens. short_conv = reference (eager; compiled, as a compiled KDA layer runs it) against
= triton (lowerings/kernels/short_conv.py), forward and forward + backward, with each path's error against the
fp32 formula and the bytes moved at the memory's rate. Writes ``short_conv.json`` and ``.md`` (medians of ``--reps``
CUDA-event timings after warm-up); then the kernels alone at each ``--tiles`` (the op's are
``lowerings.kernels.short_conv.TILES``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

from timing import median_cuda_ms, rel_err, write_markdown, write_rows  # scripts/bench/ is sys.path[0]
from lowerings.ops.registry import install_backends, resolved_backends

sc = importlib.import_module("lowerings.ops.short_conv")  # the module (lowerings.ops.short_conv is its function)


def with_rates(row: dict, elements: int) -> dict:
    """``row`` with GB/s from the bytes at least moved (bf16): x read and y written forward; x and dy read, dx
    written backward."""
    row["fwd_gb_s"] = 2 * elements * 2 / (row["fwd_ms"] * 1e-3) / 1e9
    row["fwd_bwd_gb_s"] = 5 * elements * 2 / (row["fwd_bwd_ms"] * 1e-3) / 1e9
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--channels", type=int, default=96 * 128)
    parser.add_argument("--taps", type=int, default=4)
    parser.add_argument("--first-document", type=int, default=1152, help="tokens of the row's first document")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tiles", nargs="*", default=["32x128x8", "16x128x4", "32x64x4", "64x64x8", "64x128x8"],
                        help="the triton kernels' (rows x channels x warps) per program, each timed on its own")
    parser.add_argument("--out", type=Path, required=True)
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("short_conv.py needs a CUDA GPU", file=sys.stderr)
        return 2
    opts.out.mkdir(parents=True, exist_ok=True)
    S, C, W = opts.tokens, opts.channels, opts.taps
    torch.manual_seed(0)
    x = torch.randn(1, S, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(C, W, device="cuda") * 0.5).requires_grad_()
    t = torch.arange(S, device="cuda", dtype=torch.int32)
    pos = torch.where(t < opts.first_document, t, t - opts.first_document).unsqueeze(0).contiguous()
    cot = torch.randn_like(x)
    x32 = x.detach().float().requires_grad_()
    w32 = w.detach().clone().requires_grad_()
    exact = sc.short_conv_reference(x32, w32, pos)
    exact.backward(cot.float())

    compiled = torch.compile(sc.short_conv, fullgraph=True)
    runs = {"reference": sc.short_conv, "reference, compiled": compiled, "triton": sc.short_conv}
    saved = resolved_backends()
    results = []
    try:
        for name, fn in runs.items():
            install_backends(saved.replaced({"short_conv": "triton" if name == "triton" else "reference"}))

            def fwd_bwd():
                x.grad = w.grad = None
                fn(x, w, pos).backward(cot)

            with torch.no_grad():
                y = fn(x, w, pos)
            fwd_bwd()
            row = {"path": name, "error_y": rel_err(y, exact), "error_dx": rel_err(x.grad, x32.grad),
                   "error_dw": rel_err(w.grad, w32.grad),
                   "fwd_ms": median_cuda_ms(lambda: fn(x, w, pos), warmup=3, repeats=opts.reps),
                   "fwd_bwd_ms": median_cuda_ms(fwd_bwd, warmup=3, repeats=opts.reps)}
            results.append(with_rates(row, x.numel()))
            print(row, flush=True)
    finally:
        install_backends(saved)
    from lowerings.kernels.short_conv import short_conv_backward, short_conv_forward

    xd, wd = x.detach(), w.detach().float()
    for spec in opts.tiles:
        tiles = tuple(int(v) for v in spec.split("x"))
        row = {"path": f"triton kernels, tiles {spec}",
               "fwd_ms": median_cuda_ms(lambda: short_conv_forward(xd, wd, pos, tiles=tiles), warmup=3,
                                        repeats=opts.reps),
               "bwd_ms": median_cuda_ms(lambda: short_conv_backward(cot, xd, wd, pos, tiles=tiles), warmup=3,
                                        repeats=opts.reps)}
        row["fwd_bwd_ms"] = row["fwd_ms"] + row["bwd_ms"]
        with_rates(row, x.numel())
        dx, dw = short_conv_backward(cot, xd, wd, pos, tiles=tiles)
        row.update(error_y=rel_err(short_conv_forward(xd, wd, pos, tiles=tiles), exact),
                   error_dx=rel_err(dx, x32.grad), error_dw=rel_err(dw, w32.grad))
        results.append(row)
        print(row, flush=True)
    write_rows(str(opts.out / "short_conv.json"), results, torch.device("cuda"))
    print(write_markdown(
        str(opts.out / "short_conv.md"),
        f"short_conv at {S} tokens x {C} channels, {W} taps, bf16 ({torch.cuda.get_device_name()}, torch "
        f"{torch.__version__})",
        [("path", "path", ""), ("fwd ms", "fwd_ms", ".3f"), ("fwd GB/s", "fwd_gb_s", ".0f"),
         ("fwd + bwd ms", "fwd_bwd_ms", ".3f"), ("fwd + bwd GB/s", "fwd_bwd_gb_s", ".0f"),
         ("y error vs fp32", "error_y", ".2e"), ("dx error", "error_dx", ".2e"), ("dw error", "error_dw", ".2e")],
        results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
