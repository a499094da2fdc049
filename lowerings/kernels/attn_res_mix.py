"""AttnRes mix forward and backward (docs/ops.md, op `attn_res_mix`), in Triton.

    bank [N, m, H], partial [N, H], norm_weight g [H], proj_weight w [H], eps -> out [N, H] (dtype of partial)
    values v_0..v_m = bank[:, 0..m-1], partial
    z_i = sum_c w_c g_c v_i[c] * r_i,  r_i = (mean_c v_i[c]^2 + eps)^-1/2;  alpha = softmax(z);  out = sum alpha_i v_i

One program per row (forward) or per group of rows (backward); each row is streamed twice over H in
BLOCK_H chunks (pass 1: per-value sums, pass 2: mix / gradients), so H up to 16K never sits in registers.
The bank tile is [next_pow2(m), BLOCK_H] and the partial a separate [BLOCK_H] vector, so m = 16 needs no
padding to 32.

Backward (a_i = sum_c wg_c v_i[c], wg = w * g, da_i = sum_c dout_c v_i[c]):
    dz_i = alpha_i (da_i - sum_j alpha_j da_j)
    dv_i = alpha_i dout + dz_i (r_i wg - a_i r_i^3 v_i / H)
    d(wg)_c = sum_rows sum_i dz_i r_i v_i[c];  d_g = w * d(wg), d_w = g * d(wg)
d(wg) is accumulated per program into its own fp32 row of a [P, H] buffer (P depends only on N) and reduced
in torch: deterministic, no atomics.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .launch import as_fp32, interpreting, launch

__all__ = ["attn_res_mix_forward", "attn_res_mix_backward"]

_MAX_PROGRAMS = 1024  # backward row groups; fixed so the d_g/d_w reduction order depends only on N


@triton.jit
def _row_stats(BANK, PART, WG, n, row_ok, stride_bn, stride_bm, stride_pn, M, HD, offs_i, offs_c0,
               BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, DOUT, stride_on, WITH_DOUT: tl.constexpr):
    # Pass 1 over one row: sum v^2, sum wg*v (and sum dout*v) for every bank entry and for the partial.
    b_ok = (offs_i < M) & row_ok
    ss_b = tl.zeros([BLOCK_M], tl.float32)
    a_b = tl.zeros([BLOCK_M], tl.float32)
    d_b = tl.zeros([BLOCK_M], tl.float32)
    ss_p = tl.zeros([BLOCK_H], tl.float32)
    a_p = tl.zeros([BLOCK_H], tl.float32)
    d_p = tl.zeros([BLOCK_H], tl.float32)
    for c0 in range(0, HD, BLOCK_H):
        offs_c = c0 + offs_c0
        c_ok = offs_c < HD
        vb = tl.load(BANK + n * stride_bn + offs_i[:, None] * stride_bm + offs_c[None, :],
                     mask=b_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        vp = tl.load(PART + n * stride_pn + offs_c, mask=c_ok & row_ok, other=0.0).to(tl.float32)
        wg = tl.load(WG + offs_c, mask=c_ok, other=0.0)
        ss_b += tl.sum(vb * vb, 1)
        a_b += tl.sum(vb * wg[None, :], 1)
        ss_p += vp * vp
        a_p += vp * wg
        if WITH_DOUT:
            do = tl.load(DOUT + n * stride_on + offs_c, mask=c_ok & row_ok, other=0.0).to(tl.float32)
            d_b += tl.sum(vb * do[None, :], 1)
            d_p += vp * do
    return ss_b, a_b, d_b, tl.sum(ss_p, 0), tl.sum(a_p, 0), tl.sum(d_p, 0)


@triton.jit
def _softmax_weights(ss_b, a_b, ss_p, a_p, b_ok, HD, eps):
    r_b = 1.0 / tl.sqrt(ss_b / HD + eps)
    r_p = 1.0 / tl.sqrt(ss_p / HD + eps)
    z_b = tl.where(b_ok, a_b * r_b, float("-inf"))
    z_p = a_p * r_p
    z_max = tl.maximum(tl.max(z_b, 0), z_p)
    e_b = tl.exp(z_b - z_max)
    e_p = tl.exp(z_p - z_max)
    denom = tl.sum(e_b, 0) + e_p
    return e_b / denom, e_p / denom, r_b, r_p


@triton.jit
def _attn_res_fwd_kernel(BANK, PART, WG, OUT, stride_bn, stride_bm, stride_pn, stride_on, M, HD, eps,
                         BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    eps = as_fp32(eps)
    n = tl.program_id(0).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_M)
    offs_c0 = tl.arange(0, BLOCK_H)
    b_ok = offs_i < M
    ss_b, a_b, _d_b, ss_p, a_p, _d_p = _row_stats(BANK, PART, WG, n, True, stride_bn, stride_bm, stride_pn, M, HD,
                                                  offs_i, offs_c0, BLOCK_M, BLOCK_H, PART, 0, False)
    al_b, al_p, _r_b, _r_p = _softmax_weights(ss_b, a_b, ss_p, a_p, b_ok, HD, eps)
    for c0 in range(0, HD, BLOCK_H):
        offs_c = c0 + offs_c0
        c_ok = offs_c < HD
        vb = tl.load(BANK + n * stride_bn + offs_i[:, None] * stride_bm + offs_c[None, :],
                     mask=b_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        vp = tl.load(PART + n * stride_pn + offs_c, mask=c_ok, other=0.0).to(tl.float32)
        o = tl.sum(al_b[:, None] * vb, 0) + al_p * vp
        tl.store(OUT + n * stride_on + offs_c, o.to(OUT.dtype.element_ty), mask=c_ok)


@triton.jit
def _attn_res_bwd_kernel(BANK, PART, WG, DOUT, DBANK, DPART, DWG,
                         stride_bn, stride_bm, stride_pn, stride_on, stride_dbn, stride_dbm, stride_dpn, stride_dwg,
                         N, M, HD, eps, ROWS_PER_PROG,
                         BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    eps = as_fp32(eps)
    pid = tl.program_id(0)
    offs_i = tl.arange(0, BLOCK_M)
    offs_c0 = tl.arange(0, BLOCK_H)
    dwg_row = DWG + pid.to(tl.int64) * stride_dwg
    for c0 in range(0, HD, BLOCK_H):  # this program's d(wg) row starts at zero
        tl.store(dwg_row + c0 + offs_c0, tl.zeros([BLOCK_H], tl.float32), mask=(c0 + offs_c0) < HD)
    for rr in range(0, ROWS_PER_PROG):
        n_i32 = pid * ROWS_PER_PROG + rr
        row_ok = n_i32 < N  # tail rows are masked, not branched (scalar loop bounds only)
        n = n_i32.to(tl.int64)
        b_ok = (offs_i < M) & row_ok
        ss_b, a_b, da_b, ss_p, a_p, da_p = _row_stats(BANK, PART, WG, n, row_ok, stride_bn, stride_bm, stride_pn,
                                                      M, HD, offs_i, offs_c0, BLOCK_M, BLOCK_H, DOUT, stride_on, True)
        al_b, al_p, r_b, r_p = _softmax_weights(ss_b, a_b, ss_p, a_p, offs_i < M, HD, eps)
        al_b = tl.where(b_ok, al_b, 0.0)
        mean_da = tl.sum(al_b * da_b, 0) + al_p * da_p
        dz_b = al_b * (da_b - mean_da)
        dz_p = al_p * (da_p - mean_da)
        k_b = dz_b * a_b * r_b * r_b * r_b / HD
        k_p = dz_p * a_p * r_p * r_p * r_p / HD
        for c0 in range(0, HD, BLOCK_H):
            offs_c = c0 + offs_c0
            c_ok = offs_c < HD
            m_b = b_ok[:, None] & c_ok[None, :]
            m_p = c_ok & row_ok
            vb = tl.load(BANK + n * stride_bn + offs_i[:, None] * stride_bm + offs_c[None, :],
                         mask=m_b, other=0.0).to(tl.float32)
            vp = tl.load(PART + n * stride_pn + offs_c, mask=m_p, other=0.0).to(tl.float32)
            do = tl.load(DOUT + n * stride_on + offs_c, mask=m_p, other=0.0).to(tl.float32)
            wg = tl.load(WG + offs_c, mask=c_ok, other=0.0)
            dvb = al_b[:, None] * do[None, :] + (dz_b * r_b)[:, None] * wg[None, :] - k_b[:, None] * vb
            dvp = al_p * do + (dz_p * r_p) * wg - k_p * vp
            tl.store(DBANK + n * stride_dbn + offs_i[:, None] * stride_dbm + offs_c[None, :],
                     dvb.to(DBANK.dtype.element_ty), mask=m_b)
            tl.store(DPART + n * stride_dpn + offs_c, dvp.to(DPART.dtype.element_ty), mask=m_p)
            contrib = tl.sum((dz_b * r_b)[:, None] * vb, 0) + (dz_p * r_p) * vp
            acc = tl.load(dwg_row + offs_c, mask=c_ok, other=0.0)
            tl.store(dwg_row + offs_c, acc + contrib, mask=c_ok)


def _check(bank: torch.Tensor, partial: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> None:
    if bank.dim() != 3:
        raise ValueError(f"attn_res_mix: bank must be [N, m, H], got shape {tuple(bank.shape)}")
    N, m, H = bank.shape
    if partial.shape != (N, H):
        raise ValueError(f"attn_res_mix: partial must be [N={N}, H={H}], got shape {tuple(partial.shape)}")
    if g.shape != (H,) or w.shape != (H,):
        raise ValueError(f"attn_res_mix: norm_weight/proj_weight must be [H={H}], got {tuple(g.shape)}/{tuple(w.shape)}")
    for name, t in (("bank", bank), ("partial", partial), ("norm_weight", g), ("proj_weight", w)):
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"attn_res_mix: {name} must be bf16, fp16 or fp32, got {t.dtype}")


def _last_contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _blocks(m: int, H: int) -> tuple[int, int, int]:
    bm = triton.next_power_of_2(max(m, 1))
    bh = max(64, min(triton.next_power_of_2(max(H, 1)), 8192 // bm))
    if interpreting():
        bh = min(bh, 32)  # exercise the chunk loops at test sizes
    return bm, bh, (8 if bm * bh >= 8192 else 4)


def attn_res_mix_forward(bank: torch.Tensor, partial: torch.Tensor, norm_weight: torch.Tensor,
                     proj_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """out [N, H] in partial's dtype."""
    _check(bank, partial, norm_weight, proj_weight)
    N, m, H = bank.shape
    bank, partial = _last_contig(bank), _last_contig(partial)
    wg = proj_weight.float() * norm_weight.float()
    out = torch.empty(N, H, dtype=partial.dtype, device=partial.device)
    if N and H:
        bm, bh, warps = _blocks(m, H)
        launch(_attn_res_fwd_kernel, (N,), bank, partial, wg, out,
                bank.stride(0), bank.stride(1), partial.stride(0), out.stride(0), m, H, float(eps),
                BLOCK_M=bm, BLOCK_H=bh, num_warps=warps)
    return out


