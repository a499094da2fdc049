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
placed queries, no ``cu_seqlens``) run as ``flex`` on CUDA and as ``sdpa`` elsewhere: one immutable rule table
(``CAUSAL_ATTENTION_KERNELS``, ``OFF_CUDA``, ``SHAPE_RULES``) that ``forward_kernel`` reads. ``auto`` is ``varlen`` on
CUDA, ``sdpa`` elsewhere (flex on CPU is torch's math reference): on the H200 the k3_small step runs 35,601
tokens/s with varlen against 34,352 with flex, and the first step is done 49 s after launch against 95 s,
flex's kernels being what the first step compiled longest (docs/perf.md). Per op flex stays faster on short
documents with many heads (96 heads, 100-token documents: 5.15 against 13.09 ms; the varlen kernel's grid
covers the whole row per document slot).
Not a custom op: every backend traces into the compiled graph as it is.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from lowerings.ops.registry import cuda_available, on_cuda, op_backends, selected_backend

BACKENDS = op_backends("causal_attention")
# flex runs anywhere (CPU: torch's math reference of the mask, slow), but auto takes it on CUDA only
BACKENDS.add("flex", auto_rank=0, auto_check=cuda_available)
# auto's first choice on CUDA: as fast as flex in the k3_small / k31_small steps, and nothing to compile
BACKENDS.add("varlen", cuda_available, auto_rank=0)


FLEX_BLOCK = 128
# The rule table the op consults; configure_backends picks the row (the op's resolved backend): the kernel each
# backend runs, then the kernel that runs it off CUDA, then the shape rules.
CAUSAL_ATTENTION_KERNELS: Mapping[str, str] = MappingProxyType({"varlen": "varlen", "flex": "flex", "sdpa": "sdpa"})
OFF_CUDA: Mapping[str, str] = MappingProxyType({"varlen": "sdpa"})  # flex runs anywhere (CPU: the math reference)
# why a call is refused: (q, k, v, seg_start, q_positions, cu_seqlens) -> a reason, or None when it is taken
ShapeRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None",
                      "torch.Tensor | None"], "str | None"]


def _varlen_refuses(q, k, v, seg_start, q_positions, cu_seqlens) -> str | None:
    if seg_start is None:
        return "plain causal rows take sdpa's is_causal kernel"
    if q_positions is not None:
        return "queries placed among more keys (context parallelism)"
    if cu_seqlens is None:
        return "no cu_seqlens"
    from lowerings.kernels.varlen_attention import varlen_takes

    return varlen_takes(q, k, v)  # bf16/fp16, square, head dims within 256


def _flex_refuses(q, k, v, seg_start, q_positions, cu_seqlens) -> str | None:
    """Under a compile, rows that are not a multiple of flex's 128-token blocks take sdpa (exact too): when the
    compile traces a length as a symbol (dynamic shapes, after the row length changed between calls), Inductor's
    flex lowering fails on unaligned lengths (torch 2.11, H200: ``CantSplit``), and inside a traced model a
    symbolic length cannot be told from a static one. Training rows (8,192 tokens) are aligned; outside a compile
    flex takes every length."""
    if seg_start is None:
        return "plain causal rows take sdpa's is_causal kernel"
    if torch.compiler.is_compiling() and (q.shape[1] % FLEX_BLOCK or k.shape[1] % FLEX_BLOCK):
        return f"rows not a multiple of {FLEX_BLOCK} tokens under a compile"
    return None


# The kernels that take only some calls: kernel -> (its rule, the kernel that runs what it refuses). varlen's
# refusals go to flex (on CUDA), which skips the blocks outside the documents too; flex's to sdpa.
SHAPE_RULES: Mapping[str, tuple[ShapeRule, str]] = MappingProxyType({
    "varlen": (_varlen_refuses, "flex"),
    "flex": (_flex_refuses, "sdpa"),
})


def forward_kernel(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   seg_start: torch.Tensor | None = None, q_positions: torch.Tensor | None = None,
                   cu_seqlens: torch.Tensor | None = None, cuda: bool | None = None) -> str:
    """The kernel ``causal_attention`` runs for this call (``q``, ``k``, ``v`` as it takes them) under ``backend``:
    its row of ``CAUSAL_ATTENTION_KERNELS``, ``OFF_CUDA``, then ``SHAPE_RULES`` until a kernel takes the call.
    ``cuda`` (default ``q.is_cuda``) lets tests ask for the GPU decision with CPU tensors."""
    kernel = CAUSAL_ATTENTION_KERNELS[backend]
    if not (q.is_cuda if cuda is None else cuda):
        kernel = OFF_CUDA.get(kernel, kernel)
    while kernel in SHAPE_RULES:
        refuses, instead = SHAPE_RULES[kernel]
        if refuses(q, k, v, seg_start, q_positions, cu_seqlens) is None:
            break
        kernel = instead
    return kernel


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
    kernel = forward_kernel(selected_backend("causal_attention"), q, k, v, seg_start=seg_start,
                            q_positions=q_positions, cu_seqlens=cu_seqlens)
    if kernel == "varlen":
        from lowerings.kernels.varlen_attention import varlen_document_causal

        return varlen_document_causal(q, k, v, scale=scale, cu_seqlens=cu_seqlens)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if on_cuda(q) and not q.is_cuda:  # planning on fake CPU tensors (registry.plan_as_cuda): what CUDA would keep
        if seg_start is not None:
            document_causal_mask(seg_start, q_positions, k.shape[2])  # SDPA's boolean mask exists on CUDA too
        out = _FusedAttentionSaves.apply(q, k, v)
    elif kernel == "flex":
        from lowerings.kernels.flex_attention import flex_causal_attention

        out = flex_causal_attention(q, k, v, scale=scale, seg_start=seg_start, q_positions=q_positions)
    elif seg_start is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        mask = document_causal_mask(seg_start, q_positions, k.shape[2])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)
