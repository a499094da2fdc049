"""The MoE router's fp32 logits, the fp32 matmul against the tensor-core op: python3 scripts/bench/router_logits.py --out DIR

Defaults on CUDA: k31.toml's router, x [4,096, 7,168] and the gate [896, 7,168], bf16. router_logits = reference
(``x.float() @ w.float().t()``: eager, and compiled by Inductor) against = tensor_core (the custom op: bf16
tensor-core GEMMs with fp32 accumulation and output over 256-column slices summed in fp32; the backward's fp32
gradient in two bf16 halves), forward and forward + backward, with each path's output and gradients against an
fp64 truth. Without CUDA it runs as a smoke test at a small shape (``--tokens 64 --dim 128 --experts 16``), the op
on its CPU body, timed by the wall clock. Writes ``router_logits.json`` and ``.md`` (medians of ``--reps`` timings
after warm-up).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

from timing import median_cuda_ms, wall_ms_and_peak, write_markdown, write_rows  # scripts/bench/ is sys.path[0]

rl = importlib.import_module("lowerings.ops.router_logits")  # the module (lowerings.ops.router_logits: the wrapper)

K31 = {"tokens": 4096, "dim": 7168, "experts": 896}
CPU_SMOKE = {"tokens": 64, "dim": 128, "experts": 16}


def rel_err(a: torch.Tensor, exact: torch.Tensor) -> float:
    """``|a - exact| / |exact|`` in fp64 (timing.rel_err's fp32 would floor the logits' error at fp32's rounding)."""
    return ((a.double() - exact).norm() / exact.norm()).item()


def paths() -> dict:
    """name -> fn(x, w) -> fp32 logits."""
    return {"reference": rl.router_logits_reference,
            "reference, compiled": torch.compile(rl.router_logits_reference, fullgraph=True),
            "tensor_core": rl.router_logits_op}


def timer(device: torch.device, reps: int):
    if device.type == "cuda":
        return lambda fn: median_cuda_ms(fn, warmup=3, repeats=reps)
    return lambda fn: wall_ms_and_peak(fn, reps, device)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key in K31:
        parser.add_argument(f"--{key}", type=int, default=None,
                            help=f"default {K31[key]} on CUDA, {CPU_SMOKE[key]} without")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, required=True)
    opts = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    default = K31 if device.type == "cuda" else CPU_SMOKE
    shape = {k: default[k] if getattr(opts, k) is None else getattr(opts, k) for k in K31}
    for key, value in shape.items():
        if value < 1:
            raise ValueError(f"--{key} = {value} must be >= 1")
    opts.out.mkdir(parents=True, exist_ok=True)
    T, D, E = shape["tokens"], shape["dim"], shape["experts"]
    torch.manual_seed(0)
    x = torch.randn(T, D, device=device).bfloat16().requires_grad_()
    w = (torch.randn(E, D, device=device) * D ** -0.5).bfloat16().requires_grad_()
    cot = torch.randn(T, E, device=device)
    x64, w64, g64 = x.detach().double(), w.detach().double(), cot.double()
    exact = {"out": x64 @ w64.t(), "dx": g64 @ w64, "dw": g64.t() @ x64}
    time_ms = timer(device, opts.reps)

    results = []
    for name, fn in paths().items():
        def fwd():
            with torch.no_grad():
                return fn(x, w)

        def fwd_bwd():
            x.grad = w.grad = None
            fn(x, w).backward(cot)

        out = fwd()
        fwd_bwd()
        row = {"path": name, "error_out": rel_err(out, exact["out"]), "error_dx": rel_err(x.grad, exact["dx"]),
               "error_dw": rel_err(w.grad, exact["dw"]), "fwd_ms": time_ms(fwd), "fwd_bwd_ms": time_ms(fwd_bwd)}
        results.append(row)
        print(row, flush=True)
    write_rows(str(opts.out / "router_logits.json"), results, device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu, wall clock: a smoke test"
    print(write_markdown(
        str(opts.out / "router_logits.md"),
        f"router_logits at x [{T}, {D}], gate [{E}, {D}], bf16 ({name}, torch {torch.__version__})",
        [("path", "path", ""), ("fwd ms", "fwd_ms", ".3f"), ("fwd + bwd ms", "fwd_bwd_ms", ".3f"),
         ("logits error vs fp64", "error_out", ".2e"), ("dx error", "error_dx", ".2e"),
         ("dw error", "error_dw", ".2e")], results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
