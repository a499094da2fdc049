"""Dense causal attention for the gated MLA layers (document-causal when segments are given).

Plain ``scaled_dot_product_attention``: it is already compile-friendly and picks flash / cuDNN / efficient
kernels on GPU by itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_causal_mask(seg_start: torch.Tensor) -> torch.Tensor:
    """``seg_start [B,S]`` (row-local) -> boolean ``[B,1,S,S]``: query t sees keys seg_start[t] <= s <= t."""
    S = seg_start.shape[-1]
    s = torch.arange(S, device=seg_start.device)
    t = s.unsqueeze(1)
    return ((s <= t) & (s >= seg_start.unsqueeze(-1))).unsqueeze(1)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, seg_start: torch.Tensor | None = None
) -> torch.Tensor:
    """``q, k [B,S,H,Dqk]``, ``v [B,S,H,Dv]`` -> ``[B,S,H,Dv]``; plain causal when ``seg_start`` is None."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if seg_start is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(seg_start), scale=scale)
    return out.transpose(1, 2)
