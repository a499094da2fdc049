"""Row-wise top-k selection with "most recent key wins" ties, from fp32 scores and each row's k-th value.

    scores [R, W] fp32 (-inf = masked), thr [R] fp32 (the k-th largest score of the row, -inf when the row has
    fewer than k finite scores), row_end [R] int32 (only columns < row_end are read) -> out [R, k] int32:
    the chosen columns ascending, -1 in unused tail slots.

Chosen = every column with score > thr, plus the *last* (k - #greater) columns with score == thr. That is
exactly what a stable descending sort of the reversed row picks (lowerings/ops/indexer_topk.py
`select_topk`), so the indexer keeps its tie rule (ReLU scores tie at 0 often) while torch.topk runs on
fp32 values: half the buffer and half the radix passes of int64 sort keys, and no sort afterwards, because
the compaction below writes the columns in ascending order.

One program per row, two passes over its columns: count (> thr, == thr), then compact with a running
prefix sum. Comparisons treat -0.0 == +0.0, so signed zeros tie as they should.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch

__all__ = ["select_topk_by_threshold"]


@triton.jit
def _select_kernel(S, THR, END, OUT, stride_s, stride_o, K, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = S + r * stride_s
    thr = tl.load(THR + r)
    end = tl.load(END + r)
    n_gt = tl.zeros([], tl.int32)
    n_eq = tl.zeros([], tl.int32)
    for c0 in range(0, end, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        s = tl.load(row + cols, mask=cols < end, other=float("-inf"))
        n_gt += tl.sum((s > thr).to(tl.int32), 0)
        n_eq += tl.sum(((s == thr) & (s > float("-inf"))).to(tl.int32), 0)  # masked keys never tie in
    # equal scores to skip from the front so that the most recent ones fill the remaining slots
    skip_eq = n_eq - tl.minimum(n_eq, K - n_gt)
    written = tl.zeros([], tl.int32)
    eq_seen = tl.zeros([], tl.int32)
    out_row = OUT + r * stride_o
    for c0 in range(0, end, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        s = tl.load(row + cols, mask=cols < end, other=float("-inf"))
        eq = (s == thr) & (s > float("-inf"))
        eq_i = eq.to(tl.int32)
        eq_rank = eq_seen + tl.cumsum(eq_i, 0) - 1
        take = (s > thr) | (eq & (eq_rank >= skip_eq))
        take_i = take.to(tl.int32)
        pos = written + tl.cumsum(take_i, 0) - 1
        tl.store(out_row + pos, cols.to(tl.int32), mask=take & (pos < K))
        written += tl.sum(take_i, 0)
        eq_seen += tl.sum(eq_i, 0)


def select_topk_by_threshold(scores: torch.Tensor, thr: torch.Tensor, row_end: torch.Tensor, out: torch.Tensor,
                             *, block: int = 1024) -> torch.Tensor:
    """Write each row's chosen columns into ``out [R, k]`` (pre-filled by the caller with -1); returns out."""
    R = scores.shape[0]
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"select_topk_by_threshold: scores must be fp32 [R, W] with unit column stride, "
                         f"got {scores.dtype} {tuple(scores.shape)} strides {scores.stride()}")
    if thr.shape != (R,) or thr.dtype != torch.float32:
        raise ValueError(f"select_topk_by_threshold: thr must be fp32 [{R}], got {thr.dtype} {tuple(thr.shape)}")
    if row_end.shape != (R,) or row_end.dtype != torch.int32:
        raise ValueError(f"select_topk_by_threshold: row_end must be int32 [{R}], got {row_end.dtype} "
                         f"{tuple(row_end.shape)}")
    if out.dim() != 2 or out.shape[0] != R or out.dtype != torch.int32 or out.stride(1) != 1:
        raise ValueError(f"select_topk_by_threshold: out must be int32 [{R}, k] with unit stride, "
                         f"got {out.dtype} {tuple(out.shape)}")
    if R:
        launch(_select_kernel, (R,), scores, thr.contiguous(), row_end.contiguous(), out,
               scores.stride(0), out.stride(0), out.shape[1], BLOCK=block)
    return out
