"""SiTU-GLU at the k31.toml rank's shapes, the formula (eager and compiled by Inductor) against the Triton kernels: python3 scripts/bench/situ_glu.py --out DIR [--baseline FILE]

Shapes (rows x F, bf16): the routed experts' activations of one 4,096-token microbatch at top-16 (65,536 x
3,072), the two shared experts' (4,096 x 6,144) and the dense first layer's (4,096 x 33,792). Per shape and path:
forward and backward ms (medians of ``--reps`` CUDA-event timings after warm-up), GB/s of the bytes at least
moved (forward reads [g | u] and writes y; backward reads [g | u] and dy and writes d[g | u]) and each output's
error against the fp32 formula. ``--baseline FILE``: a kernel module with the same ``situ_glu_forward`` /
``situ_glu_backward`` (an earlier version of lowerings/kernels/situ_glu.py) timed beside the shipped one. Then
the routed shape at each ``--tiles`` (the op's are ``lowerings.kernels.situ_glu.TILES``). Writes
``situ_glu.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

from timing import median_cuda_ms, rel_err, write_markdown, write_rows  # scripts/bench/ is sys.path[0]
from lowerings.kernels import situ_glu as kernels
from lowerings.ops.situ_glu import situ_glu_reference

SHAPES = {"routed experts": (65536, 3072), "shared experts": (4096, 6144), "dense layer": (4096, 33792)}


def _module(path: Path):
    spec = importlib.util.spec_from_file_location("situ_glu_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _formula_backward(fn):
    def backward(dy, x, beta, beta_lin):
        xr = x.detach().requires_grad_()
        fn(xr, beta, beta_lin).backward(dy)
        return xr.grad
    return backward


def _row(shape: str, path: str, fwd, bwd, x, dy, exact_y, exact_dx, reps: int) -> dict:
    rows, two_f = x.shape
    row = {"shape": f"{shape} ({rows} x {two_f // 2})", "path": path,
           "fwd_ms": median_cuda_ms(lambda: fwd(x, 4.0, 25.0), warmup=3, repeats=reps),
           "bwd_ms": median_cuda_ms(lambda: bwd(dy, x, 4.0, 25.0), warmup=3, repeats=reps),
           "error_y": rel_err(fwd(x, 4.0, 25.0), exact_y), "error_dx": rel_err(bwd(dy, x, 4.0, 25.0), exact_dx)}
    elements = rows * two_f // 2
    row["fwd_gb_s"] = 3 * elements * x.element_size() / (row["fwd_ms"] * 1e-3) / 1e9
    row["bwd_gb_s"] = 5 * elements * x.element_size() / (row["bwd_ms"] * 1e-3) / 1e9
    print(row, flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--baseline", type=Path, help="an earlier kernel module to time beside the shipped one")
    parser.add_argument("--tiles", nargs="*",
                        default=["4x1024x8", "2x1024x4", "2x1024x8", "4x1024x16", "1x1024x4", "4x512x4", "8x1024x8"],
                        help="the kernels' (rows x columns x warps) per program, timed on the routed shape")
    parser.add_argument("--out", type=Path, required=True)
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("situ_glu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    opts.out.mkdir(parents=True, exist_ok=True)
    compiled = torch.compile(situ_glu_reference, fullgraph=True)
    paths = {"formula, eager": (situ_glu_reference, _formula_backward(situ_glu_reference)),
             "formula, compiled by Inductor": (compiled, _formula_backward(compiled))}
    if opts.baseline is not None:
        base = _module(opts.baseline)
        paths["baseline kernels"] = (base.situ_glu_forward, base.situ_glu_backward)
    paths["triton kernels"] = (kernels.situ_glu_forward, kernels.situ_glu_backward)
    results = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape, (rows, F) in SHAPES.items():
        x = (torch.randn(rows, 2 * F, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        dy = torch.randn(rows, F, device="cuda", generator=gen).to(torch.bfloat16)
        x32 = x.float().requires_grad_()
        exact_y = situ_glu_reference(x32, 4.0, 25.0)
        exact_y.backward(dy.float())
        for path, (fwd, bwd) in paths.items():
            results.append(_row(shape, path, fwd, bwd, x, dy, exact_y, x32.grad, opts.reps))
        if shape == "routed experts":
            for spec in opts.tiles:
                tiles = tuple(int(v) for v in spec.split("x"))
                results.append(_row(shape, f"triton kernels, tiles {spec}",
                                    lambda a, b, c, t=tiles: kernels.situ_glu_forward(a, b, c, tiles=t),
                                    lambda d, a, b, c, t=tiles: kernels.situ_glu_backward(d, a, b, c, tiles=t),
                                    x, dy, exact_y, x32.grad, opts.reps))
        del x, dy, x32, exact_y
    write_rows(str(opts.out / "situ_glu.json"), results, torch.device("cuda"))
    print(write_markdown(
        str(opts.out / "situ_glu.md"),
        f"situ_glu, bf16 ({torch.cuda.get_device_name()}, torch {torch.__version__}; shipped tiles {kernels.TILES})",
        [("shape", "shape", ""), ("path", "path", ""), ("fwd ms", "fwd_ms", ".3f"), ("fwd GB/s", "fwd_gb_s", ".0f"),
         ("bwd ms", "bwd_ms", ".3f"), ("bwd GB/s", "bwd_gb_s", ".0f"), ("y error vs fp32", "error_y", ".2e"),
         ("dx error", "error_dx", ".2e")],
        results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
