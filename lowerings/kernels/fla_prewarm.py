"""Compile FLA's KDA kernels for one shape ahead of training: ``python -m lowerings.kernels.fla_prewarm ...``.

Triton compiles each FLA kernel at its first launch in the training process (about 14 s for the 24 kernels of a
k3_small step, serially, inside the first step). Run as a separate process at launch, this script calls the
``kda`` op forward and backward on random inputs of the run's shapes and dtypes, so the compiled kernels land in
Triton's on-disk cache (the ``TRITON_CACHE_DIR`` it inherits) while the trainer builds and compiles its model;
the trainer then loads them in well under a second. Triton's cache is keyed by kernel source and specialisation,
so a shape that differs costs only this process's time, never a wrong kernel.
"""

from __future__ import annotations

import argparse
import time

import torch

from lowerings.kernels.fla_kda import CHUNK, prepare_fla_configs
from lowerings.settings import FLA_CONFIG_CHOICES, configure_kernel_settings

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def document_boundaries(tokens: int, slots: int, device: torch.device) -> torch.Tensor:
    """``cu_seqlens`` of a few documents over ``tokens``, padded with zero-length segments to ``slots`` entries
    (less one), as the model's packed batches are."""
    if tokens < 4 * CHUNK:
        raise ValueError(f"tokens = {tokens}: the prewarm needs at least {4 * CHUNK} tokens")
    ends = [tokens // 7, tokens // 3 + 5, tokens // 2 + CHUNK, tokens]
    if slots < len(ends):
        raise ValueError(f"slots = {slots}: fewer than the prewarm's {len(ends)} documents")
    return torch.tensor([0, *ends] + [tokens] * (slots - len(ends)), dtype=torch.int32, device=device)


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
    parser.add_argument("--tokens", type=int, required=True, help="packed tokens per KDA call (batch x seq_len)")
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--head-dim", type=int, required=True)
    parser.add_argument("--slots", type=int, default=64, help="cu_seqlens entries less one (segment_slots)")
    parser.add_argument("--lower-bound", type=float, default=None, help="the KDA gate's lower bound; none if absent")
    parser.add_argument("--decay-dtypes", nargs="+", default=["bfloat16"], choices=sorted(_DTYPES),
                        help="dtypes of A_log / dt_bias as the layers pass them (the parameters' compute dtype)")
    parser.add_argument("--fla-configs", default="shipped", choices=FLA_CONFIG_CHOICES)
    parser.add_argument("--device", default="cuda:0")
    return parser


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fla_prewarm: no CUDA device; FLA's kernels compile only for a GPU")
    device = torch.device(opts.device)
    torch.cuda.set_device(device)
    configure_kernel_settings(fla_configs=opts.fla_configs)
    print(prepare_fla_configs(), flush=True)
    t0 = time.perf_counter()
    calls = prewarm_kda(opts.tokens, opts.heads, opts.head_dim, slots=opts.slots, lower_bound=opts.lower_bound,
                        decay_dtypes=[_DTYPES[d] for d in dict.fromkeys(opts.decay_dtypes)], device=device)
    print(f"fla_prewarm: {calls} forward + backward calls at {opts.tokens} tokens x {opts.heads} heads x "
          f"{opts.head_dim} in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
