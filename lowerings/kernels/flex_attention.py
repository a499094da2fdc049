"""Document-causal attention through torch's FlexAttention, with a block-sparse mask built from the segments.

Query t sees keys seg_start[t] <= s <= pos(t). The BlockMask is built from ``seg_start`` / ``q_positions`` by
``create_block_mask`` in the same traced region as the attention (measured on CPU under a fullgraph compile: it
traces into the graph with no breaks, and batches with other document counts reuse the graph, since only
tensor values change). A BlockMask passed in from outside the compiled blocks would carry its mask_mod closure
across the compile boundary, and how Dynamo guards on that closure differs between torch releases; rebuilding
it per layer costs one S x Sk compare-and-reduce (about 67M elements at S = 8,192), small next to the attention.

FlexAttention needs a compile to be fast (eager it is an unfused reference), so outside a compiled region CUDA
tensors go through a ``torch.compile``'d wrapper of mask + attention. torch's public ``flex_attention``
refuses backward on CPU; there the flex HOP is called directly, whose CPU implementation is torch's own math
reference of the same mask_mod (it ignores the block lists, which tests check against the dense mask).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def document_causal_mask_mod(seg_start: torch.Tensor | None, q_positions: torch.Tensor | None) -> MaskMod:
    """The mask_mod of query t against key s: ``s <= pos(t)`` and, with segments, ``s >= seg_start[t]``."""
    if seg_start is None:
        def causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

        return causal
    if q_positions is None:
        def document_causal(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (kv_idx >= seg_start[b, q_idx])

        return document_causal

    def placed_document_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_positions[b, q_idx]) & (kv_idx >= seg_start[b, q_idx])

    return placed_document_causal


def document_causal_block_mask(
    seg_start: torch.Tensor | None,
    q_positions: torch.Tensor | None,
    *,
    batch: int,
    q_len: int,
    kv_len: int,
    device: torch.device,
) -> BlockMask:
    """The BlockMask of ``document_causal_mask_mod`` for ``[batch, q_len]`` queries against ``kv_len`` keys
    (the same for every head)."""
    mask_mod = document_causal_mask_mod(seg_start, q_positions)
    return create_block_mask(mask_mod, batch if seg_start is not None else None, None, q_len, kv_len, device=device)


def _cpu_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, scale: float) -> torch.Tensor:
    from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_hop
    from torch.nn.attention.flex_attention import _apply_kernel_options, _identity

    options = _apply_kernel_options(q, k, v, False, None)
    return flex_attention_hop(q, k, v, _identity, block_mask.as_tuple(), scale, options)[0]  # (out, lse[, max])


def flex_document_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    seg_start: torch.Tensor | None,
    q_positions: torch.Tensor | None,
) -> torch.Tensor:
    """``q [B,H,Sq,Dqk]``, ``k [B,H,Sk,Dqk]``, ``v [B,H,Sk,Dv]`` -> ``[B,H,Sq,Dv]``; Dv may differ from Dqk."""
    block_mask = document_causal_block_mask(seg_start, q_positions, batch=q.shape[0], q_len=q.shape[2],
                                            kv_len=k.shape[2], device=q.device)
    if q.device.type == "cpu":
        return _cpu_flex(q, k, v, block_mask, scale)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale)


_COMPILED: Callable[..., torch.Tensor] | None = None


def flex_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    seg_start: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """``flex_document_causal``, compiled when called from eager code on a GPU (the Triton kernels need it)."""
    global _COMPILED
    if torch.compiler.is_compiling() or q.device.type == "cpu":
        return flex_document_causal(q, k, v, scale, seg_start, q_positions)
    if _COMPILED is None:
        _COMPILED = torch.compile(flex_document_causal, fullgraph=True)
    return _COMPILED(q, k, v, scale, seg_start, q_positions)
