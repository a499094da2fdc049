"""Sparse MLA forward for Hopper (sm90) as a warp-specialized Gluon kernel (same contract as
`sparse_mla_fwd.sparse_mla_forward`: q [T, H, 576], kv [S_kv, 576], idx [T, k] int32 -> out [T, H, 512],
lse [T, H] fp32 natural log; -1 / out-of-range slots unused; rows without a valid key give 0 and -inf).

Why a second kernel: the Triton-language kernel cannot overlap the kv gather, the softmax and the MMAs (Triton
3.6's automatic warp specialization does not handle gathered loads) and tops out near 260 TFLOP/s at 64 heads.
Here one CTA = one token x 64 heads, in three partitions that talk through mbarriers:

* producer (default partition, 4 warps, the registers the consumers leave): cp.async gathers BN kv rows per
  step straight into 128B-swizzled shared memory (a 512-column "nope" tile and a 64-column rope tile), a ring of
  STAGES slots; each thread's copies arrive on the slot's `ready` barrier when they land (noinc arrive);
* two consumer warpgroups (4 warps each, CONSUMER_REGS registers): each computes the full score tile
  S = Q K^T [64, BN] with wgmma (both operands in shared memory), runs the online softmax, and accumulates its
  own half of the output, O[:, 0:256] or O[:, 256:512] (P from registers, V = the nope tile of the same slot).
  The score GEMM is done twice; one [64, 512] fp32 accumulator does not fit one warpgroup, and sharing S across
  warpgroups costs a shared-memory round trip per step (measured slower on the H200: 400 vs 417 TFLOP/s).
  Each consumer releases the slot on `empty` after its PV MMA has finished reading it.

96 heads run as two 64-head blocks, the second half empty (rows of absent heads load as zeros and are not
stored). Shared memory: Q 72 KB + 2 x 72 KB kv stages = 216 KB of the sm90 227 KB. The kv row stride is a
constexpr (576 for a contiguous kv): runtime-stride row addresses cost the 24-register producer ~10%.

H200, T = 8K, top-k 2048 (docs/perf.md): 406 TFLOP/s at 64 heads, ~290 at 96 (the second block does a full
block's work for 32 heads); the Triton-language kernel: 261 / 215.
"""

from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

__all__ = ["ws_forward_unsupported", "sparse_mla_forward_ws", "WS_CONFIG", "WS_ENV"]

D_NOPE = gl.constexpr(512)  # value / latent columns
D_ROPE = gl.constexpr(64)  # rope columns (score only)
BLOCK_H = gl.constexpr(64)  # heads per CTA = wgmma M
D_HALF = gl.constexpr(256)  # output columns per consumer warpgroup

# BN keys per ring slot, STAGES slots, CW columns per cp.async tile; consumers at 240 registers each leave the
# producer 24 (a few bytes of producer spills in the sm90 AOT compile, harmless next to the gathers).
WS_CONFIG = dict(BN=64, STAGES=2, CW=64, CONSUMER_REGS=240, num_warps=4)
WS_ENV = "TITAN_KIMI_SPARSE_MLA_WS"  # "0" keeps the Triton-language forward on Hopper too


