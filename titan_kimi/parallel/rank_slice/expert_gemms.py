"""The routed experts' GEMMs of one EP rank alone, against their floor: what runs (``GroupedExperts.run`` over
the local experts' aligned row groups, at its ``gemm_precision``), one ``mm`` per expert, and one dense GEMM
chain with the same rows and FLOPs (no grouping: the rate the grouped kernel could reach at this size).

Each is forward + backward (input and weight gradients) of ``x @ w13^T -> SiTU-GLU -> @ w2^T``."""

from __future__ import annotations

import torch

from lowerings import ops
from titan_kimi.models.kimi_k3.layer_flops import LayerFlops
from lowerings.ops.expert_gemm import row_alignment
from titan_kimi.parallel.rank_slice.expert_load import ExpertLoad
from titan_kimi.parallel.rank_slice.measure import Entry, _timed


def _aligned_counts(load: ExpertLoad, align: int) -> list[int]:
    per_expert = load.counts.sum(0).tolist()
    return [max(align, -(-c // align) * align) for c in per_expert]


def measure_expert_gemms(experts: torch.nn.Module, load: ExpertLoad, *, warmup: int, repeats: int,
                         generator: torch.Generator, device: torch.device) -> list[Entry]:
    """Entries for the three ways, on the rows ``load`` gives each local expert (padded as torchtitan pads)."""
    align = row_alignment(experts.gemm_precision)
    counts = _aligned_counts(load, align)
    w13, w2 = experts.w13, experts.w2
    rows, latent, hidden = sum(counts), w13.shape[-1], w2.shape[-1]
    dtype = w13.dtype
    x = torch.randn(rows, latent, generator=generator).to(device, dtype).requires_grad_(True)
    grad = torch.randn(rows, latent, generator=generator).to(device, dtype)
    tokens = torch.tensor(counts, device=device)
    beta, beta_lin = experts.beta, experts.beta_lin
    flops_fwd = 2.0 * rows * (w13[0].numel() + w2[0].numel())
    flops = LayerFlops(flops_fwd, flops_fwd, flops_fwd)

    def grouped():
        return [experts.run(w13, w2, x, tokens)], [grad]

    def per_expert():
        outs, start = [], 0
        for e, n in enumerate(counts):
            h = ops.situ_glu(x[start:start + n] @ w13[e].t(), beta, beta_lin)
            outs.append(h @ w2[e].t())
            start += n
        return [torch.cat(outs)], [grad]

    def dense():
        h = ops.situ_glu(x @ w13[0].t(), beta, beta_lin)
        return [h @ w2[0].t()], [grad]

    note = (f"{len(counts)} experts, {rows} rows (aligned to {align}), {latent} -> {hidden} -> {latent}; {load.name}; "
            f"routed_expert_gemm {experts.gemm_precision} (the other two: the compute dtype)")
    out = []
    for name, fn in (("experts: grouped_mm (what runs)", grouped), ("experts: one mm per expert", per_expert),
                     ("experts: one dense GEMM chain (the floor)", dense)):
        t = _timed(fn, device, warmup, repeats)
        out.append(Entry(name, "gemm", rows, t.forward_ms, t.backward_ms, flops, t.saved_gib, t.peak_gib, note,
                         load.name, host_forward_ms=t.host_forward_ms, host_backward_ms=t.host_backward_ms))
    for p in (w13, w2):
        p.grad = None
    return out
