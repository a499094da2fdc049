"""Every available backend of the linear_cross_entropy op on one GPU: python scripts/bench/linear_cross_entropy.py [--out FILE.json]

At the k3_small head (8,192 tokens, hidden 2,048, vocab 163,840) and the full K3 head (hidden 7,168): median
forward+backward and no-grad forward ms over repeats after warm-up, peak memory above the inputs, relative
error against the reference backend, and which backend ``kernels.linear_cross_entropy = auto`` picks.
Prints a markdown table; ``--out`` writes the same as JSON.

    PYTHONPATH=$PWD:/tmp/site python3 scripts/bench/linear_cross_entropy.py --out lce.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lowerings import ops  # noqa: E402
from lowerings.ops.registry import configure_backends  # noqa: E402
from timing import median_cuda_ms, package_versions, rel_err  # noqa: E402  (scripts/bench/ is sys.path[0])

BACKENDS = {"reference": None, "liger": "liger_kernel"}
SHAPES = {"k3_small": (8192, 2048, 163840), "k3": (8192, 7168, 163840)}  # tokens, hidden, vocab
PACKAGES = ("torch", "triton", "liger-kernel")


def _inputs(tokens: int, hidden: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * (3 / hidden**0.5)).bfloat16()
    y = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    y[torch.rand(tokens, device="cuda", generator=g) < 0.05] = ops.IGNORE_INDEX
    return h, w, y


def bench_one(h, w, y, warmup: int, repeats: int) -> tuple[dict, tuple[torch.Tensor, ...]]:
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    normalizer = (y != ops.IGNORE_INDEX).sum().float()

    def train_step() -> torch.Tensor:
        hh.grad = ww.grad = None
        loss = ops.linear_cross_entropy(hh, ww, y, normalizer=normalizer)
        loss.backward()
        return loss

    def eval_step() -> torch.Tensor:
        with torch.no_grad():
            return ops.linear_cross_entropy(hh, ww, y, normalizer=normalizer)

    loss = train_step()  # first call: Triton compiles (outside the timed and measured runs)
    eval_step()
    torch.cuda.synchronize()
    hh.grad = ww.grad = None
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = train_step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    result = {"fwd_bwd_ms": median_cuda_ms(train_step, warmup, repeats), "peak_extra_gib": peak / 2**30}
    hh.grad = ww.grad = None
    torch.cuda.reset_peak_memory_stats()
    result["eval_fwd_ms"] = median_cuda_ms(eval_step, warmup, repeats)
    result["eval_peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    loss = train_step()
    return result, (loss.detach(), hh.grad, ww.grad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    available = [b for b, m in BACKENDS.items() if m is None or importlib.util.find_spec(m) is not None]
    auto = configure_backends({"linear_cross_entropy": "auto"})["linear_cross_entropy"]
    versions = package_versions(PACKAGES)
    rows = []
    for shape in args.shapes:
        tokens, hidden, vocab = SHAPES[shape]
        h, w, y = _inputs(tokens, hidden, vocab)
        reference = None
        for backend in available:
            configure_backends({"linear_cross_entropy": backend})
            try:
                result, outputs = bench_one(h, w, y, args.warmup, args.repeats)
            except torch.OutOfMemoryError as err:
                rows.append({"shape": shape, "backend": backend, "error": f"OOM: {err}"[:200]})
                torch.cuda.empty_cache()
                continue
            if backend == "reference":
                reference = outputs
            if reference is not None:
                result.update({f"rel_err_{k}": rel_err(a, b) for k, a, b in zip(("loss", "d_hidden", "d_weight"),
                                                                                outputs, reference)})
            rows.append({"shape": shape, "tokens": tokens, "hidden": hidden, "vocab": vocab, "backend": backend,
                         **result})
            del outputs
            torch.cuda.empty_cache()
        del h, w, y, reference
        torch.cuda.empty_cache()
    configure_backends({"linear_cross_entropy": "auto"})

    fastest = {}
    for shape in args.shapes:
        timed = [r for r in rows if r["shape"] == shape and "fwd_bwd_ms" in r]
        if timed:
            fastest[shape] = min(timed, key=lambda r: r["fwd_bwd_ms"])["backend"]
    print(f"device: {torch.cuda.get_device_name()}; versions: {versions}")
    print(f"auto picks: {auto}; fastest backend per shape: {fastest}\n")
    print("| shape | backend | fwd+bwd ms | eval fwd ms | peak extra GiB (train / eval) | rel err loss / dh / dW vs reference |")
    print("|---|---|---:|---:|---:|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['backend']} | {r['error']} | | | |")
            continue
        err = " / ".join(f"{r.get('rel_err_' + k, float('nan')):.1e}" for k in ("loss", "d_hidden", "d_weight"))
        print(f"| {r['shape']} T={r['tokens']} H={r['hidden']} V={r['vocab']} | {r['backend']} | "
              f"{r['fwd_bwd_ms']:.2f} | {r['eval_fwd_ms']:.2f} | {r['peak_extra_gib']:.2f} / "
              f"{r['eval_peak_extra_gib']:.2f} | {err} |")
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "versions": versions,
                                        "auto": auto, "fastest": fastest, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
