"""The kda op's backends (reference at small T, fla, cudnn) on one GPU: python scripts/bench/kda.py [--shapes k3] [--out FILE.json]

Through the op (``lowerings.ops.kda``, the K3 configuration: bf16 q/k/v, raw gate input u, post-sigmoid beta, A_log,
dt_bias, lower_bound -5, scale 1/sqrt(128), l2norm inside): median forward (no grad) and forward+backward ms over
repeats after warm-up, peak memory above the inputs, memory the backend keeps cached after its first call, and
the relative error of the output and of every input gradient against fla (and the reference where it runs).

Shapes: k3_small (T=8192, 16 heads, d=128) and K3 (T=8192, 96 heads), plus a small "check" shape where the
reference runs. Document layouts (B=1, packed): dense (no cu_seqlens), one document with cu_seqlens padded by
zero-length segments to 64 slots (what the trainer passes), ~100-token documents padded to the next power of two
(>= 64 slots), and the same documents unpadded. Then the host time of one call at a tiny shape (host-bound: the
GPU finishes first), cuDNN's own layer alone included. Prints markdown tables; ``--out`` writes JSON.

    PYTHONPATH=$PWD:/tmp/site python3 scripts/bench/kda.py --out kda.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lowerings.ops import kda  # noqa: E402
from lowerings.ops.kda import BACKENDS as KDA_BACKENDS  # noqa: E402
from lowerings.ops.registry import configure_backends  # noqa: E402
from timing import median_cuda_ms, package_versions, rel_err  # noqa: E402  (scripts/bench/ is sys.path[0])

D = 128
SHAPES = {"check": (2048, 16), "k3_small": (8192, 16), "k3": (8192, 96)}  # tokens, heads
LAYOUTS = ("dense", "one_doc_padded", "docs_padded", "docs")
GRADS = ("q", "k", "v", "u", "beta", "A_log", "dt_bias")
PACKAGES = ("torch", "triton", "fla-core", "nvidia-cudnn-frontend", "cuda-bindings")


def _slots(n: int) -> int:  # the trainer's bucketing (titan_kimi.models.kimi_k3.sequence.segment_slots)
    return max(64, 1 << (n - 1).bit_length())


def cu_seqlens(layout: str, T: int, seed: int = 0) -> torch.Tensor | None:
    if layout == "dense":
        return None
    if layout == "one_doc_padded":
        bounds = [0, T]
    else:  # documents of about 100 tokens (80 at T = 8192), lengths uniform in [50, 150]
        g = torch.Generator().manual_seed(seed)
        n = max(1, round(T / 102.4))
        lengths = torch.rand(n, generator=g) * 100 + 50
        cuts = (lengths.cumsum(0) / lengths.sum() * T).round().long().tolist()
        bounds = [0, *sorted(set(cuts[:-1]) - {0, T}), T]
    if layout != "docs":
        bounds += [T] * (_slots(len(bounds) - 1) - (len(bounds) - 1))
    return torch.tensor(bounds, dtype=torch.int32, device="cuda")


def make_inputs(T: int, H: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g).bfloat16()
    return [mk(1, T, H, D), mk(1, T, H, D), mk(1, T, H, D), mk(1, T, H, D),
            torch.rand(1, T, H, device="cuda", generator=g),
            torch.empty(H, device="cuda").uniform_(1, 16, generator=g).log(),
            torch.randn(H * D, device="cuda", generator=g) * 0.1]


def bench_one(inputs, do, cu, warmup: int, repeats: int) -> tuple[dict, tuple]:
    leaves = [x.clone().requires_grad_() for x in inputs]

    def call():
        return kda(*leaves[:5], scale=D**-0.5, A_log=leaves[5], dt_bias=leaves[6], lower_bound=-5.0,
                   cu_seqlens=cu)[0]

    def train_step():
        for x in leaves:
            x.grad = None
        o = call()
        o.backward(do)
        return o

    def eval_step():
        with torch.no_grad():
            return call()

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    train_step()  # first call: compiles / autotunes / builds graphs, outside the timed and measured runs
    eval_step()
    for x in leaves:
        x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    train_step()
    torch.cuda.synchronize()
    result = {"peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
              "cached_gib": (base - before) / 2**30}
    result["fwd_ms"] = median_cuda_ms(eval_step, warmup, repeats)
    result["fwd_bwd_ms"] = median_cuda_ms(train_step, warmup, repeats)
    o = train_step()
    return result, (o.detach(), *(x.grad for x in leaves))


def host_overhead(backends: list[str], repeats: int = 200) -> dict[str, float]:
    """Wall µs per forward call at a tiny shape (T=256, 2 heads, one document): the host issues slower than the
    GPU runs, so this is the host cost of one call. ``cudnn_fe_layer`` is cuDNN's run_kda_fwd alone."""
    inputs = make_inputs(256, 2, seed=1)
    cu = torch.tensor([0, 256], dtype=torch.int32, device="cuda")

    def wall_us(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / repeats * 1e6

    out = {}
    with torch.no_grad():
        for backend in backends:
            configure_backends({"kda": backend})
            out[f"{backend}_op_fwd"] = wall_us(lambda: kda(*inputs[:5], scale=D**-0.5, A_log=inputs[5],
                                                           dt_bias=inputs[6], lower_bound=-5.0, cu_seqlens=cu))
        if "cudnn" in backends:
            from lowerings.kernels import cudnn_kda

            q, k, v, u, beta, A_log, dt_bias = inputs
            prep = cudnn_kda.preprocess(q, k, u, beta, A_log, dt_bias, -5.0)
            forward, _ = cudnn_kda._cudnn_kernels()
            thd = [cudnn_kda._thd(t) for t in (prep.q_n, prep.k_n, v, prep.g, prep.beta)]
            out["cudnn_fe_layer_fwd"] = wall_us(lambda: forward(
                q=thd[0], k=thd[1], v=thd[2], g=thd[3], beta=thd[4], cu_seqlens=cu, scale=D**-0.5,
                output_final_state=False, plan_name=cudnn_kda.PLAN))
            out["cudnn_preprocess"] = wall_us(lambda: cudnn_kda.preprocess(q, k, u, beta, A_log, dt_bias, -5.0))
    return out


def _errors(outputs, against) -> dict:
    return {f"rel_err_{n}": rel_err(a, b) for n, a, b in zip(("o", *GRADS), outputs, against)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--reference-max-tokens", type=int, default=2048, help="run the reference up to this T")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    from lowerings.kernels import cudnn_kda

    cudnn_kda.NUMERICS_VALIDATED = True  # measure it even while config refuses it (the table shows its errors)
    unavailable = {b: r for b in ("fla", "cudnn") if (r := KDA_BACKENDS.checks[b]()) is not None}
    backends = ["reference"] + [b for b in ("fla", "cudnn") if b not in unavailable]
    auto = configure_backends({"kda": "auto"})["kda"]
    report = {"device": torch.cuda.get_device_name(), "versions": package_versions(PACKAGES), "auto": auto,
              "unavailable": unavailable, "rows": [], "host_us": {}}
    print(f"device: {report['device']}; versions: {report['versions']}", flush=True)
    print(f"auto picks: {auto}; unavailable: {unavailable or 'none'}", flush=True)

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(report, indent=2))

    for shape in args.shapes:
        T, H = SHAPES[shape]
        inputs = make_inputs(T, H)
        do = torch.randn(inputs[2].shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))
        do = do.bfloat16()  # the output's cotangent, the same for every backend
        for layout in (["docs_padded"] if shape == "check" else args.layouts):
            cu = cu_seqlens(layout, T)
            docs = 1 if cu is None else int((cu[1:] > cu[:-1]).sum())
            slots = 1 if cu is None else cu.shape[0] - 1
            outputs, rows = {}, []
            for backend in backends:
                if backend == "reference" and T > args.reference_max_tokens:
                    continue
                configure_backends({"kda": backend})
                row = {"shape": shape, "T": T, "H": H, "layout": layout, "docs": docs, "slots": slots,
                       "backend": backend}
                try:
                    slow = backend == "reference"
                    result, outputs[backend] = bench_one(inputs, do, cu, 0 if slow else args.warmup,
                                                         1 if slow else args.repeats)
                    row.update(result)
                except Exception as err:  # noqa: BLE001  (an OOM or a backend's refusal is a result here)
                    row["error"] = f"{type(err).__name__}: {err}"[:300]
                torch.cuda.empty_cache()
                rows.append(row)
                print(f"  {shape} {layout} {backend}: " + ", ".join(
                    f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                    if k not in ("shape", "layout", "backend")), flush=True)
            for row in rows:
                for against in ("fla", "reference"):
                    if row["backend"] in outputs and against in outputs and against != row["backend"]:
                        errs = _errors(outputs[row["backend"]], outputs[against])
                        row.update({f"{k}_vs_{against}": v for k, v in errs.items()})
            report["rows"] += rows
            del outputs
            torch.cuda.empty_cache()
            save()
        del inputs, do
        torch.cuda.empty_cache()
    try:
        report["host_us"] = host_overhead([b for b in backends if b != "reference"])
    except Exception as err:  # noqa: BLE001
        report["host_us"] = {"error": f"{type(err).__name__}: {err}"[:300]}
    configure_backends({"kda": "auto"})
    save()

    fastest = {}
    for r in report["rows"]:
        key = f"{r['shape']}/{r['layout']}"
        if "fwd_bwd_ms" in r and r["backend"] != "reference":
            if key not in fastest or r["fwd_bwd_ms"] < fastest[key][1]:
                fastest[key] = (r["backend"], r["fwd_bwd_ms"])
    report["fastest_fwd_bwd"] = {k: v[0] for k, v in fastest.items()}
    save()
    print(f"\nfastest fwd+bwd per shape/layout: {report['fastest_fwd_bwd']}\n")
    print("| shape | layout (docs / slots) | backend | fwd ms | fwd+bwd ms | peak extra GiB | cached GiB | "
          "rel err o vs fla | max rel err grads vs fla | rel err o / grads vs reference |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in report["rows"]:
        head = f"| {r['shape']} T={r['T']} H={r['H']} | {r['layout']} ({r['docs']} / {r['slots']}) | {r['backend']} |"
        if "error" in r:
            print(f"{head} {r['error']} | | | | | | |")
            continue
        fla_o = r.get("rel_err_o_vs_fla")
        fla_g = [r[f"rel_err_{n}_vs_fla"] for n in GRADS if f"rel_err_{n}_vs_fla" in r]
        ref = ([r.get("rel_err_o_vs_reference")] +
               [r[f"rel_err_{n}_vs_reference"] for n in GRADS if f"rel_err_{n}_vs_reference" in r])
        fmt = lambda x: "" if x is None else f"{x:.1e}"
        ref_text = f"{fmt(ref[0])} / {fmt(max(ref[1:]))}" if ref[0] is not None else ""
        print(f"{head} {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {r['peak_extra_gib']:.2f} | "
              f"{r['cached_gib']:.2f} | {fmt(fla_o)} | {fmt(max(fla_g) if fla_g else None)} | {ref_text} |")
    print("\n| host µs per forward call (T=256, H=2, host-bound) | µs |\n|---|---:|")
    for name, us in report["host_us"].items():
        print(f"| {name} | {us:.1f} |" if isinstance(us, float) else f"| {name} | {us} |")


if __name__ == "__main__":
    main()
