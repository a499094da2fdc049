"""Indexer distillation in Triton (docs/ops.md; ``kernels.indexer_distillation = triton``): the main
attention's head-summed mass and the indexer's scores, at selected keys or at every causal key, with the KL's
gradient into the indexer. Math and notation: ``lowerings/ops/indexer_kl_reference.py``.

One program per query row; keys come in blocks of BLOCK_N, either gathered from ``idx`` (the sparse stage) or
the contiguous causal window ``[seg_start[r], q_offset + r]`` (the warm-up). Products are keys-major (keys
on the MMA M dimension, heads on N): ``S^T = KV_blk @ Q^T`` for the main attention (its ``D`` split into a
power-of-two part and a tail, 512 + 64 at K3's 576) and ``L^T = K_blk @ Q_I^T`` for the indexer, so the sums
over heads stay inside a thread's accumulator rows.

* ``attention_lse``: per-head online log-sum-exp over the causal window.
* ``dense_kl``: one pass per query: online LSE of the indexer scores ``I``, and ``U = sum u``,
  ``A = sum u log u``, ``B = sum u I`` of the target mass ``u``, so ``KL = A/U - log U - B/U + LSE_I``
  (``p = u / U``); ``LSE_I`` and ``U`` are kept for the backward.
* ``dense_kl_backward``: ``dI = g (exp(I - LSE_I) - u / U)``; a query-major pass accumulates ``dq``, ``dw``
  per query in registers, a key-major pass (one program per key block, over the queries that see it)
  accumulates ``dk`` without atomics.
* ``sparse_target`` / ``scores_at`` / ``scores_at_backward``: ``u`` and ``I`` at the selected slots, and the
  scores' gradients from ``dI``: a query-major pass accumulates ``dq``, ``dw`` in registers and writes each
  slot's ``dk`` contribution to a buffer; a key-major pass sums each key's contributions, found through the
  stable sort of ``idx`` (no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import interpreting, launch, next_pow2

__all__ = ["attention_lse", "dense_kl", "dense_kl_backward", "sparse_target", "scores_at", "scores_at_backward"]

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------------------
# tiles shared by the kernels


@triton.jit
def _load_rows(BASE, ids, ok, stride, offs, width):
    """[BLOCK_N, len(offs)] rows ``ids`` of a row-major tensor, columns offs < width (0 elsewhere)."""
    return tl.load(BASE + ids[:, None] * stride + offs[None, :], mask=ok[:, None] & (offs < width)[None, :], other=0.0)


@triton.jit
def _load_query_t(ROW, stride_h, offs_h, h_ok, offs_d, width):
    """A query's heads as a transposed tile [len(offs_d), len(offs_h)] (the B operand of a keys-major dot)."""
    return tl.load(ROW + offs_h[None, :] * stride_h + offs_d[:, None],
                   mask=(offs_d < width)[:, None] & h_ok[None, :], other=0.0)


@triton.jit
def _main_logits(ka, kb, Q_ROW, stride_qh, offs_h, h_ok, D_A, D_B,
                 BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, DOT_PREC: tl.constexpr,
                 UPCAST: tl.constexpr):
    """[BLOCK_N, BLOCK_H] q . kv for the heads ``offs_h``, from the kv tile's two column parts."""
    qa = _load_query_t(Q_ROW, stride_qh, offs_h, h_ok, tl.arange(0, BLOCK_DA), D_A)
    if UPCAST:
        qa = qa.to(tl.float32)
    s = tl.dot(ka, qa, input_precision=DOT_PREC)
    if HAS_B:
        qb = _load_query_t(Q_ROW + D_A, stride_qh, offs_h, h_ok, tl.arange(0, BLOCK_DB), D_B)
        if UPCAST:
            qb = qb.to(tl.float32)
        s = tl.dot(kb, qb, s, input_precision=DOT_PREC)
    return s


@triton.jit
def _load_kv(KV, ids, ok, stride_kv, D_A, D_B, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
             HAS_B: tl.constexpr, UPCAST: tl.constexpr):
    ka = _load_rows(KV, ids, ok, stride_kv, tl.arange(0, BLOCK_DA), D_A)
    if HAS_B:
        kb = _load_rows(KV + D_A, ids, ok, stride_kv, tl.arange(0, BLOCK_DB), D_B)
    else:
        kb = ka
    if UPCAST:
        ka, kb = ka.to(tl.float32), kb.to(tl.float32)
    return ka, kb


