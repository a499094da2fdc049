"""Compile FLA's KDA kernels for one shape ahead of training: ``python -m lowerings.kernels.fla_prewarm ...``.

Triton compiles each FLA kernel at its first launch in the training process (about 14 s for the 24 kernels of a
k3_small step, serially, inside the first step). Run as separate processes at launch, this script calls the
``kda`` op forward and backward on random inputs of the run's shapes and dtypes, so the compiled kernels land in
Triton's on-disk cache (the ``TRITON_CACHE_DIR`` it inherits) while the trainer imports, builds and compiles its
model; the trainer then loads them in well under a second. Triton's cache is keyed by kernel source and
specialisation, so a shape that differs costs only this process's time, never a wrong kernel.

Two options let the trainer start it before it knows the shape, and share the work:

- ``--shape-from-stdin``: import torch and FLA, then wait for one line on stdin, a JSON list of the remaining
  arguments (``--tokens ...``); an empty line or end of file means the run needs no prewarm, and it exits.
- ``--claims DIR``: several processes walk the same calls; each compiles only the kernels it claims first (an
  exclusive file per kernel in DIR) and skips the others, neither compiling nor launching them. Their inputs
  then hold stale values, which no kernel of the op uses as an index (the chunk indices are torch ops on
  ``cu_seqlens``), so only the numbers are meaningless, never the launches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lowerings.kernels.fla_kda import CHUNK, FLA_DEFERRED_PACKAGES, FLA_MODULES, prepare_fla_configs
from lowerings.settings import FLA_CONFIG_CHOICES, configure_kernel_settings

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
RESULT_PREFIX = "fla_prewarm: "


def document_boundaries(tokens: int, slots: int, device: torch.device) -> torch.Tensor:
    """``cu_seqlens`` of a few documents over ``tokens``, padded with zero-length segments to ``slots`` entries
    (less one), as the model's packed batches are."""
    if tokens < 4 * CHUNK:
        raise ValueError(f"tokens = {tokens}: the prewarm needs at least {4 * CHUNK} tokens")
    ends = [tokens // 7, tokens // 3 + 5, tokens // 2 + CHUNK, tokens]
    if slots < len(ends):
        raise ValueError(f"slots = {slots}: fewer than the prewarm's {len(ends)} documents")
    return torch.tensor([0, *ends] + [tokens] * (slots - len(ends)), dtype=torch.int32, device=device)


class KernelClaims:
    """Shares Triton compiles among processes through Triton's ``jit_cache_hook``: the first process to reach a
    kernel specialisation creates its claim file and compiles it; the others skip it (the hook's true return
    makes Triton return without compiling or launching)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.claimed = 0
        self.skipped = 0

    def __call__(self, *, key: Any, fn: Any, **_: Any) -> bool:
        name = hashlib.sha1(f"{fn.module}.{fn.name}:{key}".encode()).hexdigest()
        try:
            os.close(os.open(self.folder / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            self.skipped += 1
            return True
        self.claimed += 1
        return False

    def install(self) -> "KernelClaims":
        from triton import knobs

        if knobs.runtime.jit_cache_hook is not None:
            raise ValueError("fla_prewarm --claims: a Triton jit_cache_hook is installed already")
        knobs.runtime.jit_cache_hook = self
        return self


def prewarm_kda(tokens: int, heads: int, head_dim: int, *, slots: int, lower_bound: float | None,
                decay_dtypes: list[torch.dtype], device: torch.device) -> int:
    """One forward + backward of the fla ``kda`` op per decay-parameter dtype; returns the calls made."""
    from lowerings.ops import configure_backends, kda

    configure_backends({"kda": "fla"})
    cu = document_boundaries(tokens, slots, device)
    mk = lambda *shape: torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=True)
    for dtype in decay_dtypes:
        q, k, v, u = (mk(1, tokens, heads, head_dim) for _ in range(4))
        beta = torch.rand(1, tokens, heads, device=device, requires_grad=True)  # the model's beta is fp32
        A_log = torch.empty(heads, device=device).uniform_(1, 16).log().to(dtype).requires_grad_()
        dt_bias = (torch.randn(heads * head_dim, device=device) * 0.1).to(dtype).requires_grad_()
        o, _ = kda(q, k, v, u, beta, scale=head_dim**-0.5, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                   cu_seqlens=cu, l2norm_qk=True)
        o.backward(torch.randn_like(o))
    torch.cuda.synchronize(device)
    return len(decay_dtypes)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, help="packed tokens per KDA call (batch x seq_len); required")
    parser.add_argument("--heads", type=int, help="KDA heads; required")
    parser.add_argument("--head-dim", type=int, help="KDA head dimension; required")
    parser.add_argument("--slots", type=int, default=64, help="cu_seqlens entries less one (segment_slots)")
    parser.add_argument("--lower-bound", type=float, default=None, help="the KDA gate's lower bound; none if absent")
    parser.add_argument("--decay-dtypes", nargs="+", default=["bfloat16"], choices=sorted(_DTYPES),
                        help="dtypes of A_log / dt_bias as the layers pass them (the parameters' compute dtype)")
    parser.add_argument("--fla-configs", default="shipped", choices=FLA_CONFIG_CHOICES)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--triton-cache-dir", default=None,
                        help="Triton's cache folder (TRITON_CACHE_DIR) for the compiles; the inherited one if absent")
    parser.add_argument("--shape-from-stdin", action="store_true",
                        help="get up to speed, then read the shape arguments from stdin (a JSON list on one line)")
    parser.add_argument("--claims", type=Path, default=None,
                        help="a folder shared with other prewarm processes: compile only the kernels claimed first")
    return parser


def _shape_arguments(parser: argparse.ArgumentParser, argv: list[str]) -> list[str] | None:
    """The arguments from stdin (None when the trainer sent none: no prewarm wanted)."""
    line = sys.stdin.readline().strip()
    if not line:
        return None
    extra = json.loads(line)
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        parser.error(f"--shape-from-stdin: expected a JSON list of strings, got {line[:200]!r}")
    return argv + extra


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fla_prewarm: no CUDA device; FLA's kernels compile only for a GPU")
    device = torch.device(opts.device)
    torch.cuda.set_device(device)
    configure_kernel_settings(fla_configs=opts.fla_configs)
    print(prepare_fla_configs(), flush=True)
    from lowerings.kernels.quick_imports import quick_import

    for name in FLA_MODULES:  # the modules the op calls, as the trainer imports them
        quick_import(name, defer=FLA_DEFERRED_PACKAGES)
    if opts.shape_from_stdin:
        full = _shape_arguments(parser, argv)
        if full is None:
            print(f"{RESULT_PREFIX}not needed (the run told it so)", flush=True)
            return 0
        opts = parser.parse_args(full)
    missing = [f"--{n.replace('_', '-')}" for n in ("tokens", "heads", "head_dim") if getattr(opts, n) is None]
    if missing:
        parser.error(f"missing {', '.join(missing)}")
    if opts.triton_cache_dir:  # Triton reads it when it next compiles
        os.environ["TRITON_CACHE_DIR"] = opts.triton_cache_dir
    claims = KernelClaims(opts.claims).install() if opts.claims is not None else None
    t0 = time.perf_counter()
    calls = prewarm_kda(opts.tokens, opts.heads, opts.head_dim, slots=opts.slots, lower_bound=opts.lower_bound,
                        decay_dtypes=[_DTYPES[d] for d in dict.fromkeys(opts.decay_dtypes)], device=device)
    end = time.perf_counter()
    result = {"calls": calls, "tokens": opts.tokens, "heads": opts.heads, "head_dim": opts.head_dim,
              "compile_s": round(end - t0, 2), "done_at": time.time()}
    if claims is not None:
        result.update(compiled=claims.claimed, skipped=claims.skipped)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
