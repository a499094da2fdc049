"""Document-causal attention through torch's own FlashAttention varlen kernel (``aten._flash_attention_forward``).

Packed documents are what FlashAttention's variable-length mode was made for: the rows are flattened to
``[B*S, H, D]`` tokens and ``cu_seqlens`` (the trainer's, padded with zero-length segments to a bucketed count)
marks where each document starts; causal attention then runs inside each document and never across. The kernels
ship precompiled in torch's CUDA build, so unlike FlexAttention nothing is compiled at the first step (on the
H200 the MLA attention's FlexAttention compile is the longest part of the first step, docs/perf.md), and there
is no host sync: ``max_q``/``max_k`` are the row length, a static bound (blocks beyond a document's end exit).

FlashAttention wants one head dim for q, k and v, a multiple of 8, at most 256. MLA's values are narrower
than its queries and keys (K3: 128 against 192), so v is zero-padded to the q/k width and the output sliced
back; the zeros add no error. The autograd formula of ``_flash_attention_forward`` (torch's derivatives.yaml)
gives the backward; under torch.compile it is a fallback kernel with a meta implementation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_HEAD_DIM = 256
DTYPES = (torch.bfloat16, torch.float16)


def padded_head_dim(q_dim: int, v_dim: int) -> int:
    """The one head dim FlashAttention runs: the wider of q/k and v, rounded up to a multiple of 8."""
    return -(-max(q_dim, v_dim) // 8) * 8


def varlen_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why this call cannot run here (None when it can): bf16/fp16, as many keys as queries, head dims within
    FlashAttention's 256. The device is the op's rule (``lowerings.ops.attention.OFF_CUDA``: sdpa off CUDA)."""
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"needs bf16 or fp16 q/k/v, got {q.dtype}/{k.dtype}/{v.dtype}"
    if q.shape[1] != k.shape[1]:
        return f"needs as many keys as queries, got {k.shape[1]} and {q.shape[1]}"
    if padded_head_dim(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        return f"head dims {q.shape[-1]}/{v.shape[-1]} exceed FlashAttention's {MAX_HEAD_DIM}"
    return None


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def flash_varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        max_len: int, scale: float) -> torch.Tensor:
    """The kernel: ``[T, H, D]`` q/k/v (one D) and int32 ``cu_seqlens`` -> ``[T, H, D]``, causal per segment."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True,
                                                   False, scale=scale)[0]


def varlen_document_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                           cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``q [B,S,H,Dqk]``, ``k [B,S,H,Dqk]``, ``v [B,S,H,Dv]`` and ``cu_seqlens [N+1]`` int32 over the ``B*S``
    flattened tokens (every row starting a document) -> ``[B,S,H,Dv]``: causal attention within each document."""
    B, S, H, Dv = v.shape
    width = padded_head_dim(q.shape[-1], Dv)
    # zero columns leave every dot product as it was
    flat = [_pad_last(x.reshape(B * S, H, x.shape[-1]), width) for x in (q, k, v)]
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    out = flash_varlen_causal(*flat, cu, S, scale)
    return out[..., :Dv].reshape(B, S, H, Dv)