@gluon.jit
def _copy_rows(nope_smem, rope_smem, row_ptrs, valid, CW: gl.constexpr, blk: gl.constexpr):
    # row_ptrs [R]: first element of each 576-wide row; invalid rows are zero-filled (cp.async src-size 0), so
    # stale or uninitialised shared memory never meets a zero probability (0 * NaN).
    gl.static_assert(D_ROPE % CW == 0, "CW must divide the 64 rope columns")
    cols = gl.arange(0, CW, layout=gl.SliceLayout(0, blk))
    for c in gl.static_range(D_NOPE // CW):
        async_copy.async_copy_global_to_shared(nope_smem.slice(c * CW, CW, dim=1),
                                               row_ptrs[:, None] + (c * CW + cols)[None, :], mask=valid[:, None])
    for c in gl.static_range(D_ROPE // CW):
        async_copy.async_copy_global_to_shared(rope_smem.slice(c * CW, CW, dim=1),
                                               row_ptrs[:, None] + (D_NOPE + c * CW + cols)[None, :],
                                               mask=valid[:, None])


@gluon.jit
def _token_and_heads(EXT, N_HB):
    # one program per (token, 64-head block), head blocks of a token adjacent so they share its rows in L2
    pid = gl.program_id(0)
    t = pid // N_HB
    h0 = (pid % N_HB) * BLOCK_H
    return t.to(gl.int64), h0, gl.load(EXT + t)


@gluon.jit
def _producer(Q, KV, IDX, EXT, stride_qt, stride_qh, stride_it, H, S_KV, N_HB,
              qn_smem, qr_smem, kn_bufs, kr_bufs, q_bar, ready, empty,
              BN: gl.constexpr, STAGES: gl.constexpr, CW: gl.constexpr, KV_STRIDE: gl.constexpr,
              num_warps: gl.constexpr):
    tpr: gl.constexpr = CW // 8  # 8 x 16-bit = one 16-byte cp.async per thread
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [32 // tpr, tpr], [num_warps, 1], [1, 0])
    rows: gl.constexpr = gl.SliceLayout(1, blk)
    t, h0, n_end = _token_and_heads(EXT, N_HB)
    h = h0 + gl.arange(0, BLOCK_H, layout=rows)
    _copy_rows(qn_smem, qr_smem, Q + t * stride_qt + h.to(gl.int64) * stride_qh, h < H, CW, blk)
    async_copy.mbarrier_arrive(q_bar, increment_count=False)
    for it in range((n_end + BN - 1) // BN):
        s = it % STAGES
        # a fresh barrier reports the phase before 0 as complete: the first pass over the ring does not wait
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        offs = it * BN + gl.arange(0, BN, layout=rows)
        kid = gl.load(IDX + t * stride_it + offs, mask=offs < n_end, other=-1)
        ok = (kid >= 0) & (kid < S_KV)
        _copy_rows(kn_bufs.index(s), kr_bufs.index(s), KV + gl.where(ok, kid, 0).to(gl.int64) * KV_STRIDE, ok,
                   CW, blk)
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)


@gluon.jit
def _consumer(IDX, EXT, OUT, LSE, stride_it, stride_ot, stride_oh, stride_lt, H, S_KV, N_HB, qk_scale_log2,
              qn_smem, qr_smem, kn_bufs, kr_bufs, q_bar, ready, empty,
              BN: gl.constexpr, STAGES: gl.constexpr, V_OFF: gl.constexpr, WRITE_LSE: gl.constexpr):
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, D_HALF, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
    row_o: gl.constexpr = gl.SliceLayout(1, mma_o)
    t, h0, n_end = _token_and_heads(EXT, N_HB)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_s)
    l_i = gl.full([BLOCK_H], 0.0, gl.float32, row_s)
    acc = gl.zeros([BLOCK_H, D_HALF], gl.float32, mma_o)
    s_init = gl.zeros([BLOCK_H, BN], gl.float32, mma_s)
    mbarrier.wait(q_bar, 0)
    for it in range((n_end + BN - 1) // BN):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads through the async one
        kn = kn_bufs.index(s)
        kr = kr_bufs.index(s)
        sc = warpgroup_mma(qn_smem, kn.permute((1, 0)), s_init, use_acc=False, is_async=True)
        sc = warpgroup_mma(qr_smem, kr.permute((1, 0)), sc, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))

        offs = it * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma_s))
        kid = gl.load(IDX + t * stride_it + offs, mask=offs < n_end, other=-1)
        ok = (kid >= 0) & (kid < S_KV)
        sc = gl.where(ok[None, :], sc * qk_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet: avoid inf - inf
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(sc - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p16 = gl.convert_layout(p.to(OUT.dtype.element_ty), p_layout)
        acc = warpgroup_mma(p16, kn.slice(V_OFF, D_HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(s), count=1)  # this warpgroup is done reading slot s

    l_o = gl.convert_layout(l_i, row_o)
    o = acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
    h = h0 + gl.arange(0, BLOCK_H, layout=row_o)
    c = V_OFF + gl.arange(0, D_HALF, layout=gl.SliceLayout(0, mma_o))
    gl.store(OUT + t * stride_ot + h.to(gl.int64)[:, None] * stride_oh + c[None, :], o.to(OUT.dtype.element_ty),
             mask=(h < H)[:, None])
    if WRITE_LSE:
        hs = h0 + gl.arange(0, BLOCK_H, layout=row_s)
        l_safe = gl.where(l_i > 0.0, l_i, 1.0)
        lse = gl.where(l_i > 0.0, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        gl.store(LSE + t * stride_lt + hs, lse, mask=hs < H)


@gluon.jit
def _sparse_mla_fwd_ws_kernel(
    Q, KV, IDX, EXT, OUT, LSE,
    stride_qt, stride_qh, stride_it, stride_ot, stride_oh, stride_lt,
    H, S_KV, N_HB, qk_scale_log2,
    KV_STRIDE: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, CW: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    dtype: gl.constexpr = Q.dtype.element_ty
    swizzled: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    qn_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D_NOPE], swizzled)
    qr_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D_ROPE], swizzled)
    kn_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, D_NOPE], swizzled)
    kr_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, D_ROPE], swizzled)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=num_warps * 32)  # every producer thread arrives once its copies land
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=num_warps * 32)
        mbarrier.init(empty.index(i), count=2)  # both consumer warpgroups release a slot
    gl.warp_specialize([
        (_producer, (Q, KV, IDX, EXT, stride_qt, stride_qh, stride_it, H, S_KV, N_HB,
                     qn_smem, qr_smem, kn_bufs, kr_bufs, q_bar, ready, empty, BN, STAGES, CW, KV_STRIDE,
                     num_warps)),
        (_consumer, (IDX, EXT, OUT, LSE, stride_it, stride_ot, stride_oh, stride_lt, H, S_KV, N_HB, qk_scale_log2,
                     qn_smem, qr_smem, kn_bufs, kr_bufs, q_bar, ready, empty, BN, STAGES, 0, True)),
        (_consumer, (IDX, EXT, OUT, LSE, stride_it, stride_ot, stride_oh, stride_lt, H, S_KV, N_HB, qk_scale_log2,
                     qn_smem, qr_smem, kn_bufs, kr_bufs, q_bar, ready, empty, BN, STAGES, D_HALF, False)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def ws_forward_unsupported(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> str | None:
    """Why the Gluon kernel cannot run this call (None: it can). The caller falls back to the Triton kernel."""
    if os.environ.get(WS_ENV, "1") == "0":
        return f"{WS_ENV}=0"
    if not q.is_cuda:
        return "not on CUDA"
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return f"compute capability {torch.cuda.get_device_capability(q.device)} is not sm90 (wgmma + setmaxnreg)"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (bf16/fp16 only)"
    if q.shape[-1] != 576 or d_v != 512:
        return f"Dqk={q.shape[-1]}, d_v={d_v} (the kernel is built for K3's 576 / 512)"
    if q.stride(-1) != 1 or kv.stride(-1) != 1:
        return "last dimension not contiguous"
    return None


def sparse_mla_forward_ws(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, ext: torch.Tensor,
                          scale: float, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fills `out` and `lse`; `ext` [T] is `row_extent(idx, S_kv)` (the key loop's bound per token)."""
    T, H, _ = q.shape
    n_hb = -(-H // 64)
    _sparse_mla_fwd_ws_kernel[(T * n_hb,)](
        q, kv, idx, ext, out, lse,
        q.stride(0), q.stride(1), idx.stride(0), out.stride(0), out.stride(1), lse.stride(0),
        H, kv.shape[0], n_hb, float(scale) * 1.4426950408889634, KV_STRIDE=kv.stride(0), **WS_CONFIG)
