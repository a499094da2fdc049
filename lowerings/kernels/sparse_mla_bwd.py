"""Sparse MLA backward in the absorbed latent form (docs/ops.md, op `sparse_mla`), in Triton.

Given q [T, H, Dqk], kv [S_kv, Dqk], idx [T, k] int32, out [T, H, d_v], dout [T, H, d_v], lse [T, H] fp32
(natural log, from sparse_mla_fwd) -> dq [T, H, Dqk] (dtype of q), dkv [S_kv, Dqk] (dtype of kv).

1. Preprocess: delta[t, h] = sum_d dout * out (fp32).
2. Grid (token, head block), loop over key blocks, keys-major like the forward (S^T = KV @ Q^T, M = keys):
       P^T  = exp2(S^T * scale * log2e - lse * log2e)      (recomputed, masked slots -> 0)
       dP^T = KV_v @ dO^T
       dS^T = P^T * (dP^T - delta) * scale
       dQ^T += KV^T @ dS^T                                 (kept on chip for the whole row)
       dKV[idx] += dS^T @ Q  (all Dqk) + P^T @ dO  (first d_v)   -> fp32 atomics into [S_kv, Dqk]
   then dKV is cast to kv's dtype. Atomics make dKV run-to-run nondeterministic (ordering of fp32 adds).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .sparse_mla_fwd import (
    autotune_enabled,
    check_sparse_mla_inputs,
    dot_precision,
    interpreting,
    launch,
    next_pow2,
    row_extent,
)

__all__ = ["sparse_mla_bwd", "sparse_mla_bwd_preprocess", "bwd_configs", "default_bwd_config"]


@triton.jit
def _delta_kernel(OUT, DO, DELTA, stride_ot, stride_oh, stride_dt, stride_dh, stride_lt, H,
                  D_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, BLOCK_DV)
    mask = (offs_h[:, None] < H) & (offs_v[None, :] < D_V)
    o = tl.load(OUT + t * stride_ot + offs_h[:, None] * stride_oh + offs_v[None, :], mask=mask, other=0.0)
    do = tl.load(DO + t * stride_dt + offs_h[:, None] * stride_dh + offs_v[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + t * stride_lt + offs_h, delta, mask=offs_h < H)


def sparse_mla_bwd_preprocess(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """delta [T, H] fp32 = rowsum(dout * out), without materialising fp32 copies of [T, H, d_v]."""
    if out.shape != dout.shape or out.dim() != 3:
        raise ValueError(f"sparse_mla_bwd: out {tuple(out.shape)} and dout {tuple(dout.shape)} must match [T,H,d_v]")
    out = out if out.stride(-1) == 1 else out.contiguous()
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    T, H, d_v = out.shape
    delta = torch.empty(T, H, dtype=torch.float32, device=out.device)
    if T and H:
        bh = 16
        launch(_delta_kernel, (T, triton.cdiv(H, bh)), out, dout, delta,
               out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), delta.stride(0), H,
               D_V=d_v, BLOCK_DV=next_pow2(max(d_v, 16)), BLOCK_H=bh)
    return delta


@triton.jit
def _sparse_mla_bwd_kernel(
    Q, KV, IDX, EXT, DO, LSE, DELTA, DQ, DKV,
    stride_qt, stride_qh, stride_kvt, stride_it, stride_dt, stride_dh, stride_lt,
    stride_dqt, stride_dqh, stride_dkvt,
    H, S_KV, qk_scale_log2, sm_scale,
    D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_v = tl.arange(0, BLOCK_DV)
    v_ok = offs_v < D_V
    offs_r = tl.arange(0, BLOCK_DR)
    r_ok = offs_r < D_R
    n_end = tl.load(EXT + t)

    # Row-major [BLOCK_H, D] tiles: B operand of the dKV GEMMs; their transposes feed S^T / dP^T.
    q_ptr = Q + t * stride_qt + offs_h[:, None] * stride_qh
    qn = tl.load(q_ptr + offs_v[None, :], mask=h_ok[:, None] & v_ok[None, :], other=0.0)
    qr = tl.load(q_ptr + D_V + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    do = tl.load(DO + t * stride_dt + offs_h[:, None] * stride_dh + offs_v[None, :],
                 mask=h_ok[:, None] & v_ok[None, :], other=0.0)
    lse2 = tl.load(LSE + t * stride_lt + offs_h, mask=h_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + t * stride_lt + offs_h, mask=h_ok, other=0.0)

    dqn = tl.zeros([BLOCK_DV, BLOCK_H], tl.float32)
    dqr = tl.zeros([BLOCK_DR, BLOCK_H], tl.float32)
    for n0 in range(0, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kid = tl.load(IDX + t * stride_it + offs_n, mask=offs_n < n_end, other=-1)
        ok = (kid >= 0) & (kid < S_KV)
        kid64 = kid.to(tl.int64)
        kv_row = KV + kid64 * stride_kvt
        kn = tl.load(kv_row[:, None] + offs_v[None, :], mask=ok[:, None] & v_ok[None, :], other=0.0)
        kr = tl.load(kv_row[:, None] + D_V + offs_r[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)

        s = tl.dot(kn, tl.trans(qn), input_precision=DOT_PREC)
        s = tl.dot(kr, tl.trans(qr), s, input_precision=DOT_PREC)  # [BLOCK_N, BLOCK_H]
        live = ok[:, None] & h_ok[None, :]
        # where() after exp2: masked lanes may be inf/nan (empty rows have lse = -inf) and are dropped.
        p = tl.where(live, tl.exp2(s * qk_scale_log2 - lse2[None, :]), 0.0)
        dp = tl.dot(kn, tl.trans(do), input_precision=DOT_PREC)  # [BLOCK_N, BLOCK_H]
        ds = p * (dp - delta[None, :]) * sm_scale
        dsc = ds.to(kn.dtype)
        pc = p.to(kn.dtype)

        dkn = tl.dot(dsc, qn, input_precision=DOT_PREC)
        dkn = tl.dot(pc, do, dkn, input_precision=DOT_PREC)  # [BLOCK_N, D_V]
        dkr = tl.dot(dsc, qr, input_precision=DOT_PREC)  # [BLOCK_N, D_R]
        dkv_row = DKV + kid64 * stride_dkvt
        tl.atomic_add(dkv_row[:, None] + offs_v[None, :], dkn, mask=ok[:, None] & v_ok[None, :], sem="relaxed")
        tl.atomic_add(dkv_row[:, None] + D_V + offs_r[None, :], dkr, mask=ok[:, None] & r_ok[None, :],
                      sem="relaxed")

        dqn = tl.dot(tl.trans(kn), dsc, dqn, input_precision=DOT_PREC)  # [D_V, BLOCK_H]
        dqr = tl.dot(tl.trans(kr), dsc, dqr, input_precision=DOT_PREC)  # [D_R, BLOCK_H]

    dq_ptr = DQ + t * stride_dqt + offs_h[None, :] * stride_dqh
    tl.store(dq_ptr + offs_v[:, None], dqn.to(DQ.dtype.element_ty), mask=v_ok[:, None] & h_ok[None, :])
    tl.store(dq_ptr + D_V + offs_r[:, None], dqr.to(DQ.dtype.element_ty), mask=r_ok[:, None] & h_ok[None, :])


def _cfg(bh: int, bn: int, warps: int, stages: int) -> dict:
    return dict(BLOCK_H=bh, BLOCK_N=bn, num_warps=warps, num_stages=stages)


def _head_block(H: int) -> int:
    return 32 if H % 32 == 0 else 16


def default_bwd_config(H: int, on_gpu: bool = True) -> dict:
    """8 warps: dQ^T [512, 32] fp32 is 64 regs/thread and the per-block dKV [64, 512] fp32 another 128.
    One stage: kv tile 72 KB + Q 36 KB + dO 32 KB already use ~140 KB of shared memory."""
    if not on_gpu:
        return _cfg(16, 16, 4, 1)
    return _cfg(_head_block(H), 64, 8, 1)


def bwd_configs(H: int) -> list[dict]:
    bh = _head_block(H)
    cfgs = [
        _cfg(bh, 64, 8, 1),
        _cfg(bh, 64, 8, 2),
        _cfg(bh, 32, 4, 2),
        _cfg(16, 64, 8, 2),
        _cfg(bh, 128, 8, 1),
    ]
    out, seen = [], set()
    for c in cfgs:
        key = tuple(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


@functools.lru_cache(maxsize=None)
def _autotuned_bwd(cfg_key: tuple):
    configs = [
        triton.Config({k: v for k, v in c if not k.startswith("num_")},
                      num_warps=dict(c)["num_warps"], num_stages=dict(c)["num_stages"])
        for c in cfg_key
    ]
    # reset_to_zero: each benchmark run accumulates into DKV.
    return triton.autotune(configs=configs, key=["H", "D_V", "D_R"], reset_to_zero=["DKV"])(_sparse_mla_bwd_kernel)


def sparse_mla_bwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    d_v: int = 512,
    *,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA backward. Returns (dq [T, H, Dqk] in q's dtype, dkv [S_kv, Dqk] in kv's dtype).

    `config` (BLOCK_H, BLOCK_N, num_warps, num_stages) pins a config and bypasses autotuning."""
    check_sparse_mla_inputs(q, kv, idx, d_v)
    T, H, D = q.shape
    if out.shape != (T, H, d_v) or dout.shape != (T, H, d_v):
        raise ValueError(f"sparse_mla_bwd: out {tuple(out.shape)} / dout {tuple(dout.shape)} must be {(T, H, d_v)}")
    if lse.shape != (T, H) or lse.dtype != torch.float32:
        raise ValueError(f"sparse_mla_bwd: lse must be fp32 {(T, H)}, got {lse.dtype} {tuple(lse.shape)}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    idx = idx if idx.stride(-1) == 1 else idx.contiguous()
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    lse = lse.contiguous()
    S_kv, k = kv.shape[0], idx.shape[1]
    d_r = D - d_v
    delta = sparse_mla_bwd_preprocess(out, dout)
    dq = torch.empty_like(q)
    dkv32 = torch.zeros(S_kv, D, dtype=torch.float32, device=q.device)
    if T == 0 or H == 0:
        return dq, dkv32.to(kv.dtype)
    ext = row_extent(idx, S_kv) if k > 0 else torch.zeros(T, dtype=torch.int32, device=q.device)
    args = (q, kv, idx, ext, dout, lse, delta, dq, dkv32,
            q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), dout.stride(0), dout.stride(1), lse.stride(0),
            dq.stride(0), dq.stride(1), dkv32.stride(0),
            H, S_kv, float(scale) * 1.4426950408889634, float(scale))
    meta = dict(D_V=d_v, D_R=d_r, BLOCK_DV=next_pow2(max(d_v, 16)), BLOCK_DR=next_pow2(max(d_r, 16)),
                DOT_PREC=dot_precision(q.dtype))
    if config is None and autotune_enabled(q):
        kernel = _autotuned_bwd(tuple(tuple(sorted(c.items())) for c in bwd_configs(H)))
        launch(kernel, lambda m: (T, triton.cdiv(H, m["BLOCK_H"])), *args, **meta)
    else:
        c = dict(config or default_bwd_config(H, on_gpu=q.is_cuda and not interpreting()))
        launch(_sparse_mla_bwd_kernel, (T, triton.cdiv(H, c["BLOCK_H"])), *args, **meta, **c)
    return dq, dkv32.to(kv.dtype)
