"""Optimizer step and gradient clip per dtype setting at a flavor's shapes: python scripts/bench/optimizer_step.py [--out FILE.json]

    python3 scripts/bench/optimizer_step.py --out bench_optimizer_step.json     # k3_small, one H200, < 2 min
    python3 scripts/bench/optimizer_step.py --device cpu --flavor k3_debug      # a check of the script

Settings (model.dtype + optimizer.state_dtype): fp32 + fp32, fp32 + bf16, bf16 + bf16, bf16 + fp32; the
fp32-by-design parameters (A_log, convs, router bias) stay fp32 in every one, as in training. ``baseline`` =
torch's fused AdamW where the moments follow the parameters, else the per-parameter reference
``AdamWithStateDtype``, and a two-norm clip; ``shipped`` = build_optimizer and clip_gradients as training runs them.
Prints a markdown table of median milliseconds (CUDA events) of ``optimizer.step()`` and of the clip.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from titan_kimi.config.sections import Optimizer
from titan_kimi.models.kimi_k3 import model_args_for
from titan_kimi.models.kimi_k3.init import cast_model_dtype, fp32_parameter_names
from titan_kimi.models.kimi_k3.model import KimiK3Model
from titan_kimi.training.optim.adam_reference import AdamWithStateDtype
from titan_kimi.training.optim.grad_clip import clip_gradients
from titan_kimi.training.optim.optimizer import build_optimizer

SETTINGS = [("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "bfloat16"), ("bfloat16", "float32")]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def two_norm_clip(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """The baseline clip on one device: a norm, the clip, a second norm to check the clipped gradients."""
    grads = [p.grad for p in params]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if not torch.isfinite(norm):
        return float(norm)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    after = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    bool(torch.isfinite(after))
    return float(norm)


def baseline_optimizer(model: torch.nn.Module, cfg: Optimizer) -> torch.optim.Optimizer:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    keep = fp32_parameter_names(model)
    state_dtype = DTYPES[cfg.state_dtype]
    if all(n in keep or p.dtype == state_dtype for n, p in named):
        return build_optimizer([model], cfg)  # torch fused AdamW, as build_optimizer picks it
    kwargs = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    groups = [{"params": [p for n, p in named if n in keep], "state_dtype": torch.float32},
              {"params": [p for n, p in named if n not in keep], "state_dtype": state_dtype}]
    return AdamWithStateDtype([g for g in groups if g["params"]], decoupled=True, **kwargs)


def timed(fn, reps: int, warmup: int, device: str) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:  # a check of the script on a tiny flavor
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def build(flavor: str, model_dtype: str, device: str) -> KimiK3Model:
    with torch.device("meta"):
        model = KimiK3Model(model_args_for(flavor))
    model.to_empty(device=device)
    cast_model_dtype(model, DTYPES[model_dtype])
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
            if p.requires_grad:
                p.grad = torch.randn_like(p) * 1e-3
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="k3_small")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="", help="write the rows as JSON here")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a check on a tiny flavor")
    opts = parser.parse_args()
    if opts.device == "cuda" and not torch.cuda.is_available():
        print("optimizer_step.py needs a CUDA GPU (or --device cpu)", file=sys.stderr)
        return 2
    cuda = opts.device == "cuda"
    with torch.device("meta"):
        n_params = sum(p.numel() for p in KimiK3Model(model_args_for(opts.flavor)).parameters())
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    began = time.perf_counter()
    rows = []
    for model_dtype, state_dtype in SETTINGS:
        model = build(opts.flavor, model_dtype, opts.device)
        params = [p for p in model.parameters() if p.requires_grad]
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        cfg = Optimizer(state_dtype=state_dtype)
        for impl, make, clip in (("baseline", baseline_optimizer, lambda: two_norm_clip(params, 1.0)),
                                 ("shipped", lambda m, c: build_optimizer([m], c), lambda: clip_gradients(named, 1.0))):
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            opt = make(model, cfg)
            step_ms = timed(opt.step, opts.reps, opts.warmup, opts.device)
            clip_ms = timed(clip, opts.reps, opts.warmup, opts.device)
            rows.append(dict(model_dtype=model_dtype, state_dtype=state_dtype, impl=impl,
                             optimizer=type(opt).__name__, step_ms=step_ms, clip_ms=clip_ms, total_ms=step_ms + clip_ms,
                             peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0))
            del opt
        del model, params, named
    print(f"{opts.flavor}: {n_params:,} parameters, {device_name}, torch {torch.__version__}\n")
    print("| model.dtype | state_dtype | impl | optimizer | step ms | clip ms | total ms | peak GiB |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model_dtype']} | {r['state_dtype']} | {r['impl']} | {r['optimizer']} | {r['step_ms']:.2f} | "
              f"{r['clip_ms']:.2f} | {r['total_ms']:.2f} | {r['peak_gib']:.1f} |")
    print(f"\n{time.perf_counter() - began:.0f} s")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(dict(flavor=opts.flavor, params=n_params, device=device_name,
                           torch=torch.__version__, reps=opts.reps, rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
