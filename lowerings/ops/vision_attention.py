"""Non-causal attention within each image of a packed vision sequence (MoonViT3d, spec §10.2).

The tower packs every image of a batch into one sequence of ``L`` patches with no padding between them;
``cu_seqlens [N+1]`` marks where each image starts. A patch attends to every patch of its own image and to
no other: the attention matrix is block-diagonal, one block per image.

``vision_attention`` runs ``scaled_dot_product_attention`` under the block-diagonal mask: correct by
construction, static shapes (compiles as one graph), its own autograd, and on GPU SDPA picks a masked fused
kernel. ``vision_attention_reference`` is the CPU reference the tests compare with: an explicit fp32 softmax
per image, in a Python loop over the images.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_ids(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """``[length]`` int64: the index of the image each packed position belongs to."""
    positions = torch.arange(length, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True)


def block_diagonal_mask(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """Boolean ``[1, 1, length, length]``: True where query and key belong to the same image."""
    seg = segment_ids(cu_seqlens, length)
    return (seg.unsqueeze(1) == seg.unsqueeze(0))[None, None]


def vision_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, scale: float
) -> torch.Tensor:
    """``q, k, v [L, H, D]`` and ``mask`` from ``block_diagonal_mask`` -> ``[L, H, D]``."""
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, L, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.squeeze(0).transpose(0, 1)


def vision_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float
) -> torch.Tensor:
    """The same contract from first principles: each image's softmax(q k^T * scale) v in fp32, separately."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != q.shape[0] or any(b > e for b, e in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens {bounds} must rise from 0 to the sequence length {q.shape[0]}")
    out = torch.empty_like(q)
    for start, end in zip(bounds, bounds[1:]):
        qi, ki, vi = (x[start:end].float().transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        probs = torch.softmax(qi @ ki.transpose(1, 2) * scale, dim=-1)
        out[start:end] = (probs @ vi).transpose(0, 1).to(q.dtype)
    return out
