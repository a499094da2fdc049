"""Tunes FLA's KDA kernels on this GPU into the configs titan_kimi ships: python scripts/tools/tune_fla_configs.py [--heads 16 96]

    python scripts/tools/tune_fla_configs.py [--heads 16 24 96] [--dim 128] [--seq-lens 8192] [--varlen-docs 8]
                                       [--out DIR] [--no-check]

Runs the ``titan_kimi::kda`` op (fla backend; the public ``lowerings.ops.kda`` entry point, so the kernel keys
are those training produces) forward + backward with FLA_CACHE_MODE=disabled, so every kernel autotunes, then
dumps the tuned configs to ``--out`` (default ``lowerings/kernels/fla_configs/<this GPU>``), merging with what
is there. Inputs as the model passes them (``KimiDeltaAttention``): bf16 q/k/v/gate input [1,T,H,d], fp32 beta
[1,T,H], fp32 A_log [H] and dt_bias [H*d], gate lower bound -5, scale d^-0.5, L2-normalised q/k. Training
always packs documents (cu_seqlens even for one document), which is the varlen case; the dense B=1 case is
what benchmarks and callers without cu_seqlens use. Both are tuned (``--varlen-docs 0`` skips varlen).

FLA's fuzzy lookup takes the first entry of the same key structure, so the first ``--heads`` / ``--seq-lens``
values are the fallback for shapes not tuned here. Afterwards (unless ``--no-check``) a fresh process reruns
the shapes with the shipped configs (FLA_CACHE_MODE=fuzzy) and reports whether any kernel still autotuned.
Each run merges, so the work can be split over several invocations (e.g. one per ``--heads`` value).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 24, 96],
                        help="KDA heads per GPU (k3_small/k31_small 16, k3_medium 24, k3/k31 96)")
    parser.add_argument("--dim", type=int, default=128, help="KDA head dim (every GPU flavor: 128)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192], help="tokens per sequence (B=1)")
    parser.add_argument("--varlen-docs", type=int, default=8,
                        help="also run the packed varlen case, T split into this many documents (0: skip)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the {kernel}.json files go (default lowerings/kernels/fla_configs/<GPU>)")
    parser.add_argument("--no-check", action="store_true", help="skip rerunning the shapes with the dumped configs")
    parser.add_argument("--check-only", action="store_true", help=argparse.SUPPRESS)  # the check's child process
    opts = parser.parse_args(argv)
    if min(opts.heads) < 1 or opts.dim < 1 or min(opts.seq_lens) < 1 or opts.varlen_docs < 0:
        parser.error("--heads, --dim and --seq-lens must be positive and --varlen-docs >= 0")
    if opts.varlen_docs > min(opts.seq_lens):
        parser.error(f"--varlen-docs {opts.varlen_docs} exceeds the shortest --seq-lens {min(opts.seq_lens)}")
    return opts


def doc_boundaries(T: int, n_docs: int, seed: int = 0) -> list[int]:
    """cu_seqlens of ``n_docs`` documents of uneven lengths tiling ``T`` tokens (as packed text produces)."""
    import random

    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, T), n_docs - 1)) if n_docs > 1 else []
    return [0, *cuts, T]


def cases(opts) -> list[tuple[int, int, int]]:
    """(heads, T, documents; 0 = dense) in run order: varlen (the training case) before dense."""
    docs = [opts.varlen_docs, 0] if opts.varlen_docs else [0]
    return [(H, T, n) for H in opts.heads for T in opts.seq_lens for n in docs]


def make_step(H: int, T: int, n_docs: int, d: int):
    import torch

    from lowerings.ops import kda

    gen = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s, dtype=torch.bfloat16: torch.randn(*s, device="cuda", dtype=dtype, generator=gen)
    q, k, v, u = (mk(1, T, H, d).requires_grad_() for _ in range(4))
    beta = torch.rand(1, T, H, device="cuda", generator=gen).requires_grad_()
    A_log = torch.empty(H, device="cuda").uniform_(1, 16, generator=gen).log().requires_grad_()
    dt_bias = mk(H * d, dtype=torch.float32).mul(0.1).requires_grad_()
    do = mk(1, T, H, d)
    cu = torch.tensor(doc_boundaries(T, n_docs), device="cuda", dtype=torch.int32) if n_docs else None
    inputs = [q, k, v, u, beta, A_log, dt_bias]

    def step() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        o, _ = kda(q, k, v, u, beta, scale=d**-0.5, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
                   cu_seqlens=cu, l2norm_qk=True)
        torch.autograd.grad(o, inputs, do)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    return step


def run_cases(opts) -> list[str]:
    """Runs every case twice; returns the names of FLA kernels that benchmarked configs (autotuned)."""
    from lowerings.kernels.fla_config_cache import find_fla_autotuners
    from lowerings.ops import configure_backends

    configure_backends({"kda": "fla"})
    print("| heads | T | documents | first call s | second call s |\n|---|---|---|---|---|")
    for H, T, n_docs in cases(opts):
        step = make_step(H, T, n_docs, opts.dim)
        first, second = step(), step()
        print(f"| {H} | {T} | {n_docs or 'dense'} | {first:.2f} | {second:.3f} |", flush=True)
    # Triton sets configs_timings only when it benchmarks (FLA_CACHE_RESULTS=0: no on-disk shortcut).
    return sorted(t.kernel_name for t in find_fla_autotuners() if "configs_timings" in vars(t))


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("tune_fla_configs.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if "fla" in sys.modules:
        raise RuntimeError("tune_fla_configs.py: fla was imported before FLA_CACHE_MODE could be set")
    # Before anything imports fla: FLA reads these when it is imported.
    os.environ["FLA_CACHE_MODE"] = "fuzzy" if opts.check_only else "disabled"
    os.environ.setdefault("FLA_CACHE_RESULTS", "0")  # no Triton on-disk autotune results: really tune
    sys.path.insert(0, str(ROOT))
    from lowerings.kernels.fla_config_cache import CONFIG_ROOT, dump_fla_configs, sanitize_gpu_name

    gpu = torch.cuda.get_device_name(0)
    out = (opts.out or CONFIG_ROOT / sanitize_gpu_name(gpu)).resolve()
    if opts.check_only:
        os.environ["FLA_CONFIG_DIR"] = str(out)
        tuned = run_cases(opts)
        print(f"check with {out} (FLA_CACHE_MODE=fuzzy): "
              + (f"{len(tuned)} kernels still autotuned: {', '.join(tuned)}" if tuned else "no kernel autotuned"))
        return 1 if tuned else 0

    print(f"tuning FLA KDA kernels on {gpu} (FLA_CACHE_MODE=disabled) -> {out}")
    tuned = run_cases(opts)
    n = dump_fla_configs(out)
    print(f"autotuned {len(tuned)} kernels; wrote {n} entries to {out}")
    if n == 0:
        print("nothing was tuned: is fla installed and the fla backend running?", file=sys.stderr)
        return 1
    if opts.no_check:
        return 0
    child = [sys.executable, str(Path(__file__).resolve()), "--check-only", "--out", str(out), "--dim", str(opts.dim),
             "--varlen-docs", str(opts.varlen_docs), "--heads", *map(str, opts.heads),
             "--seq-lens", *map(str, opts.seq_lens)]
    env = {k: v for k, v in os.environ.items() if k not in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR")}
    return subprocess.call(child, env=env, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
