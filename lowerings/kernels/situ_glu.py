"""SiTU-GLU forward and backward (docs/ops.md, op `situ_glu`), in Triton.

    gate_up [..., 2F] = [g | u]  ->  y [..., F] = beta tanh(g / beta) sigmoid(g) * beta_lin tanh(u / beta_lin)

fp32 math, I/O in the input dtype. Backward returns d(gate_up) [..., 2F]:
    dg = dy * clip(u) * ((1 - tanh^2(g/beta)) sigmoid(g) + beta tanh(g/beta) sigmoid(g) (1 - sigmoid(g)))
    du = dy * situ(g) * (1 - tanh^2(u/beta_lin))
Grid (row, column block): rows on axis 0 (no 65535 limit), F split in BLOCK_F columns on axis 1.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .launch import as_fp32, interpreting, launch

__all__ = ["situ_glu_forward", "situ_glu_backward"]


@triton.jit
def _tanh(x):
    # tanh from exp/log only (libdevice is unavailable in the interpreter). tanh|x| = -em1 / (2 + em1) with
    # em1 = expm1(-2|x|) by Kahan's trick, so small |x| keeps full relative precision.
    y = -2.0 * tl.abs(x)
    u = tl.exp(y)
    degenerate = (u == 1.0) | (u == 0.0)
    em1 = (u - 1.0) * y / tl.log(tl.where(degenerate, 0.5, u))
    em1 = tl.where(u == 1.0, y, tl.where(u == 0.0, -1.0, em1))
    th = -em1 / (2.0 + em1)
    return tl.where(x < 0.0, -th, th)


@triton.jit
def _sigmoid(x):
    e = tl.exp(-tl.abs(x))  # never overflows
    return tl.where(x >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _load_gate_up(X, stride_x, F, BLOCK_F: tl.constexpr):
    """This program's row and feature block of ``[gate | up]``: (row, offsets, mask, gate, up) in fp32."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = offs < F
    g = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + F + offs, mask=mask, other=0.0).to(tl.float32)
    return row, offs, mask, g, u


@triton.jit
def _situ_glu_fwd_kernel(X, Y, stride_x, stride_y, F, beta, beta_lin, BLOCK_F: tl.constexpr):
    beta, beta_lin = as_fp32(beta), as_fp32(beta_lin)
    row, offs, mask, g, u = _load_gate_up(X, stride_x, F, BLOCK_F)
    sig = _sigmoid(g)
    y = (beta * _tanh(g / beta) * sig) * (beta_lin * _tanh(u / beta_lin))
    tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _situ_glu_bwd_kernel(X, DY, DX, stride_x, stride_dy, stride_dx, F, beta, beta_lin, BLOCK_F: tl.constexpr):
    beta, beta_lin = as_fp32(beta), as_fp32(beta_lin)
    row, offs, mask, g, u = _load_gate_up(X, stride_x, F, BLOCK_F)
    dy = tl.load(DY + row * stride_dy + offs, mask=mask, other=0.0).to(tl.float32)
    sig = _sigmoid(g)
    tg = _tanh(g / beta)
    tu = _tanh(u / beta_lin)
    situ = beta * tg * sig
    clip = beta_lin * tu
    dsitu = (1.0 - tg * tg) * sig + beta * tg * sig * (1.0 - sig)
    dg = dy * clip * dsitu
    du = dy * situ * (1.0 - tu * tu)
    tl.store(DX + row * stride_dx + offs, dg.to(DX.dtype.element_ty), mask=mask)
    tl.store(DX + row * stride_dx + F + offs, du.to(DX.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., C] -> [N, C] view with unit stride on the last dim (copies only if needed)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _block(F: int) -> tuple[int, int]:
    bf = min(2048, triton.next_power_of_2(max(F, 16)))
    if interpreting():
        bf = min(bf, 64)
    return bf, (8 if bf >= 2048 else 4)


def _check(gate_up: torch.Tensor) -> int:
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2 != 0:
        raise ValueError(f"situ_glu: gate_up last dim must be even ([..., 2F]), got shape {tuple(gate_up.shape)}")
    if gate_up.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"situ_glu: gate_up must be bf16, fp16 or fp32, got {gate_up.dtype}")
    return gate_up.shape[-1] // 2


def situ_glu_forward(gate_up: torch.Tensor, beta: float = 4.0, beta_lin: float = 25.0) -> torch.Tensor:
    """y [..., F] in gate_up's dtype."""
    F = _check(gate_up)
    x = _rows(gate_up)
    y = torch.empty(*gate_up.shape[:-1], F, dtype=gate_up.dtype, device=gate_up.device)
    y2 = y.view(-1, F)
    if x.shape[0] and F:
        bf, warps = _block(F)
        launch(_situ_glu_fwd_kernel, (x.shape[0], triton.cdiv(F, bf)), x, y2, x.stride(0), y2.stride(0), F,
                float(beta), float(beta_lin), BLOCK_F=bf, num_warps=warps)
    return y


def situ_glu_backward(dy: torch.Tensor, gate_up: torch.Tensor, beta: float = 4.0, beta_lin: float = 25.0) -> torch.Tensor:
    """d(gate_up) [..., 2F] in gate_up's dtype."""
    F = _check(gate_up)
    if dy.shape != (*gate_up.shape[:-1], F):
        raise ValueError(f"situ_glu_backward: dy must be {(*gate_up.shape[:-1], F)}, got {tuple(dy.shape)}")
    x = _rows(gate_up)
    d = _rows(dy)
    dx = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
    dx2 = dx.view(-1, 2 * F)
    if x.shape[0] and F:
        bf, warps = _block(F)
        launch(_situ_glu_bwd_kernel, (x.shape[0], triton.cdiv(F, bf)), x, d, dx2, x.stride(0), d.stride(0),
                dx2.stride(0), F, float(beta), float(beta_lin), BLOCK_F=bf, num_warps=warps)
    return dx
