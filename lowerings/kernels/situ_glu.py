"""SiTU-GLU forward and backward (docs/ops.md, op `situ_glu`), in Triton.

    gate_up [..., 2F] = [g | u]  ->  y [..., F] = beta tanh(g / beta) sigmoid(g) * beta_lin tanh(u / beta_lin)

fp32 math, I/O in the input dtype. Backward returns d(gate_up) [..., 2F]:
    dg = dy * clip(u) * (sech^2(g/beta) sigmoid(g) + beta tanh(g/beta) sigmoid(g) (1 - sigmoid(g)))
    du = dy * situ(g) * sech^2(u/beta_lin)
Each program takes a tile of rows x feature columns. The kernels are elementwise: at the experts' shapes they
should run at the memory's rate, so the transcendentals are one exp2 each (tanh and sech^2 share it) and the
tiles are whole blocks of F where F allows it.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .launch import as_fp32, interpreting, launch

__all__ = ["situ_glu_forward", "situ_glu_backward", "TILES"]

# (rows, feature columns, warps) of a program's tile; the columns shrink to F's largest power-of-two divisor
# when that is at least 256, so the experts' F = 3,072 splits into whole blocks (scripts/bench/situ_glu.py
# --tiles times others)
TILES = (4, 1024, 8)


@triton.jit
def _tanh_sech2(x):
    """tanh(x) and sech^2(x) = 1 - tanh^2(x) from one exp2: e = exp(-2|x|), tanh|x| = (1 - e) / (1 + e),
    sech^2 = 4e / (1 + e)^2 (no cancellation where tanh saturates). Below |x| = 1/8, where 1 - e cancels,
    tanh is its Taylor series to x^7 (truncation < 2e-9 relative)."""
    a = tl.abs(x)
    e = tl.exp2(a * (-2.0 * 1.4426950408889634))
    r = 1.0 / (1.0 + e)
    a2 = a * a
    series = a * (1.0 + a2 * (-0.3333333333333333 + a2 * (0.13333333333333333 + a2 * -0.05396825396825397)))
    th = tl.where(a < 0.125, series, (1.0 - e) * r)
    return tl.where(x < 0.0, -th, th), 4.0 * e * r * r


@triton.jit
def _sigmoid(x):
    # exp2 of a large positive argument is inf and 1 / inf = 0: no overflow to NaN
    return 1.0 / (1.0 + tl.exp2(x * -1.4426950408889634))


@triton.jit
def _tile(N, F, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    """This program's rows, feature offsets and mask."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows[:, None] < N) & (offs[None, :] < F)
    return rows, offs, mask


@triton.jit
def _situ_glu_fwd_kernel(X, Y, stride_x, stride_y, N, F, beta, beta_lin,
                         BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    beta, beta_lin = as_fp32(beta), as_fp32(beta_lin)
    rows, offs, mask = _tile(N, F, BLOCK_R, BLOCK_F)
    x = X + rows[:, None] * stride_x + offs[None, :]
    g = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x + F, mask=mask, other=0.0).to(tl.float32)
    tg, _ = _tanh_sech2(g / beta)
    tu, _ = _tanh_sech2(u / beta_lin)
    y = (beta * tg * _sigmoid(g)) * (beta_lin * tu)
    tl.store(Y + rows[:, None] * stride_y + offs[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _situ_glu_bwd_kernel(X, DY, DX, stride_x, stride_dy, stride_dx, N, F, beta, beta_lin,
                         BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    beta, beta_lin = as_fp32(beta), as_fp32(beta_lin)
    rows, offs, mask = _tile(N, F, BLOCK_R, BLOCK_F)
    x = X + rows[:, None] * stride_x + offs[None, :]
    g = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x + F, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = _sigmoid(g)
    tg, sg = _tanh_sech2(g / beta)
    tu, su = _tanh_sech2(u / beta_lin)
    situ = beta * tg * sig
    clip = beta_lin * tu
    dg = dy * clip * (sg * sig + situ * (1.0 - sig))
    du = dy * situ * su
    dx = DX + rows[:, None] * stride_dx + offs[None, :]
    tl.store(dx, dg.to(DX.dtype.element_ty), mask=mask)
    tl.store(dx + F, du.to(DX.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., C] -> [N, C] view with unit stride on the last dim (copies only if needed)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch_shape(N: int, F: int, tiles: tuple[int, int, int] | None) -> tuple[tuple[int, int], dict]:
    block_r, block_f, warps = tiles or TILES
    divisor = F & -F
    block_f = min(block_f, divisor if divisor >= 256 else triton.next_power_of_2(F))
    if interpreting():
        block_r, block_f = min(block_r, 2), min(block_f, 64)
    return (triton.cdiv(N, block_r), triton.cdiv(F, block_f)), dict(BLOCK_R=block_r, BLOCK_F=block_f,
                                                                    num_warps=warps)


def _check(gate_up: torch.Tensor) -> int:
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2 != 0:
        raise ValueError(f"situ_glu: gate_up last dim must be even ([..., 2F]), got shape {tuple(gate_up.shape)}")
    if gate_up.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"situ_glu: gate_up must be bf16, fp16 or fp32, got {gate_up.dtype}")
    return gate_up.shape[-1] // 2


def situ_glu_forward(gate_up: torch.Tensor, beta: float = 4.0, beta_lin: float = 25.0,
                     tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """y [..., F] in gate_up's dtype. ``tiles``: (rows, columns, warps) per program, default ``TILES``."""
    F = _check(gate_up)
    x = _rows(gate_up)
    y = torch.empty(*gate_up.shape[:-1], F, dtype=gate_up.dtype, device=gate_up.device)
    y2 = y.view(-1, F)
    if x.shape[0] and F:
        grid, meta = _launch_shape(x.shape[0], F, tiles)
        launch(_situ_glu_fwd_kernel, grid, x, y2, x.stride(0), y2.stride(0), x.shape[0], F, float(beta),
               float(beta_lin), **meta)
    return y


def situ_glu_backward(dy: torch.Tensor, gate_up: torch.Tensor, beta: float = 4.0, beta_lin: float = 25.0,
                      tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """d(gate_up) [..., 2F] in gate_up's dtype."""
    F = _check(gate_up)
    if dy.shape != (*gate_up.shape[:-1], F):
        raise ValueError(f"situ_glu_backward: dy must be {(*gate_up.shape[:-1], F)}, got {tuple(dy.shape)}")
    x = _rows(gate_up)
    d = _rows(dy)
    dx = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
    dx2 = dx.view(-1, 2 * F)
    if x.shape[0] and F:
        grid, meta = _launch_shape(x.shape[0], F, tiles)
        launch(_situ_glu_bwd_kernel, grid, x, d, dx2, x.stride(0), d.stride(0), dx2.stride(0), x.shape[0], F,
               float(beta), float(beta_lin), **meta)
    return dx
