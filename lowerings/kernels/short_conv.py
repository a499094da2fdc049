"""The KDA short convolution, forward and backward (docs/ops.md, op `short_conv`), in Triton.

    y[t, c] = SiLU(a[t, c]),  a[t, c] = sum_{i < W} w[c, W-1-i] x[t-i, c] [pos[t] >= i]

``x [B, S, C]`` (bf16 or fp32), ``w [C, W]`` fp32, ``pos [B, S]`` the position inside the segment (a row's
tokens before a segment start do not reach it; without ``pos`` only the row's start cuts the window). fp32 math,
``y`` in the input dtype. Backward, with ``g[t] = dy[t] SiLU'(a[t])`` (``a`` recomputed from ``x``):

    dx[t, c] = sum_{i < W} w[c, W-1-i] g[t+i, c] [pos[t+i] >= i]
    dw[c, W-1-i] = sum_t g[t, c] x[t-i, c] [pos[t] >= i]

Grid (channel block, row block, batch row). Every program reads its rows plus the W-1 rows before (forward) or
after them (the shifted loads hit the cache), so each tensor is read about once from memory: the kernels are
bandwidth bound. The backward runs two passes: ``g`` in fp32 with the weight gradient's partial sums, one per row
block, into an fp32 ``[blocks, C, W]`` buffer summed afterwards (deterministic, no atomics); then ``dx`` from the
shifted rows of ``g``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch

__all__ = ["short_conv_forward", "short_conv_backward"]

# (rows, channels, warps) of a program's tile; scripts/bench/short_conv.py --tiles times others
TILES = (32, 64, 4)


@triton.jit
def _sigmoid(x):
    e = tl.exp(-tl.abs(x))  # never overflows
    return tl.where(x >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _positions(POS, b, rows, inside, stride_pb, HAS_POS: tl.constexpr):
    """Each row's position inside its segment (without ``pos``: inside the row)."""
    if HAS_POS:
        pos = tl.load(POS + b * stride_pb + rows, mask=inside, other=0)
    else:
        pos = rows
    return pos


