"""Sparse MLA backward in the absorbed latent form (docs/ops.md, op `sparse_mla`), in Triton.

Given q [T, H, Dqk], kv [S_kv, Dqk], idx [T, k] int32, out [T, H, d_v], dout [T, H, d_v], lse [T, H] fp32
(natural log, from sparse_mla_forward) -> dq [T, H, Dqk] (dtype of q), dkv [S_kv, Dqk] (dtype of kv).

0. delta[t, h] = sum_d dout * out (fp32), a small Triton kernel (no fp32 copy of [T, H, d_v]).
1. dQ kernel, grid (token, head block), keys-major like the forward (S^T = KV @ Q^T, M = keys):
       P^T  = exp2(S^T * scale * log2e - lse * log2e)      (masked slots -> 0)
       dP^T = KV_v @ dO^T;  dS^T = P^T * (dP^T - delta) * scale
       dQ^T += KV^T @ dS^T                                 (on chip for the whole row, no atomics)
   and stores P^T, dS^T (kv dtype) to a [T_chunk, k, H] workspace; with `head_mass` it also adds the head
   block's sum_h P^T per slot into mass [T, k] fp32 (the indexer's distillation target, ops/indexer_kl.py).
2. dKV kernel, grid (column block of Dqk, token): for each key block,
       dKV[idx] += dS^T @ Q[t] + P^T @ dO[t] (value columns only), the head sum done by the MMA (K = heads),
   then one fp32 atomic per (token, key, column) into an [S_kv, Dqk] buffer, cast to kv's dtype at the end.
   The heads (the MMA K) run as two power-of-two parts (96 = 64 + 32, `head_split`) instead of one padded to
   128, and the value columns [0, d_v) and rope columns [d_v, Dqk) are separate launches (the rope launch
   has no P^T @ dO term), so no MMA work goes to padding or zeros (sm90 AOT: 134 registers, 152 KB shared
   memory, no spills, against 150 / 192 KB for the padded version).

Why two kernels instead of one: fused, each head block would add its own dKV rows (3 atomics per key and
token at 96 heads = 3 x 32) and would need a [keys, Dqk] fp32 tile next to the dQ accumulator; on sm90 that
overflows registers and the 227 KB of shared memory. The workspace costs 2 * k * H * 2 bytes per token
(0.8 MB at K3 shapes, written once, read from L2); tokens are processed in chunks under `workspace_bytes`.
Same GEMM work as fused (S, dP, dQ in kernel 1; two dKV GEMMs in kernel 2). dKV is nondeterministic at the
fp32-rounding level (atomic order).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import autotune_enabled, config_key, dedup_configs, interpreting, launch, make_autotuner, next_pow2
from .sparse_mla_fwd import check_sparse_mla_inputs, dot_precision, load_key_tile, row_extent, upcast_dots

__all__ = [
    "sparse_mla_backward",
    "sparse_mla_bwd_preprocess",
    "dq_configs",
    "dkv_configs",
    "default_dq_config",
    "default_dkv_config",
]


# ----------------------------------------------------------------------------------------------------------
# 0. delta = rowsum(dout * out)


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
    """delta [T, H] fp32 = rowsum(dout * out)."""
    if out.shape != dout.shape or out.dim() != 3:
        raise ValueError(f"sparse_mla_backward: out {tuple(out.shape)} and dout {tuple(dout.shape)} must match [T,H,d_v]")
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


# ----------------------------------------------------------------------------------------------------------
# 1. dQ (+ P^T, dS^T workspace)


@triton.jit
def _bwd_dq_kernel(
    Q, KV, IDX, EXT, DO, LSE, DELTA, DQ, PB, DSB, MASS,
    stride_qt, stride_qh, stride_kvt, stride_it, stride_dt, stride_dh, stride_lt, stride_dqt, stride_dqh,
    stride_bt, stride_bn,
    t0, H, S_KV, TOPK, qk_scale_log2, sm_scale,
    D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    WITH_MASS: tl.constexpr,
):
    tl_ = tl.program_id(0).to(tl.int64)  # token inside the chunk
    t = t0 + tl_
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_v = tl.arange(0, BLOCK_DV)
    v_ok = offs_v < D_V
    offs_r = tl.arange(0, BLOCK_DR)
    r_ok = offs_r < D_R
    n_end = tl.load(EXT + t)

    # Q^T / dO^T tiles [D, BLOCK_H]: B operands of S^T = KV @ Q^T and dP^T = KV_v @ dO^T.
    q_ptr = Q + t * stride_qt + offs_h[None, :] * stride_qh
    qn = tl.load(q_ptr + offs_v[:, None], mask=v_ok[:, None] & h_ok[None, :], other=0.0)
    qr = tl.load(q_ptr + D_V + offs_r[:, None], mask=r_ok[:, None] & h_ok[None, :], other=0.0)
    do = tl.load(DO + t * stride_dt + offs_h[None, :] * stride_dh + offs_v[:, None],
                 mask=v_ok[:, None] & h_ok[None, :], other=0.0)
    if UPCAST:  # interpreter only: it cannot tl.dot bf16
        qn, qr, do = qn.to(tl.float32), qr.to(tl.float32), do.to(tl.float32)
    lse2 = tl.load(LSE + t * stride_lt + offs_h, mask=h_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + t * stride_lt + offs_h, mask=h_ok, other=0.0)

    dqn = tl.zeros([BLOCK_DV, BLOCK_H], tl.float32)
    dqr = tl.zeros([BLOCK_DR, BLOCK_H], tl.float32)
    for n0 in range(0, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok, kn, kr = load_key_tile(KV, IDX + t * stride_it, n0, n_end, S_KV, stride_kvt, offs_v, v_ok, offs_r, r_ok,
                                   D_V, BLOCK_N, UPCAST)
        s = tl.dot(kn, qn, input_precision=DOT_PREC)
        s = tl.dot(kr, qr, s, input_precision=DOT_PREC)  # [BLOCK_N, BLOCK_H]
        # where() after exp2: masked lanes may be inf/nan (empty rows have lse = -inf) and are dropped.
        p = tl.where(ok[:, None] & h_ok[None, :], tl.exp2(s * qk_scale_log2 - lse2[None, :]), 0.0)
        dp = tl.dot(kn, do, input_precision=DOT_PREC)
        ds = p * (dp - delta[None, :]) * sm_scale
        dsc = ds.to(kn.dtype)
        # workspace [T_chunk, k, H]: the dKV kernel reads [keys, heads] tiles with heads contiguous
        b_off = tl_ * stride_bt + offs_n[:, None] * stride_bn + offs_h[None, :]
        b_mask = (offs_n < TOPK)[:, None] & h_ok[None, :]
        tl.store(PB + b_off, p.to(PB.dtype.element_ty), mask=b_mask)
        tl.store(DSB + b_off, ds.to(DSB.dtype.element_ty), mask=b_mask)
        if WITH_MASS:  # this head block's share of sum_h P: one fp32 add per slot and head block, into zeros
            tl.atomic_add(MASS + t * TOPK + offs_n, tl.sum(p, 1), mask=offs_n < TOPK, sem="relaxed")
        dqn = tl.dot(tl.trans(kn), dsc, dqn, input_precision=DOT_PREC)  # [D_V, BLOCK_H]
        dqr = tl.dot(tl.trans(kr), dsc, dqr, input_precision=DOT_PREC)  # [D_R, BLOCK_H]

    dq_ptr = DQ + t * stride_dqt + offs_h[None, :] * stride_dqh
    tl.store(dq_ptr + offs_v[:, None], dqn.to(DQ.dtype.element_ty), mask=v_ok[:, None] & h_ok[None, :])
    tl.store(dq_ptr + D_V + offs_r[:, None], dqr.to(DQ.dtype.element_ty), mask=r_ok[:, None] & h_ok[None, :])


# ----------------------------------------------------------------------------------------------------------
# 2. dKV from the workspace


@triton.jit
def _load_tile(ptrs, mask, UPCAST: tl.constexpr):
    # masked elements load as 0; fp32 when UPCAST (the interpreter cannot tl.dot 16-bit types)
    x = tl.load(ptrs, mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _bwd_dkv_kernel(
    Q, IDX, EXT, DO, PB, DSB, DKV,
    stride_qt, stride_qh, stride_it, stride_dt, stride_dh, stride_bt, stride_bn, stride_dkvt,
    t0, H, S_KV, C0, C_END,
    HP_A: tl.constexpr, HP_B: tl.constexpr, HAS_V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    # Columns [C0, C_END) of Dqk; HAS_V: they are value columns (the P^T @ dO term exists), else rope columns.
    # The heads are the MMA K dimension, split into two power-of-two parts HP_A + HP_B (96 = 64 + 32) so no
    # MMA work goes to padded heads.
    offs_c = C0 + tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    tl_ = tl.program_id(1).to(tl.int64)
    t = t0 + tl_
    c_ok = offs_c < C_END
    n_end = tl.load(EXT + t)
    # [heads, columns] B operands of each head part, loaded once per program.
    offs_ha = tl.arange(0, HP_A)
    ha_ok = offs_ha < H
    mask_a = ha_ok[:, None] & c_ok[None, :]
    qa = _load_tile(Q + t * stride_qt + offs_ha[:, None] * stride_qh + offs_c[None, :], mask_a, UPCAST)
    if HAS_V:
        doa = _load_tile(DO + t * stride_dt + offs_ha[:, None] * stride_dh + offs_c[None, :], mask_a, UPCAST)
    if HP_B > 0:
        offs_hb = HP_A + tl.arange(0, HP_B)
        hb_ok = offs_hb < H
        mask_b = hb_ok[:, None] & c_ok[None, :]
        qb = _load_tile(Q + t * stride_qt + offs_hb[:, None] * stride_qh + offs_c[None, :], mask_b, UPCAST)
        if HAS_V:
            dob = _load_tile(DO + t * stride_dt + offs_hb[:, None] * stride_dh + offs_c[None, :], mask_b, UPCAST)
    for n0 in range(0, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_end
        kid = tl.load(IDX + t * stride_it + offs_n, mask=n_ok, other=-1)
        ok = (kid >= 0) & (kid < S_KV)
        # [keys, heads] A operands of each head part: dS^T, and P^T for the value columns
        off_a = tl_ * stride_bt + offs_n[:, None] * stride_bn + offs_ha[None, :]
        key_a = n_ok[:, None] & ha_ok[None, :]
        g = tl.dot(_load_tile(DSB + off_a, key_a, UPCAST), qa, input_precision=DOT_PREC)  # [BLOCK_N, BLOCK_D]
        if HAS_V:
            g = tl.dot(_load_tile(PB + off_a, key_a, UPCAST), doa, g, input_precision=DOT_PREC)
        if HP_B > 0:
            off_b = tl_ * stride_bt + offs_n[:, None] * stride_bn + offs_hb[None, :]
            key_b = n_ok[:, None] & hb_ok[None, :]
            g = tl.dot(_load_tile(DSB + off_b, key_b, UPCAST), qb, g, input_precision=DOT_PREC)
            if HAS_V:
                g = tl.dot(_load_tile(PB + off_b, key_b, UPCAST), dob, g, input_precision=DOT_PREC)
        tl.atomic_add(DKV + kid.to(tl.int64)[:, None] * stride_dkvt + offs_c[None, :], g,
                      mask=ok[:, None] & c_ok[None, :], sem="relaxed")


def head_split(H: int) -> tuple[int, int]:
    """Heads as two power-of-two MMA K parts (>= 16 each, the second 0 when one suffices): 96 -> (64, 32)."""
    a = max(16, 1 << (max(H, 1).bit_length() - 1))
    rest = H - a
    return a, (0 if rest <= 0 else max(16, next_pow2(rest)))


# ----------------------------------------------------------------------------------------------------------
# configs


def _head_block(H: int) -> int:
    return 32 if H % 32 == 0 else 16


def default_dq_config(H: int, on_gpu: bool = True) -> dict:
    """Like the forward: one warpgroup over 64 keys (wgmma M = 64), dQ^T [576, 32] fp32 on chip."""
    if not on_gpu:
        return dict(BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=1)
    return dict(BLOCK_H=_head_block(H), BLOCK_N=64, num_warps=4, num_stages=2)


def dq_configs(H: int) -> list[dict]:
    # sm90 AOT compile (96 heads): 32/64/w4/s2 uses 225 KB shared memory and 255 registers with ~0.5 KB of
    # spills; the 16-head block barely spills but doubles the kv gathers.
    bh = _head_block(H)
    return dedup_configs([
        dict(BLOCK_H=bh, BLOCK_N=64, num_warps=4, num_stages=2),
        dict(BLOCK_H=bh, BLOCK_N=64, num_warps=8, num_stages=2),
        dict(BLOCK_H=bh, BLOCK_N=32, num_warps=4, num_stages=3),
        dict(BLOCK_H=16, BLOCK_N=64, num_warps=4, num_stages=2),
    ])


def default_dkv_config(on_gpu: bool = True) -> dict:
    """64 keys x 128 columns per step, the heads as the MMA K dimension in two power-of-two parts (`head_split`).
    Shared memory: Q and dO column tiles 2 x 32 KB, 3 stages of P^T/dS^T tiles 3 x 32 KB, and 32 KB to
    re-layout the fp32 [64, 128] result for the atomics (~196 KB)."""
    if not on_gpu:
        return dict(BLOCK_N=16, BLOCK_D=32, num_warps=4, num_stages=1)
    return dict(BLOCK_N=64, BLOCK_D=128, num_warps=4, num_stages=3)


def dkv_configs() -> list[dict]:
    # all fit the 227 KB sm90 shared-memory limit at 96-128 heads (checked with an sm90 AOT compile)
    return dedup_configs([
        dict(BLOCK_N=64, BLOCK_D=128, num_warps=4, num_stages=3),
        dict(BLOCK_N=64, BLOCK_D=128, num_warps=4, num_stages=2),
        dict(BLOCK_N=128, BLOCK_D=64, num_warps=8, num_stages=2),
        dict(BLOCK_N=64, BLOCK_D=64, num_warps=4, num_stages=4),
    ])


@functools.lru_cache(maxsize=None)
def _autotuned_dq(cfg_key: tuple):
    # reset_to_zero: with WITH_MASS each benchmark run adds into MASS (a 1-element placeholder without it).
    return make_autotuner(_bwd_dq_kernel, cfg_key, ["H", "D_V", "D_R", "WITH_MASS"], reset_to_zero=["MASS"])


@functools.lru_cache(maxsize=None)
def _autotuned_dkv(cfg_key: tuple):
    # reset_to_zero: each benchmark run accumulates into DKV.
    return make_autotuner(_bwd_dkv_kernel, cfg_key, ["H", "C0", "C_END"], reset_to_zero=["DKV"])


# ----------------------------------------------------------------------------------------------------------
# entry point


def sparse_mla_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    d_v: int = 512,
    *,
    workspace_bytes: int = 2 << 30,
    dq_config: dict | None = None,
    dkv_config: dict | None = None,
    head_mass: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Sparse MLA backward. Returns (dq [T, H, Dqk] in q's dtype, dkv [S_kv, Dqk] in kv's dtype), and with
    `head_mass` also mass [T, k] fp32 = sum_h P[t, h, slot] (0 at -1 slots): the attention's head-summed
    probabilities, which the dQ kernel has in registers (the indexer's distillation target, without gathering
    the keys again).

    `workspace_bytes` caps the P/dS workspace (tokens are processed in chunks). `dq_config`
    (BLOCK_H, BLOCK_N, num_warps, num_stages) and `dkv_config` (BLOCK_N, BLOCK_D, num_warps, num_stages)
    pin configs and bypass autotuning, as does kernels.triton_autotune = false (defaults then)."""
    check_sparse_mla_inputs(q, kv, idx, d_v)
    T, H, D = q.shape
    if out.shape != (T, H, d_v) or dout.shape != (T, H, d_v):
        raise ValueError(f"sparse_mla_backward: out {tuple(out.shape)} / dout {tuple(dout.shape)} must be {(T, H, d_v)}")
    if lse.shape != (T, H) or lse.dtype != torch.float32:
        raise ValueError(f"sparse_mla_backward: lse must be fp32 {(T, H)}, got {lse.dtype} {tuple(lse.shape)}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    idx = idx if idx.stride(-1) == 1 else idx.contiguous()
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    lse = lse.contiguous()
    S_kv, k = kv.shape[0], idx.shape[1]
    d_r = D - d_v
    dq = torch.empty_like(q)
    dkv32 = torch.zeros(S_kv, D, dtype=torch.float32, device=q.device)
    mass = torch.zeros((T, k) if head_mass else (1,), dtype=torch.float32, device=q.device)
    if T == 0 or H == 0 or k == 0:
        dq.zero_()
        return (dq, dkv32.to(kv.dtype)) + ((mass,) if head_mass else ())
    delta = sparse_mla_bwd_preprocess(out, dout)
    ext = row_extent(idx, S_kv)
    tune = autotune_enabled(q)
    on_gpu = q.is_cuda and not interpreting()
    prec = dict(DOT_PREC=dot_precision(q.dtype), UPCAST=upcast_dots(q.dtype))

    per_token = 2 * k * H * kv.element_size()
    chunk = max(1, min(T, 65535, int(workspace_bytes) // per_token))
    pbuf = torch.empty(chunk, k, H, dtype=kv.dtype, device=q.device)
    dsbuf = torch.empty_like(pbuf)
    dq_meta = dict(D_V=d_v, D_R=d_r, BLOCK_DV=next_pow2(max(d_v, 16)), BLOCK_DR=next_pow2(max(d_r, 16)),
                   WITH_MASS=head_mass, **prec)
    hp_a, hp_b = head_split(H)
    dkv_meta = dict(HP_A=hp_a, HP_B=hp_b, **prec)
    for t0 in range(0, T, chunk):
        n = min(chunk, T - t0)
        dq_args = (q, kv, idx, ext, dout, lse, delta, dq, pbuf, dsbuf, mass,
                   q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), dout.stride(0), dout.stride(1),
                   lse.stride(0), dq.stride(0), dq.stride(1), pbuf.stride(0), pbuf.stride(1),
                   t0, H, S_kv, k, float(scale) * 1.4426950408889634, float(scale))
        if dq_config is None and tune:
            launch(_autotuned_dq(config_key(dq_configs(H))), lambda m: (n, triton.cdiv(H, m["BLOCK_H"])), *dq_args,
                   **dq_meta)
        else:
            c = dict(dq_config or default_dq_config(H, on_gpu))
            launch(_bwd_dq_kernel, (n, triton.cdiv(H, c["BLOCK_H"])), *dq_args, **dq_meta, **c)

        # value columns [0, d_v) (dS^T Q + P^T dO), then the rope columns [d_v, D) (dS^T Q only) in their own
        # launch: 576 columns are not padded to a multiple of the value block, and nothing multiplies zero dO.
        def dkv_args(c0: int, c_end: int) -> tuple:
            return (q, idx, ext, dout, pbuf, dsbuf, dkv32,
                    q.stride(0), q.stride(1), idx.stride(0), dout.stride(0), dout.stride(1),
                    pbuf.stride(0), pbuf.stride(1), dkv32.stride(0), t0, H, S_kv, c0, c_end)

        if dkv_config is None and tune:
            launch(_autotuned_dkv(config_key(dkv_configs())), lambda m: (triton.cdiv(d_v, m["BLOCK_D"]), n),
                   *dkv_args(0, d_v), HAS_V=True, **dkv_meta)
        else:
            c = dict(dkv_config or default_dkv_config(on_gpu))
            launch(_bwd_dkv_kernel, (triton.cdiv(d_v, c["BLOCK_D"]), n), *dkv_args(0, d_v), HAS_V=True,
                   **dkv_meta, **c)
        if d_r > 0:
            c = dict(dkv_config or default_dkv_config(on_gpu))
            c["BLOCK_D"] = min(c["BLOCK_D"], next_pow2(max(d_r, 16)))
            launch(_bwd_dkv_kernel, (triton.cdiv(d_r, c["BLOCK_D"]), n), *dkv_args(d_v, D), HAS_V=False,
                   **dkv_meta, **c)
    return (dq, dkv32.to(kv.dtype)) + ((mass,) if head_mass else ())
