"""The Triton kernels of lowerings/kernels/ against their torch references at K3 shapes (CUDA): python scripts/bench/fused_ops.py --T 8192 [--out FILE.json]

    python scripts/bench/fused_ops.py --T 4096 8192 16384 32768 --out fused_ops.json [--sweep]

Ops: sparse MLA (96 heads, Dqk 576 / d_v 512, top-k 2048) forward and backward; indexer scores + top-k
(64 heads x 128, top-k 2048); SiTU-GLU over the routed-expert activations (T * 16 rows x 2 * 3072);
AttnRes mix (T rows, 8 bank entries + partial, H 7168). Each timing: CUDA events, warm-up, median of
--reps runs; peak memory is max_memory_allocated above what was allocated before the call. The torch
reference runs only where its estimated memory fits the free device memory (else "skip").

FLOPs: sparse MLA fwd 2*H*k*(576+512) per token (k = valid slots actually used), bwd 2.5x that; indexer
2*HI*D per (query, key) pair inside the causal/document window. SiTU-GLU and AttnRes are memory-bound:
GB/s counts each input and output tensor once. The autotuned configs are first tuned (not timed).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lowerings.settings import configure_kernel_settings, kernel_settings  # noqa: E402
from timing import cuda_times_ms, peak_mib  # noqa: E402  (scripts/bench/ is sys.path[0])

H_MLA, D_QK, D_V, TOPK = 96, 576, 512, 2048
HI, DI = 64, 128
SITU_F, SITU_ROWS_PER_TOKEN = 3072, 16
ATTN_M, HIDDEN = 8, 7168
MLA_SCALE = 192 ** -0.5


def _refs():
    """The pure-PyTorch references live in the test file; load it as a module."""
    path = ROOT / "tests" / "test_triton_kernels.py"
    spec = importlib.util.spec_from_file_location("_titan_kimi_kernel_refs", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def time_cuda(fn: Callable[[], object], warmup: int, reps: int) -> dict:
    """Median / min ms over `reps` CUDA-event timings and the peak memory of one call (MiB)."""
    for _ in range(warmup):
        fn()
    peak = peak_mib(fn)
    times = cuda_times_ms(fn, 0, reps)
    return dict(ms=statistics.median(times), ms_min=min(times), peak_mib=peak)


def _fits(nbytes: float, frac: float = 0.7) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return nbytes < frac * free


def _row(op: str, impl: str, phase: str, T: int, res: dict | None, flops: float, nbytes: float, note: str = ""):
    if res is None:
        return dict(op=op, impl=impl, phase=phase, T=T, ms=None, tflops=None, gbps=None, peak_mib=None, note=note)
    s = res["ms"] / 1e3
    return dict(op=op, impl=impl, phase=phase, T=T, ms=round(res["ms"], 4), ms_min=round(res["ms_min"], 4),
                tflops=round(flops / s / 1e12, 2) if flops else None, gbps=round(nbytes / s / 1e9, 1),
                peak_mib=round(res["peak_mib"], 1), note=note)


def _try(fn: Callable[[], dict]) -> tuple[dict | None, str]:
    try:
        return fn(), ""
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, "OOM"


def mla_indices(T: int, k: int, mode: str, gen: torch.Generator) -> torch.Tensor:
    """full: k distinct random keys in [0, T) per row (every slot valid, FlashMLA-style benchmark);
    causal: k random keys in [0, t], ascending with a -1 suffix (what the indexer emits)."""
    idx = torch.empty(T, min(k, T), dtype=torch.int32, device="cuda")
    ar = torch.arange(T, device="cuda")
    for r0 in range(0, T, 1024):
        r = torch.rand(min(1024, T - r0), T, device="cuda", generator=gen)
        if mode == "causal":
            r = r.masked_fill(ar[None, :] > (r0 + torch.arange(r.shape[0], device="cuda"))[:, None], float("-inf"))
        v, i = r.topk(idx.shape[1], dim=1)
        i = torch.where(torch.isneginf(v), T, i).sort(dim=1).values
        idx[r0:r0 + r.shape[0]] = torch.where(i == T, -1, i).to(torch.int32)
    return idx


def _best_config(autotuner_factory, cfgs) -> str:
    from lowerings.kernels.launch import config_key

    try:
        tuner = autotuner_factory(config_key(cfgs))
        return str(getattr(tuner, "best_config", ""))
    except Exception:  # noqa: BLE001 - informational only
        return ""


def bench_sparse_mla(T: int, args, refs, rows: list) -> None:
    from lowerings.kernels import sparse_mla_bwd as B
    from lowerings.kernels import sparse_mla_fwd as F

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(T, H_MLA, D_QK, device="cuda", dtype=torch.bfloat16, generator=gen)
    kv = torch.randn(T, D_QK, device="cuda", dtype=torch.bfloat16, generator=gen)
    dout = torch.randn(T, H_MLA, D_V, device="cuda", dtype=torch.bfloat16, generator=gen)
    idx = mla_indices(T, TOPK, args.indices, gen)
    n_valid = int((idx >= 0).sum().item())
    f_fwd = 2.0 * H_MLA * n_valid * (D_QK + D_V)
    f_bwd = 2.5 * f_fwd
    k = idx.shape[1]
    b_fwd = q.numel() * 2 + kv.numel() * 2 + idx.numel() * 4 + T * H_MLA * (D_V * 2 + 4)
    b_bwd = b_fwd + dout.numel() * 2 + q.numel() * 2 + kv.numel() * (4 * 2 + 2)
    note = f"indices={args.indices}, valid/row={n_valid / T:.0f}"

    out, lse = F.sparse_mla_forward(q, kv, idx, MLA_SCALE, D_V)  # autotunes on first call
    B.sparse_mla_backward(dout, q, kv, idx, out, lse, MLA_SCALE, D_V)
    ws_off = F.ws_forward_reason(q, kv, D_V)
    if ws_off is None:
        tuned_f = "gluon warp-specialized (sparse_mla_fwd_ws)"
    else:
        # one entry per launch of the head plan: a pinned config, or the autotuner of that head range
        tuned_f = f"triton ({ws_off}); " + "; ".join(
            f"heads {h0}-{h1 - 1}: " + (str(cfg) if cfg is not None else
                                         _best_config(F._autotuned_fwd, F.fwd_configs(h1 - h0))
                                         if F.autotune_enabled(q) else "autotune off")
            for h0, h1, cfg in F.fwd_plan(H_MLA))
    tuned_b = (_best_config(B._autotuned_dq, B.dq_configs(H_MLA)) + " / " + _best_config(B._autotuned_dkv, B.dkv_configs())
               if F.autotune_enabled(q) else "autotune off")
    r = time_cuda(lambda: F.sparse_mla_forward(q, kv, idx, MLA_SCALE, D_V), args.warmup, args.reps)
    rows.append(_row("sparse_mla", "triton", "fwd", T, r, f_fwd, b_fwd, f"{note}; {tuned_f}"))
    r = time_cuda(lambda: B.sparse_mla_backward(dout, q, kv, idx, out, lse, MLA_SCALE, D_V), args.warmup, args.reps)
    rows.append(_row("sparse_mla", "triton", "bwd", T, r, f_bwd, b_bwd, f"{note}; {tuned_b}"))

    if args.sweep:
        for cfg in F.fwd_configs(H_MLA):
            r, err = _try(lambda: time_cuda(lambda: F.sparse_mla_forward(q, kv, idx, MLA_SCALE, D_V, config=cfg),
                                            args.warmup, args.reps))
            rows.append(_row("sparse_mla", "triton-cfg", "fwd", T, r, f_fwd, b_fwd, err or str(cfg)))
        for name, cfgs in (("dq_config", B.dq_configs(H_MLA)), ("dkv_config", B.dkv_configs())):
            for cfg in cfgs:
                kw = {name: cfg}
                fn = lambda: B.sparse_mla_backward(dout, q, kv, idx, out, lse, MLA_SCALE, D_V, **kw)  # noqa: E731
                r, err = _try(lambda: time_cuda(fn, args.warmup, args.reps))
                rows.append(_row("sparse_mla", "triton-cfg", "bwd", T, r, f_bwd, b_bwd, err or f"{name}={cfg}"))

    # torch reference: gathered kv [T, k, 576] bf16 + fp32 scores/probs [T, H, k]; ~3x that with autograd.
    ref_bytes = T * k * D_QK * 2 + T * H_MLA * k * 10
    if args.no_ref or not _fits(3 * ref_bytes):
        rows.append(_row("sparse_mla", "torch", "fwd", T, None, 0, 0, "skip (memory)" if not args.no_ref else "skip"))
        rows.append(_row("sparse_mla", "torch", "bwd", T, None, 0, 0, "skip (memory)" if not args.no_ref else "skip"))
        return
    out = lse = None  # free the Triton outputs before the (large) reference
    torch.cuda.empty_cache()
    r, err = _try(lambda: time_cuda(lambda: refs.ref_sparse_mla(q, kv, idx, MLA_SCALE, D_V), args.warmup, args.reps))
    rows.append(_row("sparse_mla", "torch", "fwd", T, r, f_fwd, b_fwd, err))
    qr, kvr = q.detach().requires_grad_(), kv.detach().requires_grad_()

    def ref_bwd_setup():
        o, _ = refs.ref_sparse_mla(qr, kvr, idx, MLA_SCALE, D_V)
        return lambda: torch.autograd.grad(o, (qr, kvr), dout, retain_graph=True)

    r, err = _try(lambda: time_cuda(ref_bwd_setup(), args.warmup, args.reps))
    rows.append(_row("sparse_mla", "torch", "bwd", T, r, f_bwd, b_bwd, err))
    torch.cuda.empty_cache()


def bench_indexer(T: int, args, refs, rows: list) -> None:
    from lowerings.kernels.indexer_topk import indexer_topk

    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(T, HI, DI, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(T, DI, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(T, HI, device="cuda", generator=gen) * (HI * DI) ** -0.5
    seg = torch.zeros(T, dtype=torch.int32, device="cuda")  # one document: the most work
    pairs = T * (T + 1) / 2
    flops = 2.0 * HI * DI * pairs
    nbytes = q.numel() * 2 + k.numel() * 2 + w.numel() * 4 + T * min(TOPK, T) * 4 + 2 * 4 * pairs
    indexer_topk(q, k, w, seg, TOPK, DI ** -0.5)  # autotune
    r, err = _try(lambda: time_cuda(lambda: indexer_topk(q, k, w, seg, TOPK, DI ** -0.5), args.warmup, args.reps))
    rows.append(_row("indexer_topk", "triton", "fwd", T, r, flops, nbytes, err or "cap 1 GiB"))
    if args.no_ref or not _fits(3 * T * T * 4):
        rows.append(_row("indexer_topk", "torch", "fwd", T, None, 0, 0, "skip"))
        return

    def ref():
        return refs.ref_indexer_topk(refs.ref_indexer_scores(q, k, w, seg, DI ** -0.5, torch.float32), TOPK)

    r, err = _try(lambda: time_cuda(ref, args.warmup, args.reps))
    rows.append(_row("indexer_topk", "torch", "fwd", T, r, flops, nbytes, err or "dense [T,T] fp32, head loop"))
    torch.cuda.empty_cache()


def bench_situ_glu(T: int, args, refs, rows: list) -> None:
    from lowerings.kernels.situ_glu import situ_glu_backward, situ_glu_forward

    n = T * SITU_ROWS_PER_TOKEN
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(n, 2 * SITU_F, device="cuda", dtype=torch.bfloat16, generator=gen) * 4
    dy = torch.randn(n, SITU_F, device="cuda", dtype=torch.bfloat16, generator=gen)
    b_f = n * SITU_F * 2 * 3
    b_b = n * SITU_F * 2 * 5
    note = f"rows={n} (T*{SITU_ROWS_PER_TOKEN}), F={SITU_F}"
    r = time_cuda(lambda: situ_glu_forward(x), args.warmup, args.reps)
    rows.append(_row("situ_glu", "triton", "fwd", T, r, 0, b_f, note))
    r = time_cuda(lambda: situ_glu_backward(dy, x), args.warmup, args.reps)
    rows.append(_row("situ_glu", "triton", "bwd", T, r, 0, b_b, note))
    if args.no_ref or not _fits(12 * x.numel() * 4):
        return
    r, err = _try(lambda: time_cuda(lambda: refs.ref_situ_glu(x.float()).to(x.dtype), args.warmup, args.reps))
    rows.append(_row("situ_glu", "torch", "fwd", T, r, 0, b_f, err or "eager, fp32 math"))
    xr = x.detach().requires_grad_()

    def ref_bwd_setup():
        y = refs.ref_situ_glu(xr.float()).to(x.dtype)
        return lambda: torch.autograd.grad(y, xr, dy, retain_graph=True)

    r, err = _try(lambda: time_cuda(ref_bwd_setup(), args.warmup, args.reps))
    rows.append(_row("situ_glu", "torch", "bwd", T, r, 0, b_b, err or "eager autograd"))
    torch.cuda.empty_cache()


def bench_attn_res_mix(T: int, args, refs, rows: list) -> None:
    from lowerings.kernels.attn_res_mix import attn_res_mix_backward, attn_res_mix_forward

    gen = torch.Generator(device="cuda").manual_seed(3)
    bank = torch.randn(T, ATTN_M, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    part = torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    g = torch.ones(HIDDEN, device="cuda") + 0.1 * torch.randn(HIDDEN, device="cuda", generator=gen)
    w = torch.randn(HIDDEN, device="cuda", generator=gen) * HIDDEN ** -0.5
    dout = torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    b_f = (bank.numel() + 2 * part.numel()) * 2
    b_b = (2 * bank.numel() + 3 * part.numel()) * 2
    note = f"m={ATTN_M}, H={HIDDEN}"
    r = time_cuda(lambda: attn_res_mix_forward(bank, part, g, w, 1e-5), args.warmup, args.reps)
    rows.append(_row("attn_res_mix", "triton", "fwd", T, r, 0, b_f, note))
    r = time_cuda(lambda: attn_res_mix_backward(dout, bank, part, g, w, 1e-5), args.warmup, args.reps)
    rows.append(_row("attn_res_mix", "triton", "bwd", T, r, 0, b_b, note))
    if args.no_ref or not _fits(8 * bank.numel() * 4):
        return

    def ref_fwd():
        return refs.ref_attn_res_mix(bank.float(), part.float(), g, w, 1e-5).to(part.dtype)

    r, err = _try(lambda: time_cuda(ref_fwd, args.warmup, args.reps))
    rows.append(_row("attn_res_mix", "torch", "fwd", T, r, 0, b_f, err or "eager, fp32 math"))
    ins = [t.detach().requires_grad_() for t in (bank, part, g, w)]

    def ref_bwd_setup():
        y = refs.ref_attn_res_mix(ins[0].float(), ins[1].float(), ins[2], ins[3], 1e-5).to(part.dtype)
        return lambda: torch.autograd.grad(y, ins, dout, retain_graph=True)

    r, err = _try(lambda: time_cuda(ref_bwd_setup(), args.warmup, args.reps))
    rows.append(_row("attn_res_mix", "torch", "bwd", T, r, 0, b_b, err or "eager autograd"))
    torch.cuda.empty_cache()


BENCHES = {"sparse_mla": bench_sparse_mla, "indexer_topk": bench_indexer, "situ_glu": bench_situ_glu,
           "attn_res_mix": bench_attn_res_mix}


def markdown(rows: list) -> str:
    head = "| op | impl | phase | T | ms | TFLOP/s | GB/s | peak MiB | note |\n|---|---|---|---|---|---|---|---|---|"
    fmt = lambda v: "-" if v is None else str(v)  # noqa: E731
    lines = [f"| {r['op']} | {r['impl']} | {r['phase']} | {r['T']} | {fmt(r['ms'])} | {fmt(r['tflops'])} | "
             f"{fmt(r['gbps'])} | {fmt(r['peak_mib'])} | {r['note']} |" for r in rows]
    return "\n".join([head, *lines])


def _env() -> dict:
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=commit,
                device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                python=platform.python_version(),
                autotune=kernel_settings().triton_autotune, sparse_mla_ws=kernel_settings().sparse_mla_ws)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, nargs="+", default=[8192], help="token counts, e.g. 4096 8192 16384 32768")
    p.add_argument("--ops", default=",".join(BENCHES), help=f"comma list of {', '.join(BENCHES)}")
    p.add_argument("--indices", choices=["full", "causal"], default="full", help="sparse MLA index pattern")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="also time every sparse-MLA autotune config")
    p.add_argument("--no-ref", action="store_true", help="skip the torch references")
    p.add_argument("--no-autotune", action="store_true",
                   help="use the default configs (kernels.triton_autotune = false)")
    p.add_argument("--no-sparse-mla-ws", action="store_true",
                   help="the Triton-language sparse-MLA forward on Hopper too (kernels.sparse_mla_ws = false)")
    p.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("fused_ops.py: CUDA is not available on this machine; these Triton benchmarks need a GPU "
              "(the CPU interpreter tests are in tests/test_triton_kernels.py).", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("fused_ops.py: unset TRITON_INTERPRET to benchmark compiled kernels.", file=sys.stderr)
        return 2
    if args.reps < 10:
        p.error("--reps must be >= 10")
    configure_kernel_settings(triton_autotune=not args.no_autotune, sparse_mla_ws=not args.no_sparse_mla_ws)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in BENCHES]
    if unknown:
        p.error(f"unknown ops {unknown}; choose from {list(BENCHES)}")
    refs = _refs()
    rows: list = []
    for T in args.T:
        for op in ops:
            print(f"[bench] {op} T={T}", file=sys.stderr, flush=True)
            BENCHES[op](T, args, refs, rows)
            torch.cuda.empty_cache()
    print(markdown(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(env=_env(), args=vars(args) | {"out": str(args.out)}, rows=rows),
                                       indent=1, default=str))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