@triton.jit
def _preact(X, W_ptr, b, rows, pos, inside, offs_c, mask_c, stride_xb, stride_xs,
            W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """``a`` at ``rows`` (a [BLOCK_T] vector; ``inside`` marks those in [0, S)): fp32 [BLOCK_T, BLOCK_C]."""
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for i in tl.static_range(W):
        src = rows - i
        keep = inside & (pos >= i) & (src >= 0)
        xs = tl.load(X + b * stride_xb + src[:, None] * stride_xs + offs_c[None, :],
                     mask=keep[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        wi = tl.load(W_ptr + offs_c * W + (W - 1 - i), mask=mask_c, other=0.0)
        acc += xs * wi[None, :]
    return acc


@triton.jit
def _short_conv_fwd_kernel(X, W_ptr, POS, Y, S, C, stride_xb, stride_xs, stride_yb, stride_ys, stride_pb,
                           W: tl.constexpr, HAS_POS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_c, pid_t, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    mask_c = offs_c < C
    inside = rows < S
    pos = _positions(POS, b, rows, inside, stride_pb, HAS_POS)
    a = _preact(X, W_ptr, b, rows, pos, inside, offs_c, mask_c, stride_xb, stride_xs, W, BLOCK_T, BLOCK_C)
    y = a * _sigmoid(a)
    mask = inside[:, None] & mask_c[None, :]
    tl.store(Y + b * stride_yb + rows[:, None] * stride_ys + offs_c[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _short_conv_bwd_gate_kernel(X, W_ptr, POS, DY, G, DW, S, C, n_row_blocks, stride_xb, stride_xs, stride_dyb,
                                stride_dys, stride_pb, W: tl.constexpr, HAS_POS: tl.constexpr, BLOCK_T: tl.constexpr,
                                BLOCK_C: tl.constexpr):
    """``g = dy SiLU'(a)`` (fp32, to G laid out as x) and this row block's partial weight gradient."""
    pid_c, pid_t, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    mask_c = offs_c < C
    inside = rows < S
    pos = _positions(POS, b, rows, inside, stride_pb, HAS_POS)
    a = _preact(X, W_ptr, b, rows, pos, inside, offs_c, mask_c, stride_xb, stride_xs, W, BLOCK_T, BLOCK_C)
    mask = inside[:, None] & mask_c[None, :]
    dy = tl.load(DY + b * stride_dyb + rows[:, None] * stride_dys + offs_c[None, :], mask=mask, other=0.0)
    sig = _sigmoid(a)
    g = dy.to(tl.float32) * sig * (1.0 + a * (1.0 - sig))
    tl.store(G + b * S * C + rows[:, None] * C + offs_c[None, :], g, mask=mask)
    block = b * n_row_blocks + pid_t  # this program's slot of the weight gradient's partial sums
    for j in tl.static_range(W):
        src = rows - j
        keep = inside & (pos >= j) & (src >= 0)
        xs = tl.load(X + b * stride_xb + src[:, None] * stride_xs + offs_c[None, :],
                     mask=keep[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        tl.store(DW + block * C * W + offs_c * W + (W - 1 - j), tl.sum(g * xs, axis=0), mask=mask_c)


@triton.jit
def _short_conv_bwd_input_kernel(G, W_ptr, POS, DX, S, C, stride_dxb, stride_dxs, stride_pb, W: tl.constexpr,
                                 HAS_POS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """``dx[t] = sum_i w[:, W-1-i] g[t+i]`` where ``t+i`` is at least ``i`` tokens into its segment."""
    pid_c, pid_t, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    mask_c = offs_c < C
    dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for i in tl.static_range(W):
        later = rows + i
        inside = later < S
        keep = inside & (_positions(POS, b, later, inside, stride_pb, HAS_POS) >= i)
        g = tl.load(G + b * S * C + later[:, None] * C + offs_c[None, :], mask=keep[:, None] & mask_c[None, :],
                    other=0.0)
        wi = tl.load(W_ptr + offs_c * W + (W - 1 - i), mask=mask_c, other=0.0)
        dx += g * wi[None, :]
    mask = (rows < S)[:, None] & mask_c[None, :]
    tl.store(DX + b * stride_dxb + rows[:, None] * stride_dxs + offs_c[None, :], dx.to(DX.dtype.element_ty),
             mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, pos: torch.Tensor | None) -> None:
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"short_conv: x must be [B, S, C] with contiguous channels, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[-1] or weight.dtype != torch.float32:
        raise ValueError(f"short_conv: weight must be fp32 [C={x.shape[-1]}, W], got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    if pos is not None and (tuple(pos.shape) != tuple(x.shape[:2]) or pos.stride(-1) != 1):
        raise ValueError(f"short_conv: pos must be [B, S] = {tuple(x.shape[:2])} with contiguous rows, got "
                         f"{tuple(pos.shape)} strides {pos.stride()}")


def _launch_shape(x: torch.Tensor, tiles: tuple[int, int, int] | None) -> tuple[tuple[int, int, int], dict]:
    block_t, block_c, warps = tiles or TILES
    B, S, C = x.shape
    return (triton.cdiv(C, block_c), triton.cdiv(S, block_t), B), dict(BLOCK_T=block_t, BLOCK_C=block_c,
                                                                         num_warps=warps)


def short_conv_forward(x: torch.Tensor, weight: torch.Tensor, pos: torch.Tensor | None,
                       tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``y [B, S, C]`` in ``x``'s dtype from ``x [B, S, C]``, fp32 ``weight [C, W]`` and ``pos [B, S]`` or None;
    ``tiles``: (rows, channels, warps) per program, default ``TILES``."""
    _check(x, weight, pos)
    weight = weight.contiguous()
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    pos_arg, pos_stride = (pos, pos.stride(0)) if pos is not None else (x, 0)  # x: an unread placeholder pointer
    grid, meta = _launch_shape(x, tiles)
    launch(_short_conv_fwd_kernel, grid, x, weight, pos_arg, y, x.shape[1], x.shape[2], x.stride(0), x.stride(1),
           y.stride(0), y.stride(1), pos_stride, W=weight.shape[1], HAS_POS=pos is not None, **meta)
    return y


def short_conv_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, pos: torch.Tensor | None,
                        tiles: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx [B, S, C] in x's dtype, dw [C, W] fp32)`` for the upstream gradient ``dy`` of ``y``.

    Two passes: the gate's gradient ``g`` in fp32 with the weight gradient's partial sums, then ``dx`` from the
    ``W`` shifted rows of ``g`` (one kernel recomputing ``g`` at every shift ran ~4x slower on an H100)."""
    _check(x, weight, pos)
    if tuple(dy.shape) != tuple(x.shape) or dy.stride(-1) != 1:
        raise ValueError(f"short_conv: dy must match x {tuple(x.shape)} with contiguous channels, got "
                         f"{tuple(dy.shape)} strides {dy.stride()}")
    weight = weight.contiguous()
    B, S, C = x.shape
    grid, meta = _launch_shape(x, tiles)
    g = torch.empty((B, S, C), device=x.device, dtype=torch.float32)
    partial = torch.empty((grid[2] * grid[1], C, weight.shape[1]), device=x.device, dtype=torch.float32)
    pos_arg, pos_stride = (pos, pos.stride(0)) if pos is not None else (x, 0)
    meta.update(W=weight.shape[1], HAS_POS=pos is not None)
    launch(_short_conv_bwd_gate_kernel, grid, x, weight, pos_arg, dy, g, partial, S, C, grid[1], x.stride(0),
           x.stride(1), dy.stride(0), dy.stride(1), pos_stride, **meta)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    launch(_short_conv_bwd_input_kernel, grid, g, weight, pos_arg, dx, S, C, dx.stride(0), dx.stride(1), pos_stride,
           **meta)
    return dx, partial.sum(0)
