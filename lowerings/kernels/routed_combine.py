"""The MoE's row movement around the routed experts (docs/ops.md, op `routed_combine`), in Triton.

A token's ``k`` routed rows sit at ``slots[t, 0..k-1]`` of the expert-ordered rows (``slots`` is a
permutation of ``range(T * k)``). Where only the first ``N < T * k`` of those rows exist (a relay of the
hierarchical dispatch holds only the choices on its node, which sort first), a slot at or past ``N`` is an
absent choice: it reads nothing, counts zero, and gets no gradient. Two kernels cover both directions:

    gather_sum:           out[t] = sum_j w[t, j] rows[slots[t, j]]      (w = 1 without weights), fp32 sum
    gather_sum_backward:  d_rows[slots[t, j]] = w[t, j] g[t],  d_w[t, j] = g[t] . rows[slots[t, j]]

The weighted gather-sum is the combine of the experts' outputs; the unweighted one is the gradient of the
dispatch gather ``x[order // k]``. Each replaces an unsorting scatter, an fp32 copy and an element-wise
product and sum in torch (or a sort-based accumulating ``index_put``) with one pass over the rows. Every
``d_w`` entry is summed by one program, so the result does not depend on scheduling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import interpreting, launch

__all__ = ["gather_sum", "gather_sum_backward"]


@triton.jit
def _gather_sum_kernel(ROWS, SLOTS, W, OUT, N, L, stride_r, stride_o, K: tl.constexpr, HAS_W: tl.constexpr,
                       BLOCK_L: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    mask = offs < L
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    for j in range(K):
        slot = tl.load(SLOTS + t * K + j).to(tl.int64)
        row = tl.load(ROWS + slot * stride_r + offs, mask=mask & (slot < N), other=0.0).to(tl.float32)
        if HAS_W:
            row = row * tl.load(W + t * K + j).to(tl.float32)
        acc += row
    tl.store(OUT + t * stride_o + offs, acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _gather_sum_bwd_kernel(G, ROWS, SLOTS, W, D_ROWS, D_W, N, L, stride_g, stride_r, stride_d, K: tl.constexpr,
                           BLOCK_L: tl.constexpr):
    # one program per (token, choice): it writes that row's gradient and sums that weight's, alone
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    slot = tl.load(SLOTS + t * K + j).to(tl.int64)
    w = tl.load(W + t * K + j).to(tl.float32)
    dot = tl.zeros([BLOCK_L], dtype=tl.float32)
    for start in range(0, L, BLOCK_L):
        offs = start + tl.arange(0, BLOCK_L)
        mask = offs < L
        here = mask & (slot < N)  # an absent choice: no row to read or write
        g = tl.load(G + t * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
        row = tl.load(ROWS + slot * stride_r + offs, mask=here, other=0.0).to(tl.float32)
        dot += g * row
        tl.store(D_ROWS + slot * stride_d + offs, (w * g).to(D_ROWS.dtype.element_ty), mask=here)
    tl.store(D_W + t * K + j, tl.sum(dot, axis=0))


def _block(L: int) -> int:
    # 512 columns: K3's latent 3,584 splits into 7 whole blocks (1,024 would leave half of the last one idle)
    block = min(512, triton.next_power_of_2(max(L, 16)))
    return min(block, 64) if interpreting() else block


def _check(rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor | None) -> tuple[int, int, int]:
    if rows.dim() != 2:
        raise ValueError(f"routed_combine: rows must be [N, L], got shape {tuple(rows.shape)}")
    if slots.dim() != 2 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"routed_combine: slots must be [T, k] int32/int64, got shape {tuple(slots.shape)} "
                         f"{slots.dtype}")
    T, K = slots.shape
    if T * K < rows.shape[0]:
        raise ValueError(f"routed_combine: slots [T, k] = {tuple(slots.shape)} must address every one of the "
                         f"{rows.shape[0]} rows once (T * k >= N; slots past N are absent choices)")
    if weights is not None and weights.shape != slots.shape:
        raise ValueError(f"routed_combine: weights must be {tuple(slots.shape)} like slots, got "
                         f"{tuple(weights.shape)}")
    return T, K, rows.shape[1]


def _contiguous_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def gather_sum(rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
    """``out [T, L]`` in ``dtype``: each token's rows (weighted when ``weights`` is given), summed in fp32; slots
    at or past ``rows.shape[0]`` are absent (zero)."""
    T, K, L = _check(rows, slots, weights)
    rows, slots = _contiguous_rows(rows), slots.contiguous()
    out = torch.empty(T, L, dtype=dtype, device=rows.device)
    if T and L:
        w = weights.contiguous() if weights is not None else slots  # unread without weights
        block = _block(L)
        launch(_gather_sum_kernel, (T, triton.cdiv(L, block)), rows, slots, w, out, rows.shape[0], L,
               rows.stride(0), out.stride(0), K=K, HAS_W=weights is not None, BLOCK_L=block, num_warps=4)
    return out


def gather_sum_backward(grad: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                        weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d_rows [N, L]`` in rows' dtype, ``d_weights [T, k]`` fp32) of the weighted ``gather_sum``."""
    T, K, L = _check(rows, slots, weights)
    if grad.shape != (T, L):
        raise ValueError(f"routed_combine backward: grad must be {(T, L)}, got {tuple(grad.shape)}")
    grad, rows, slots, weights = _contiguous_rows(grad), _contiguous_rows(rows), slots.contiguous(), weights.contiguous()
    d_rows = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
    d_weights = torch.empty(T, K, dtype=torch.float32, device=rows.device)
    if T and K and L:
        block = _block(L)
        launch(_gather_sum_bwd_kernel, (T, K), grad, rows, slots, weights, d_rows, d_weights, rows.shape[0], L,
               grad.stride(0), rows.stride(0), d_rows.stride(0), K=K, BLOCK_L=block, num_warps=4)
    elif T and K:
        d_weights.zero_()
    return d_rows, d_weights