def attn_res_mix_backward(dout: torch.Tensor, bank: torch.Tensor, partial: torch.Tensor, norm_weight: torch.Tensor,
                     proj_weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_bank [N, m, H], d_partial [N, H], d_norm_weight [H], d_proj_weight [H]), each in its input's dtype."""
    _check(bank, partial, norm_weight, proj_weight)
    N, m, H = bank.shape
    if dout.shape != (N, H):
        raise ValueError(f"attn_res_mix_backward: dout must be [N={N}, H={H}], got shape {tuple(dout.shape)}")
    bank, partial, dout = _last_contig(bank), _last_contig(partial), _last_contig(dout)
    gf, wf = norm_weight.float(), proj_weight.float()
    wg = wf * gf
    d_bank = torch.empty(N, m, H, dtype=bank.dtype, device=bank.device)
    d_part = torch.empty(N, H, dtype=partial.dtype, device=partial.device)
    progs = max(1, min(N, _MAX_PROGRAMS))
    rows_per_prog = triton.cdiv(N, progs) if N else 0
    progs = triton.cdiv(N, rows_per_prog) if N else 1
    # each program zeroes its own row in the kernel
    dwg = (torch.empty if N else torch.zeros)(progs, H, dtype=torch.float32, device=bank.device)
    if N and H:
        bm, bh, warps = _blocks(m, H)
        launch(_attn_res_bwd_kernel, (progs,), bank, partial, wg, dout, d_bank, d_part, dwg,
                bank.stride(0), bank.stride(1), partial.stride(0), dout.stride(0),
                d_bank.stride(0), d_bank.stride(1), d_part.stride(0), dwg.stride(0),
                N, m, H, float(eps), rows_per_prog, BLOCK_M=bm, BLOCK_H=bh, num_warps=warps)
    dwg_sum = dwg.sum(0)
    return (d_bank, d_part, (dwg_sum * wf).to(norm_weight.dtype), (dwg_sum * gf).to(proj_weight.dtype))
