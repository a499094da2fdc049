"""Dense causal attention for the gated MLA layers (document-causal when segments are given).

Backends (``kernels.causal_attention``): ``sdpa``, plain ``scaled_dot_product_attention`` with a dense boolean
``[B,1,Sq,Sk]`` mask (compile-friendly, picks flash / cuDNN / efficient kernels on GPU, but computes the whole
square when documents are packed), and ``flex``, FlexAttention with a block-sparse document-causal BlockMask
(``lowerings.kernels.flex_attention``), which skips the key blocks outside each query block's documents.
Plain causal rows (no segments) take SDPA's ``is_causal`` kernel under either backend: on the H200 it runs an
8,192-token row in 2.68 ms against flex's 7.80 (16 heads; scripts/bench/causal_attention.py). Packed, flex
beats sdpa by far (1.50 against 11.18 ms at 100-token documents, 4.41 against 11.24 at 4,000).
``varlen`` runs packed documents through torch's precompiled FlashAttention varlen kernel over the trainer's
``cu_seqlens`` (``lowerings.kernels.varlen_attention``). Calls it cannot take (fp32, context parallelism's
placed queries, no ``cu_seqlens``) run as ``flex`` on CUDA and as ``sdpa`` elsewhere. ``auto`` is ``varlen`` on
CUDA, ``sdpa`` elsewhere (flex on CPU is torch's math reference): on the H200 the k3_small step runs 35,601
tokens/s with varlen against 34,352 with flex, and the first step is done 49 s after launch against 95 s,
flex's kernels being what the first step compiled longest (docs/perf.md). Per op flex stays faster on short
documents with many heads (96 heads, 100-token documents: 5.15 against 13.09 ms; the varlen kernel's grid
covers the whole row per document slot).
Not a custom op: every backend traces into the compiled graph as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowerings.ops.registry import cuda_available, on_cuda, op_backends, selected_backend

BACKENDS = op_backends("causal_attention")
# flex runs anywhere (CPU: torch's math reference of the mask, slow), but auto takes it on CUDA only
BACKENDS.add("flex", auto_rank=0, auto_check=cuda_available)
# auto's first choice on CUDA: as fast as flex in the k3_small / k31_small steps, and nothing to compile
BACKENDS.add("varlen", cuda_available, auto_rank=0)


FLEX_BLOCK = 128


def varlen_fallback(q: torch.Tensor) -> str:
    """The backend for what varlen cannot take (context parallelism's placed queries, fp32): flex on CUDA, which
    skips the blocks outside the documents too, sdpa elsewhere. Plain causal rows take sdpa's is_causal either
    way."""
    return "flex" if q.is_cuda else "sdpa"


def _flex_takes(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the flex backend takes this call. Under a compile, rows that are not a multiple of flex's 128-token
    blocks take sdpa (exact too): when the compile traces a length as a symbol (dynamic shapes, after the row
    length changed between calls), Inductor's flex lowering fails on unaligned lengths (torch 2.11, H200:
    ``CantSplit``), and inside a traced model a symbolic length cannot be told from a static one. Training rows
    (8,192 tokens) are aligned; outside a compile flex takes every length."""
    if not torch.compiler.is_compiling():
        return True
    return q.shape[2] % FLEX_BLOCK == 0 and k.shape[2] % FLEX_BLOCK == 0


def document_causal_mask(
    seg_start: torch.Tensor, q_positions: torch.Tensor | None = None, num_keys: int | None = None
) -> torch.Tensor:
    """``seg_start [B,Sq]`` -> boolean ``[B,1,Sq,Sk]``: query t sees keys seg_start[t] <= s <= pos(t).

    ``q_positions [B,Sq]`` are the queries' positions among the ``num_keys`` keys (default: query t is key t,
    a square mask); given, the mask is rectangular, e.g. a slice of a sequence's queries against all its keys.
    """
    Sq = seg_start.shape[-1]
    s = torch.arange(num_keys if num_keys is not None else Sq, device=seg_start.device)
    t = (q_positions if q_positions is not None else torch.arange(Sq, device=seg_start.device)).unsqueeze(-1)
    return ((s <= t) & (s >= seg_start.unsqueeze(-1))).unsqueeze(1)


class _FusedAttentionSaves(torch.autograd.Function):
    """The memory of a fused CUDA attention kernel (flash, cuDNN, memory-efficient, flex) for fake-tensor
    planning: it returns the output and keeps q, k, v, the output and an fp32 log-sum-exp per query row for
    backward, never the [Sq, Sk] probabilities that the CPU math kernel would keep (16 heads at 8K tokens:
    4 GiB per layer, which made the activation estimate of k3_small nearly twice the measured one)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    seg_start: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [B,Sq,H,Dqk]``, ``k [B,Sk,H,Dqk]``, ``v [B,Sk,H,Dv]`` -> ``[B,Sq,H,Dv]``.

    Plain causal when ``seg_start`` is None (then Sq == Sk). ``q_positions [B,Sq]`` (with ``seg_start``, both in
    key coordinates) place the queries among the keys: query t sees keys seg_start[t] <= s <= q_positions[t].
    ``cu_seqlens [N+1]`` (optional, for ``varlen``): the same segments as boundaries over the ``B*Sq`` flattened
    tokens, zero-length segments allowed.
    """
    if q_positions is not None and seg_start is None:
        raise ValueError("causal_attention: q_positions needs seg_start (both in key coordinates)")
    if q_positions is None and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal_attention: {q.shape[1]} queries and {k.shape[1]} keys need q_positions")
    backend = selected_backend("causal_attention")
    if backend == "varlen":
        if seg_start is not None and q_positions is None and cu_seqlens is not None:
            from lowerings.kernels.varlen_attention import varlen_document_causal, varlen_takes

            if varlen_takes(q, k, v) is None:  # CUDA, bf16/fp16, square, head dims within 256
                return varlen_document_causal(q, k, v, scale=scale, cu_seqlens=cu_seqlens)
        backend = varlen_fallback(q)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if on_cuda(q) and not q.is_cuda:  # planning on fake CPU tensors (registry.plan_as_cuda): what CUDA would keep
        if seg_start is not None:
            document_causal_mask(seg_start, q_positions, k.shape[2])  # SDPA's boolean mask exists on CUDA too
        out = _FusedAttentionSaves.apply(q, k, v)
    elif backend == "flex" and seg_start is not None and _flex_takes(q, k):
        from lowerings.kernels.flex_attention import flex_causal_attention

        out = flex_causal_attention(q, k, v, scale=scale, seg_start=seg_start, q_positions=q_positions)
    elif seg_start is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        mask = document_causal_mask(seg_start, q_positions, k.shape[2])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)
