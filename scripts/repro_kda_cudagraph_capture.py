"""The fla KDA op captured under ``reduce-overhead``: does cudagraph trees' warm-up leave memory in the pool?

With ``cudagraph_unsafe`` removed, the k3_small recipe from empty caches failed at its first backward with
"12 tensor(s) in the cudagraph pool not tracked as outputs", one per KDA layer (H200, torch 2.11). Run with
allocation histories (eleventh session), every leftover came from FLA's process-wide graph buffers
(``fla.ops.utils.graph.get_static_buffer``), which the adapter now replaces by fresh tensors
(lowerings/kernels/fla_graph_buffers.py, applied in ``fla_kda.fla_kda_backward``). This script registers an
untagged copy of the op pair (same fake, same autograd, same adapter) and trains a stack of ``--layers`` toy KDA
blocks, each compiled on its own like the model's blocks, in a fresh process with empty Inductor caches.
Inductor's cudagraph-trees history recording is on, so an error names where each leftover tensor was allocated.
Each step also runs the same blocks eagerly first; it exits 0 when ``--steps`` steps ran with the captured
gradients within 2e-2 of eager's (relative L2 over all parameters), and 1 with the error or the difference
otherwise. A diagnostic,
not a benchmark.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PYTHONPATH=$PWD:/tmp/site python3 scripts/repro_kda_cudagraph_capture.py
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowerings.inductor.modes import compile_options  # noqa: E402
from lowerings.kernels import fla_kda  # noqa: E402
from lowerings.ops.registry import configure_backends  # noqa: E402
from titan_kimi.models.kimi_k3.sequence import segment_slots  # noqa: E402


@torch.library.custom_op("kda_capture_repro::kda", mutates_args=())
def repro_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              A_log: torch.Tensor, dt_bias: torch.Tensor, cu_seqlens: torch.Tensor
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    o, _, residuals = fla_kda.fla_kda_forward(q, k, v, g, beta, A_log, dt_bias, -5.0, q.shape[-1] ** -0.5,
                                              cu_seqlens, None, False, True)
    return o, residuals


@repro_kda.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, cu_seqlens):
    return torch.empty_like(v), [q.new_empty(s, dtype=d) for s, d in fla_kda.residual_shapes(q)]


@torch.library.custom_op("kda_capture_repro::kda_backward", mutates_args=())
def repro_kda_backward(d_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, cu_seqlens: torch.Tensor,
                       residuals: list[torch.Tensor]) -> list[torch.Tensor]:
    d_final = q.new_zeros(0, dtype=torch.float32)
    return fla_kda.fla_kda_backward(d_o, d_final, q, k, v, g, beta, A_log, dt_bias, -5.0, q.shape[-1] ** -0.5,
                                    cu_seqlens, None, False, True, residuals)


@repro_kda_backward.register_fake
def _(d_o, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, residuals):
    return [torch.empty_like(x) for x in (q, k, v, g, beta, A_log, dt_bias)]


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output[1])


def _backward(ctx, d_o, _d_residuals):
    q, k, v, g, beta, A_log, dt_bias, cu_seqlens, *residuals = ctx.saved_tensors
    grads = repro_kda_backward(d_o.contiguous(), q, k, v, g, beta, A_log, dt_bias, cu_seqlens, residuals)
    return (*grads, None)


torch.library.register_autograd("kda_capture_repro::kda", _backward, setup_context=_setup)


class ToyKDABlock(torch.nn.Module):
    """Projections into the op and out of it, so the op sits inside a compiled graph with other kernels."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkvu = torch.nn.Linear(dim, 4 * heads * head_dim, bias=False)
        self.b = torch.nn.Linear(dim, heads, bias=False)
        self.out = torch.nn.Linear(heads * head_dim, dim, bias=False)
        self.A_log = torch.nn.Parameter(torch.empty(heads).uniform_(1, 16).log())
        self.dt_bias = torch.nn.Parameter(torch.randn(heads * head_dim) * 0.1)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v, u = self.qkvu(x).view(B, T, 4, self.heads, self.head_dim).unbind(2)
        beta = torch.sigmoid(self.b(x).float())
        o, _ = repro_kda(q.contiguous(), k.contiguous(), v.contiguous(), u.contiguous(), beta, self.A_log,
                         self.dt_bias, cu_seqlens)
        return x + self.out(o.reshape(B, T, -1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--doc-len", type=int, default=100)
    parser.add_argument("--steps", type=int, default=4)
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    configure_backends({"kda": "fla"})
    torch._inductor.config.triton.cudagraph_trees_history_recording = True
    torch.manual_seed(0)
    dev = torch.device("cuda")
    blocks = [ToyKDABlock(opts.dim, opts.heads, 128).to(dev, torch.bfloat16) for _ in range(opts.layers)]
    compiled = [torch.compile(b, **compile_options("reduce-overhead")) for b in blocks]
    params = [p for b in blocks for p in b.parameters()]
    T = opts.tokens
    try:
        for step in range(opts.steps):
            lengths = [opts.doc_len + step] * (T // (opts.doc_len + step))
            bounds = [0] + [sum(lengths[: i + 1]) for i in range(len(lengths))]
            if bounds[-1] != T:
                bounds.append(T)
            slots = segment_slots(len(bounds) - 1)
            cu = torch.tensor(bounds + [T] * (slots + 1 - len(bounds)), device=dev, dtype=torch.int32)
            torch._dynamo.maybe_mark_dynamic(cu, 0)
            x0 = torch.randn(1, T, opts.dim, device=dev, dtype=torch.bfloat16)
            norms = []
            for stack in (blocks, compiled):  # eager first: the captured replay must give the same gradients
                x = x0
                for block in stack:
                    x = block(x, cu)
                x.float().square().mean().backward()
                grads = torch.cat([p.grad.float().flatten() for p in params])
                norms.append((float(grads.norm()), grads))
                for p in params:
                    p.grad = None
            (eager_norm, eager), (graph_norm, graph) = norms
            rel = float((graph - eager).norm() / eager.norm())
            print(f"step {step}: {len(bounds) - 1} documents in {slots} slots, grad norm eager {eager_norm:.4g} "
                  f"captured {graph_norm:.4g}, relative difference {rel:.2e}", flush=True)
            if not math.isfinite(rel) or rel > 2e-2:
                print(f"the captured gradients differ from eager by {rel:.2e} (bound 2e-2)")
                return 1
    except Exception:  # the point of the script: show the capture failure and where its tensors came from
        traceback.print_exc()
        return 1
    print(f"captured: {opts.steps} steps of {opts.layers} compiled KDA blocks under reduce-overhead ran")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