@triton.jit
def _main_mass(ka, kb, ok, Q_ROW, LSE_ROW, stride_qh, H, D_A, D_B, scale_log2,
               BLOCK_H: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr,
               DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """u [BLOCK_N] = sum_h exp(scale q_h.kv - lse_h) at the keys of the tile (0 where not ok)."""
    u = tl.zeros([ka.shape[0]], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        s = _main_logits(ka, kb, Q_ROW, stride_qh, offs_h, h_ok, D_A, D_B, BLOCK_DA, BLOCK_DB, HAS_B, DOT_PREC,
                         UPCAST)
        lse = tl.load(LSE_ROW + offs_h, mask=h_ok, other=0.0) * 1.4426950408889634
        e = tl.exp2(s * scale_log2 - lse[None, :])
        u += tl.sum(tl.where(ok[:, None] & h_ok[None, :], e, 0.0), 1)
    return u


@triton.jit
def _index_logits(kt, IQ_ROW, stride_iqh, HI, DI, BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr,
                  DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """(L [BLOCK_N, BLOCK_HI] = k . q_I per head, the query tile q_I^T [BLOCK_DI, BLOCK_HI])."""
    offs_hi = tl.arange(0, BLOCK_HI)
    qt = _load_query_t(IQ_ROW, stride_iqh, offs_hi, offs_hi < HI, tl.arange(0, BLOCK_DI), DI)
    if UPCAST:
        qt = qt.to(tl.float32)
    return tl.dot(kt, qt, input_precision=DOT_PREC), qt


@triton.jit
def _scores(L, w, iscale):
    """I [BLOCK_N] = sum_h w_h relu(iscale L_h) (iscale > 0)."""
    return tl.sum(tl.maximum(L, 0.0) * (w * iscale)[None, :], 1)


@triton.jit
def _score_grads(dI, L, w, iscale):
    """(dw [BLOCK_HI] contribution, dL [BLOCK_N, BLOCK_HI]) of sum dI * I."""
    d_w = tl.sum(dI[:, None] * tl.maximum(L, 0.0) * iscale, 0)
    d_l = dI[:, None] * tl.where(L > 0.0, w[None, :] * iscale, 0.0)
    return d_w, d_l


# ----------------------------------------------------------------------------------------------------------
# every causal key


@triton.jit
def _attention_lse_kernel(Q, KV, SEG, LSE, stride_qt, stride_qh, stride_kv, H, D_A, D_B, q_off, scale_log2,
                          BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DA: tl.constexpr,
                          BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, DOT_PREC: tl.constexpr,
                          UPCAST: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    pos = q_off + r
    lo = tl.load(SEG + r).to(tl.int64)
    q_row = Q + r * stride_qt
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        for n0 in range(lo, pos + 1, BLOCK_N):
            ids = n0 + tl.arange(0, BLOCK_N)
            ok = ids <= pos
            ka, kb = _load_kv(KV, ids, ok, stride_kv, D_A, D_B, BLOCK_DA, BLOCK_DB, HAS_B, UPCAST)
            s = _main_logits(ka, kb, q_row, stride_qh, offs_h, h_ok, D_A, D_B, BLOCK_DA, BLOCK_DB, HAS_B, DOT_PREC,
                             UPCAST)
            s = tl.where(ok[:, None], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            l = l * tl.exp2(m - m_use) + tl.sum(tl.exp2(s - m_use[None, :]), 0)
            m = m_new
        lse = tl.where(l > 0.0, (m + tl.log2(tl.where(l > 0.0, l, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(LSE + r * H + offs_h, lse, mask=h_ok)


@triton.jit
def _dense_kl_fwd_kernel(IQ, IK, IW, Q, KV, LSE, SEG, KL, STATS,
                         stride_iqt, stride_iqh, stride_qt, stride_qh, stride_kv,
                         H, HI, DI, D_A, D_B, q_off, scale_log2, iscale,
                         BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HI: tl.constexpr,
                         BLOCK_DI: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
                         HAS_B: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    pos = q_off + r
    lo = tl.load(SEG + r).to(tl.int64)
    offs_hi = tl.arange(0, BLOCK_HI)
    w = tl.load(IW + r * HI + offs_hi, mask=offs_hi < HI, other=0.0).to(tl.float32)
    m = tl.full([], float("-inf"), tl.float32)
    zero = tl.zeros([], tl.float32)
    l, total, a, b = zero, zero, zero, zero
    for n0 in range(lo, pos + 1, BLOCK_N):
        ids = n0 + tl.arange(0, BLOCK_N)
        ok = ids <= pos
        ka, kb = _load_kv(KV, ids, ok, stride_kv, D_A, D_B, BLOCK_DA, BLOCK_DB, HAS_B, UPCAST)
        u = _main_mass(ka, kb, ok, Q + r * stride_qt, LSE + r * H, stride_qh, H, D_A, D_B, scale_log2, BLOCK_H,
                       BLOCK_DA, BLOCK_DB, HAS_B, DOT_PREC, UPCAST)
        kt = _load_rows(IK, ids, ok, DI, tl.arange(0, BLOCK_DI), DI)
        if UPCAST:
            kt = kt.to(tl.float32)
        L, _ = _index_logits(kt, IQ + r * stride_iqt, stride_iqh, HI, DI, BLOCK_HI, BLOCK_DI, DOT_PREC, UPCAST)
        scores = tl.where(ok, _scores(L, w, iscale), float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 0))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(scores - m_new), 0)
        m = m_new
        total += tl.sum(u, 0)
        a += tl.sum(tl.where(u > 0.0, u * tl.log(tl.where(u > 0.0, u, 1.0)), 0.0), 0)
        b += tl.sum(tl.where(ok, u * scores, 0.0), 0)
    lse_i = m + tl.log(l)
    safe = tl.where(total > 0.0, total, 1.0)
    kl = tl.where(total > 0.0, a / safe - tl.log(safe) - b / safe + lse_i, 0.0)
    tl.store(KL + r, kl)
    tl.store(STATS + r * 2, lse_i)
    tl.store(STATS + r * 2 + 1, total)


@triton.jit
def _dense_dI(ka, kb, kt, ok, r, IQ, IW, Q, LSE, STATS, G, stride_iqt, stride_iqh, stride_qt, stride_qh,
              H, HI, DI, D_A, D_B, scale_log2, iscale,
              BLOCK_H: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_DA: tl.constexpr,
              BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """For query row r against a key tile: (dI [BLOCK_N], L, the indexer query tile q_I^T, w)."""
    offs_hi = tl.arange(0, BLOCK_HI)
    w = tl.load(IW + r * HI + offs_hi, mask=offs_hi < HI, other=0.0).to(tl.float32)
    u = _main_mass(ka, kb, ok, Q + r * stride_qt, LSE + r * H, stride_qh, H, D_A, D_B, scale_log2, BLOCK_H,
                   BLOCK_DA, BLOCK_DB, HAS_B, DOT_PREC, UPCAST)
    L, qt = _index_logits(kt, IQ + r * stride_iqt, stride_iqh, HI, DI, BLOCK_HI, BLOCK_DI, DOT_PREC, UPCAST)
    lse_i = tl.load(STATS + r * 2)
    total = tl.load(STATS + r * 2 + 1)
    g = tl.load(G + r)
    soft = tl.exp(_scores(L, w, iscale) - lse_i)
    target = u / tl.where(total > 0.0, total, 1.0)
    return tl.where(ok, g * (soft - target), 0.0), L, qt, w


@triton.jit
def _dense_kl_bwd_query_kernel(IQ, IK, IW, Q, KV, LSE, SEG, STATS, G, DQ, DW,
                               stride_iqt, stride_iqh, stride_qt, stride_qh, stride_kv,
                               H, HI, DI, D_A, D_B, q_off, scale_log2, iscale,
                               BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HI: tl.constexpr,
                               BLOCK_DI: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
                               HAS_B: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    pos = q_off + r
    lo = tl.load(SEG + r).to(tl.int64)
    offs_hi = tl.arange(0, BLOCK_HI)
    offs_di = tl.arange(0, BLOCK_DI)
    dq = tl.zeros([BLOCK_HI, BLOCK_DI], tl.float32)
    dw = tl.zeros([BLOCK_HI], tl.float32)
    for n0 in range(lo, pos + 1, BLOCK_N):
        ids = n0 + tl.arange(0, BLOCK_N)
        ok = ids <= pos
        ka, kb = _load_kv(KV, ids, ok, stride_kv, D_A, D_B, BLOCK_DA, BLOCK_DB, HAS_B, UPCAST)
        kt = _load_rows(IK, ids, ok, DI, offs_di, DI)
        if UPCAST:
            kt = kt.to(tl.float32)
        dI, L, _, w = _dense_dI(ka, kb, kt, ok, r, IQ, IW, Q, LSE, STATS, G, stride_iqt, stride_iqh, stride_qt,
                                stride_qh, H, HI, DI, D_A, D_B, scale_log2, iscale, BLOCK_H, BLOCK_HI, BLOCK_DI,
                                BLOCK_DA, BLOCK_DB, HAS_B, DOT_PREC, UPCAST)
        d_w, d_l = _score_grads(dI, L, w, iscale)
        dw += d_w
        dq = tl.dot(tl.trans(d_l).to(kt.dtype), kt, dq, input_precision=DOT_PREC)
    tl.store(DQ + r * HI * DI + offs_hi[:, None] * DI + offs_di[None, :], dq,
             mask=(offs_hi < HI)[:, None] & (offs_di < DI)[None, :])
    tl.store(DW + r * HI + offs_hi, dw, mask=offs_hi < HI)


@triton.jit
def _dense_kl_bwd_key_kernel(IQ, IK, IW, Q, KV, LSE, SEG, STATS, G, ROWS, DK,
                             stride_iqt, stride_iqh, stride_qt, stride_qh, stride_kv,
                             TK, H, HI, DI, D_A, D_B, q_off, scale_log2, iscale,
                             BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HI: tl.constexpr,
                             BLOCK_DI: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
                             HAS_B: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    # One key block, resident; the query rows that can see any of its keys are ROWS[2 kb], ROWS[2 kb + 1].
    kblk = tl.program_id(0)
    ids = kblk.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_range = ids < TK
    offs_di = tl.arange(0, BLOCK_DI)
    ka, kb = _load_kv(KV, ids, in_range, stride_kv, D_A, D_B, BLOCK_DA, BLOCK_DB, HAS_B, UPCAST)
    kt = _load_rows(IK, ids, in_range, DI, offs_di, DI)
    if UPCAST:
        kt = kt.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_DI], tl.float32)
    r0 = tl.load(ROWS + 2 * kblk).to(tl.int64)
    r1 = tl.load(ROWS + 2 * kblk + 1).to(tl.int64)
    for r in range(r0, r1):
        ok = in_range & (ids <= q_off + r) & (ids >= tl.load(SEG + r))
        dI, L, qt, w = _dense_dI(ka, kb, kt, ok, r, IQ, IW, Q, LSE, STATS, G, stride_iqt, stride_iqh, stride_qt,
                                 stride_qh, H, HI, DI, D_A, D_B, scale_log2, iscale, BLOCK_H, BLOCK_HI, BLOCK_DI,
                                 BLOCK_DA, BLOCK_DB, HAS_B, DOT_PREC, UPCAST)
        _, d_l = _score_grads(dI, L, w, iscale)
        dk = tl.dot(d_l.to(qt.dtype), tl.trans(qt), dk, input_precision=DOT_PREC)
    tl.store(DK + ids[:, None] * DI + offs_di[None, :], dk, mask=in_range[:, None] & (offs_di < DI)[None, :])


# ----------------------------------------------------------------------------------------------------------
# selected keys


@triton.jit
def _sparse_target_kernel(Q, KV, LSE, IDX, U, stride_qt, stride_qh, stride_kv, H, K, D_A, D_B, scale_log2,
                          BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DA: tl.constexpr,
                          BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, DOT_PREC: tl.constexpr,
                          UPCAST: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    for n0 in range(0, K, BLOCK_N):
        slots = n0 + tl.arange(0, BLOCK_N)
        ids = tl.load(IDX + r * K + slots, mask=slots < K, other=-1).to(tl.int64)
        ok = ids >= 0
        ka, kb = _load_kv(KV, ids, ok, stride_kv, D_A, D_B, BLOCK_DA, BLOCK_DB, HAS_B, UPCAST)
        u = _main_mass(ka, kb, ok, Q + r * stride_qt, LSE + r * H, stride_qh, H, D_A, D_B, scale_log2, BLOCK_H,
                       BLOCK_DA, BLOCK_DB, HAS_B, DOT_PREC, UPCAST)
        tl.store(U + r * K + slots, u, mask=slots < K)


@triton.jit
def _scores_at_kernel(IQ, IK, IW, IDX, OUT, stride_iqt, stride_iqh, HI, DI, K, iscale,
                      BLOCK_N: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr,
                      DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs_hi = tl.arange(0, BLOCK_HI)
    w = tl.load(IW + r * HI + offs_hi, mask=offs_hi < HI, other=0.0).to(tl.float32)
    for n0 in range(0, K, BLOCK_N):
        slots = n0 + tl.arange(0, BLOCK_N)
        ids = tl.load(IDX + r * K + slots, mask=slots < K, other=-1).to(tl.int64)
        ok = ids >= 0
        kt = _load_rows(IK, ids, ok, DI, tl.arange(0, BLOCK_DI), DI)
        if UPCAST:
            kt = kt.to(tl.float32)
        L, _ = _index_logits(kt, IQ + r * stride_iqt, stride_iqh, HI, DI, BLOCK_HI, BLOCK_DI, DOT_PREC, UPCAST)
        tl.store(OUT + r * K + slots, tl.where(ok, _scores(L, w, iscale), float("-inf")), mask=slots < K)


@triton.jit
def _scores_at_bwd_kernel(D_SCORES, IQ, IK, IW, IDX, DQ, V, DW, stride_iqt, stride_iqh, HI, DI, K, iscale, t0,
                          BLOCK_N: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr,
                          DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Query-major over the rows t0 + program: dq, dw of row r in registers; slot j's dk contribution
    (d_l @ q_I)[j] goes to row (r - t0) K + j of the chunk's V [n K, DI] (V's dtype; -1 slots are not written:
    the key-major pass never reads them)."""
    r = t0 + tl.program_id(0).to(tl.int64)
    offs_hi = tl.arange(0, BLOCK_HI)
    offs_di = tl.arange(0, BLOCK_DI)
    w = tl.load(IW + r * HI + offs_hi, mask=offs_hi < HI, other=0.0).to(tl.float32)
    dq = tl.zeros([BLOCK_HI, BLOCK_DI], tl.float32)
    dw = tl.zeros([BLOCK_HI], tl.float32)
    for n0 in range(0, K, BLOCK_N):
        slots = n0 + tl.arange(0, BLOCK_N)
        ids = tl.load(IDX + r * K + slots, mask=slots < K, other=-1).to(tl.int64)
        ok = ids >= 0
        kt = _load_rows(IK, ids, ok, DI, offs_di, DI)
        if UPCAST:
            kt = kt.to(tl.float32)
        L, qt = _index_logits(kt, IQ + r * stride_iqt, stride_iqh, HI, DI, BLOCK_HI, BLOCK_DI, DOT_PREC, UPCAST)
        dI = tl.where(ok, tl.load(D_SCORES + r * K + slots, mask=slots < K, other=0.0), 0.0)
        d_w, d_l = _score_grads(dI, L, w, iscale)
        dw += d_w
        dq = tl.dot(tl.trans(d_l).to(kt.dtype), kt, dq, input_precision=DOT_PREC)
        d_k = tl.dot(d_l.to(qt.dtype), tl.trans(qt), input_precision=DOT_PREC)
        tl.store(V + ((r - t0) * K + slots)[:, None] * DI + offs_di[None, :], d_k.to(V.dtype.element_ty),
                 mask=ok[:, None] & (offs_di < DI)[None, :])
    tl.store(DQ + r * HI * DI + offs_hi[:, None] * DI + offs_di[None, :], dq,
             mask=(offs_hi < HI)[:, None] & (offs_di < DI)[None, :])
    tl.store(DW + r * HI + offs_hi, dw, mask=offs_hi < HI)


@triton.jit
def _scores_at_bwd_key_kernel(V, ORDER, BOUNDS, DK, DI, BLOCK_R: tl.constexpr, BLOCK_DI: tl.constexpr):
    """Key-major: dk[s] += the fp32 sum of V[ORDER[BOUNDS[s]:BOUNDS[s + 1]]], BLOCK_R rows at a time (a key's
    run is anything from empty to every query of the chunk). One program per key: no atomics."""
    s = tl.program_id(0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_di = tl.arange(0, BLOCK_DI)
    di_ok = offs_di < DI
    start = tl.load(BOUNDS + s).to(tl.int64)
    end = tl.load(BOUNDS + s + 1).to(tl.int64)
    acc = tl.zeros([BLOCK_R, BLOCK_DI], tl.float32)
    for c0 in range(start, end, BLOCK_R):
        pos = c0 + offs_r
        ok = pos < end
        rows = tl.load(ORDER + pos, mask=ok, other=0).to(tl.int64)
        acc += _load_rows(V, rows, ok, DI, offs_di, DI).to(tl.float32)
    if end > start:
        prev = tl.load(DK + s * DI + offs_di, mask=di_ok, other=0.0)
        tl.store(DK + s * DI + offs_di, prev + tl.sum(acc, 0), mask=di_ok)


# ----------------------------------------------------------------------------------------------------------
# host side


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 or interpreting() else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    """The interpreter computes tl.dot of bf16 on the raw storage: cast 16-bit tiles to fp32 there."""
    return interpreting() and dtype != torch.float32


def default_config(on_gpu: bool) -> dict:
    """64 keys per step (the wgmma M of one warpgroup), 4 warps; small tiles in the interpreter, so tests run
    several key blocks and head blocks."""
    return dict(BLOCK_N=64, BLOCK_H=64, num_warps=4, num_stages=2) if on_gpu else \
        dict(BLOCK_N=16, BLOCK_H=16, num_warps=4, num_stages=1)


def _main_meta(q: torch.Tensor, config: dict | None) -> dict:
    """Block sizes of the main attention's head and feature dims: D = a power-of-two part + a tail."""
    H, D = q.shape[1], q.shape[2]
    cfg = dict(config or default_config(q.is_cuda and not interpreting()))
    d_a = 1 << (D.bit_length() - 1)
    d_b = D - d_a
    return dict(D_A=d_a, D_B=d_b, BLOCK_DA=max(16, d_a), BLOCK_DB=max(16, next_pow2(max(d_b, 1))), HAS_B=d_b > 0,
                BLOCK_N=cfg["BLOCK_N"], BLOCK_H=min(cfg["BLOCK_H"], max(16, next_pow2(H))),
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                DOT_PREC=_dot_precision(q.dtype), UPCAST=_upcast(q.dtype))


def _index_meta(iq: torch.Tensor) -> dict:
    HI, DI = iq.shape[1], iq.shape[2]
    if HI > 128:
        raise ValueError(f"indexer distillation (triton): {HI} indexer heads; the kernels take at most 128")
    return dict(BLOCK_HI=max(16, next_pow2(HI)), BLOCK_DI=max(16, next_pow2(DI)))


def _contiguous(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.contiguous() for t in ts]


def attention_lse(q, kv, seg_start, scale: float, q_offset: int = 0, *, config: dict | None = None) -> torch.Tensor:
    q, kv, seg_start = _contiguous(q, kv, seg_start.to(torch.int32))
    T, H, _ = q.shape
    out = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T:
        meta = _main_meta(q, config)
        launch(_attention_lse_kernel, (T,), q, kv, seg_start, out, q.stride(0), q.stride(1), kv.stride(0), H,
               meta.pop("D_A"), meta.pop("D_B"), int(q_offset), float(scale) * LOG2E, **meta)
    return out


def _dense_args(iq, ik, iw, q, kv, lse, seg_start):
    return _contiguous(iq, ik, iw.float(), q, kv, lse.float(), seg_start.to(torch.int32))


def dense_kl(iq, ik, iw, q, kv, lse, seg_start, q_offset: int, index_scale: float, scale: float, *,
             config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(kl [T], stats [T, 2] = (LSE of the indexer scores, the target's total mass U)) fp32."""
    iq, ik, iw, q, kv, lse, seg_start = _dense_args(iq, ik, iw, q, kv, lse, seg_start)
    T, H, _ = q.shape
    kl = torch.empty(T, dtype=torch.float32, device=q.device)
    stats = torch.empty(T, 2, dtype=torch.float32, device=q.device)
    if T:
        meta = {**_main_meta(q, config), **_index_meta(iq)}
        launch(_dense_kl_fwd_kernel, (T,), iq, ik, iw, q, kv, lse, seg_start, kl, stats, iq.stride(0), iq.stride(1),
               q.stride(0), q.stride(1), kv.stride(0), H, iq.shape[1], iq.shape[2], meta.pop("D_A"), meta.pop("D_B"),
               int(q_offset), float(scale) * LOG2E, float(index_scale), **meta)
    return kl, stats


def _rows_per_key_block(seg_start: torch.Tensor, q_offset: int, tk: int, block: int) -> torch.Tensor:
    """[n_blocks, 2] int32: the query rows [first, end) that can see a key of each block of ``block`` keys
    (rows r with q_offset + r >= the block's first key and seg_start[r] <= its last; seg_start nondecreasing)."""
    first = torch.arange(0, tk, block, device=seg_start.device, dtype=torch.int64)
    last = (first + block - 1).clamp(max=tk - 1)
    begin = (first - q_offset).clamp(min=0, max=seg_start.shape[0])
    end = torch.searchsorted(seg_start.to(torch.int64), last, right=True)
    return torch.stack([begin, torch.maximum(begin, end)], dim=1).to(torch.int32).contiguous()


def dense_kl_backward(grad, iq, ik, iw, q, kv, lse, seg_start, stats, q_offset: int, index_scale: float,
                      scale: float, *, config: dict | None = None) -> tuple[torch.Tensor, ...]:
    iq, ik, iw, q, kv, lse, seg_start = _dense_args(iq, ik, iw, q, kv, lse, seg_start)
    grad, stats = _contiguous(grad.float(), stats.float())
    T, H, _ = q.shape
    HI, DI = iq.shape[1], iq.shape[2]
    dq = torch.zeros(T, HI, DI, dtype=torch.float32, device=q.device)
    dw = torch.zeros(T, HI, dtype=torch.float32, device=q.device)
    dk = torch.zeros(ik.shape[0], DI, dtype=torch.float32, device=q.device)
    if T:
        meta = {**_main_meta(q, config), **_index_meta(iq)}
        d_a, d_b = meta.pop("D_A"), meta.pop("D_B")
        common = (iq.stride(0), iq.stride(1), q.stride(0), q.stride(1), kv.stride(0))
        consts = (int(q_offset), float(scale) * LOG2E, float(index_scale))
        launch(_dense_kl_bwd_query_kernel, (T,), iq, ik, iw, q, kv, lse, seg_start, stats, grad, dq, dw, *common,
               H, HI, DI, d_a, d_b, *consts, **meta)
        tk = ik.shape[0]
        rows = _rows_per_key_block(seg_start, int(q_offset), tk, meta["BLOCK_N"])
        launch(_dense_kl_bwd_key_kernel, (rows.shape[0],), iq, ik, iw, q, kv, lse, seg_start, stats, grad, rows, dk,
               *common, tk, H, HI, DI, d_a, d_b, *consts, **meta)
    return dq, dk, dw


def sparse_target(q, kv, lse, idx, scale: float, *, config: dict | None = None) -> torch.Tensor:
    """p [T, k]: the head-summed mass at the selected slots, L1-normalised per row (0 at -1 slots)."""
    q, kv, lse, idx = _contiguous(q, kv, lse.float(), idx)
    T, H, _ = q.shape
    u = torch.zeros(idx.shape, dtype=torch.float32, device=q.device)
    if T and idx.shape[1]:
        meta = _main_meta(q, config)
        launch(_sparse_target_kernel, (T,), q, kv, lse, idx, u, q.stride(0), q.stride(1), kv.stride(0), H,
               idx.shape[1], meta.pop("D_A"), meta.pop("D_B"), float(scale) * LOG2E, **meta)
    total = u.sum(-1, keepdim=True)
    return torch.where(total > 0, u / total.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(u))


def scores_at(iq, ik, iw, idx, index_scale: float, *, config: dict | None = None) -> torch.Tensor:
    iq, ik, iw, idx = _contiguous(iq, ik, iw.float(), idx)
    T, HI, DI = iq.shape
    out = torch.empty(idx.shape, dtype=torch.float32, device=iq.device)
    if T and idx.shape[1]:
        meta = {**_main_meta(iq, config), **_index_meta(iq)}
        launch(_scores_at_kernel, (T,), iq, ik, iw, idx, out, iq.stride(0), iq.stride(1), HI, DI, idx.shape[1],
               float(index_scale), BLOCK_N=meta["BLOCK_N"], BLOCK_HI=meta["BLOCK_HI"], BLOCK_DI=meta["BLOCK_DI"],
               DOT_PREC=meta["DOT_PREC"], UPCAST=meta["UPCAST"], num_warps=meta["num_warps"],
               num_stages=meta["num_stages"])
    return out


def _slots_by_key(idx: torch.Tensor, tk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``idx`` [T, K]: (order [T K], the flat slots sorted by key (stable; the -1 slots first),
    bounds [tk + 1]): key s's slots are order[bounds[s]:bounds[s + 1]] (an empty run where no slot selects s)."""
    keys, order = torch.sort(idx.flatten(), stable=True)
    bounds = torch.searchsorted(keys, torch.arange(tk + 1, dtype=keys.dtype, device=keys.device))
    itype = torch.int32 if idx.numel() < 2**31 else torch.int64
    return order.to(itype), bounds.to(itype)


def scores_at_backward(d_scores, iq, ik, iw, idx, index_scale: float, *, config: dict | None = None,
                       workspace_bytes: int = 2 << 30) -> tuple[torch.Tensor, ...]:
    """dk without atomics, in two phases per chunk of query rows: the query-major kernel (dq, dw) writes every
    selected slot's dk contribution to V [n K, DI], and a key-major kernel adds each key's rows of V into dk,
    found through the stable sort of the chunk's idx. fp32 atomics into dk made the backward 12.2 ms against the
    forward's 1.1 ms on an H200 (T = 8192, K = 2048, 64 x 128 indexer heads; T K DI = 2.1G atomics).
    ``workspace_bytes`` caps V (iq's dtype, so fp32 inputs keep fp32 sums), as the sparse-MLA backward caps its
    P/dS workspace: T K DI would be 4.3 GB in bf16 at that shape."""
    d_scores, iq, ik, iw, idx = _contiguous(d_scores.float(), iq, ik, iw.float(), idx)
    T, HI, DI = iq.shape
    tk, K = ik.shape[0], idx.shape[1]
    dq = torch.zeros(T, HI, DI, dtype=torch.float32, device=iq.device)
    dw = torch.zeros(T, HI, dtype=torch.float32, device=iq.device)
    dk = torch.zeros(tk, DI, dtype=torch.float32, device=iq.device)
    if not (T and K and tk):
        return dq, dk, dw
    meta = {**_main_meta(iq, config), **_index_meta(iq)}
    chunk = max(1, min(T, int(workspace_bytes) // (K * DI * iq.element_size())))
    v = torch.empty(chunk * K, DI, dtype=iq.dtype, device=iq.device)
    for t0 in range(0, T, chunk):
        n = min(chunk, T - t0)
        launch(_scores_at_bwd_kernel, (n,), d_scores, iq, ik, iw, idx, dq, v, dw, iq.stride(0), iq.stride(1), HI,
               DI, K, float(index_scale), t0, BLOCK_N=meta["BLOCK_N"], BLOCK_HI=meta["BLOCK_HI"],
               BLOCK_DI=meta["BLOCK_DI"], DOT_PREC=meta["DOT_PREC"], UPCAST=meta["UPCAST"],
               num_warps=meta["num_warps"], num_stages=meta["num_stages"])
        order, bounds = _slots_by_key(idx[t0:t0 + n], tk)
        launch(_scores_at_bwd_key_kernel, (tk,), v, order, bounds, dk, DI, BLOCK_R=meta["BLOCK_N"],
               BLOCK_DI=meta["BLOCK_DI"], num_warps=meta["num_warps"], num_stages=meta["num_stages"])
    return dq, dk, dw
