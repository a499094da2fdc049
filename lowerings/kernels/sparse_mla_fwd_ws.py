"""Sparse MLA forward for Hopper (sm90) as a warp-specialized Gluon kernel (same contract as
`sparse_mla_fwd.sparse_mla_forward`: q [T, H, 576], kv [S_kv, 576], idx [T, k] int32 -> out [T, H, 512],
lse [T, H] fp32 natural log; -1 / out-of-range slots unused; rows without a valid key give 0 and -inf).

Why a second kernel: the Triton-language kernel cannot overlap the kv gather, the softmax and the MMAs (Triton
3.6's automatic warp specialization does not handle gathered loads) and tops out near 260 TFLOP/s at 64 heads.
Here one CTA = one token x 64 heads, in three partitions that talk through mbarriers:

* producer (default partition, 4 warps, the registers the consumers leave): cp.async gathers the token's kv
  rows, 64 per key block, straight into 128B-swizzled shared memory (a 512-column "nope" tile and a 64-column
  rope tile per slot, two slots). Each slot is filled and freed in two parts (below) so that a part can be
  refilled as soon as its last reader is done; each thread's copies arrive on the part's `ready` barrier when
  they land (noinc arrive).
* two consumer warpgroups (4 warps, CONSUMER_REGS registers each). Warpgroup W accumulates O[:, 256W:256W+256]
  and owns the key blocks 2i + W (slot W): it computes their scores S = Q K^T once (wgmma, both operands in shared
  memory), runs the softmax, applies its P from registers, and publishes P (bf16) in the slot's rope tile, which
  is free once the score MMAs are done, with the row reference r and row sums. Then it applies the other
  warpgroup's P of block 2i + 1 - W straight from shared memory. The score GEMM runs once per block; the earlier
  version had both warpgroups compute every score tile and was 20-30% slower (docs/perf.md).

The two parts of slot s: A = value half s (read by warpgroup s's own PV only, freed right after it) and B = the
other value half + rope (read by the other warpgroup's PV of this block). The producer fills A0, A1, B0, B1, so
the next block's first score MMA (on part A) usually finds its rows already there.

Different references: each warpgroup keeps its own running max m. P of the other block comes relative to that
block's r and cannot be rescaled on its way into wgmma, so O is held as acc * pend: acc is divided by the
block's factor f = 2^(r - m) <= 1 instead (f clamped at 2^-64, below which a block adds nothing visible; acc then
stays far from fp32 overflow), and pend = f is folded into the next rescale.

96 heads run as two 64-head blocks, the second half empty (rows of absent heads load as zeros and are not
stored). Shared memory: Q 72 KB + 2 x 72 KB kv slots + 1 KB row statistics = 217 KB of the sm90 227 KB. The kv
row stride is a constexpr (576 for a contiguous kv): runtime-stride row addresses cost the producer ~10%.

H200, T = 8K, top-k 2048 (docs/perf.md): 427-446 TFLOP/s at 64 heads, 334-349 at 96; the Triton-language
kernel: 261 / 215.
"""

from __future__ import annotations

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

from lowerings.settings import kernel_settings

__all__ = ["ws_forward_unsupported", "sparse_mla_forward_ws", "WS_CONFIG", "WS_SETTING"]

D_NOPE = gl.constexpr(512)  # value / latent columns
D_ROPE = gl.constexpr(64)  # rope columns (score only)
BLOCK_H = gl.constexpr(64)  # heads per CTA = wgmma M
D_HALF = gl.constexpr(256)  # output columns per consumer warpgroup

# BN keys per block, CW columns per cp.async tile; consumers at 232 registers each leave the producer 40 (232 vs
# 240: 334-349 vs 335-338 TFLOP/s at 96 heads on the H200).
WS_CONFIG = dict(BN=64, CW=64, CONSUMER_REGS=232, num_warps=4)
WS_SETTING = "kernels.sparse_mla_ws"  # false keeps the Triton-language forward on Hopper too (lowerings/settings.py)


@gluon.jit
def _copy_cols(dst, row_ptrs, valid, COL0: gl.constexpr, NCOL: gl.constexpr, CW: gl.constexpr, blk: gl.constexpr):
    # columns [COL0, COL0 + NCOL) of each row into dst [R, NCOL]; invalid rows are zero-filled (cp.async src-size 0)
    cols = gl.arange(0, CW, layout=gl.SliceLayout(0, blk))
    for c in gl.static_range(NCOL // CW):
        async_copy.async_copy_global_to_shared(dst.slice(c * CW, CW, dim=1),
                                               row_ptrs[:, None] + (COL0 + c * CW + cols)[None, :], mask=valid[:, None])


@gluon.jit
def _token_and_heads(EXT, N_HB):
    # one program per (token, 64-head block), head blocks of a token adjacent so they share its rows in L2
    pid = gl.program_id(0)
    t = pid // N_HB
    h0 = (pid % N_HB) * BLOCK_H
    return t.to(gl.int64), h0, gl.load(EXT + t)


@gluon.jit
def _kv_rows(KV, IDX, t, stride_it, j, n_end, S_KV, BN: gl.constexpr, KV_STRIDE: gl.constexpr, rows: gl.constexpr):
    offs = j * BN + gl.arange(0, BN, layout=rows)
    kid = gl.load(IDX + t * stride_it + offs, mask=offs < n_end, other=-1)
    ok = (kid >= 0) & (kid < S_KV)
    return KV + gl.where(ok, kid, 0).to(gl.int64) * KV_STRIDE, ok


@gluon.jit
def _producer(Q, KV, IDX, EXT, stride_qt, stride_qh, stride_it, H, S_KV, N_HB,
              qn_smem, qr_smem, kn_bufs, kr_bufs, q_bar, ready_a, ready_b, empty_a, empty_b,
              BN: gl.constexpr, CW: gl.constexpr, KV_STRIDE: gl.constexpr, num_warps: gl.constexpr):
    tpr: gl.constexpr = CW // 8  # 8 x 16-bit = one 16-byte cp.async per thread
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [32 // tpr, tpr], [num_warps, 1], [1, 0])
    rows: gl.constexpr = gl.SliceLayout(1, blk)
    t, h0, n_end = _token_and_heads(EXT, N_HB)
    h = h0 + gl.arange(0, BLOCK_H, layout=rows)
    q_rows = Q + t * stride_qt + h.to(gl.int64) * stride_qh
    _copy_cols(qn_smem, q_rows, h < H, 0, D_NOPE, CW, blk)
    _copy_cols(qr_smem, q_rows, h < H, D_NOPE, D_ROPE, CW, blk)
    async_copy.mbarrier_arrive(q_bar, increment_count=False)
    # slot s holds the key blocks j with j mod 2 = s, in two parts freed separately: part A (value half s, freed
    # by warpgroup s after its own PV) and part B (the other value half + rope, freed by the other warpgroup after
    # it used that half and the P stored in the rope tile). Parts are filled A0, A1, B0, B1: the A parts free first.
    for i in range((n_end + 2 * BN - 1) // (2 * BN)):
        ph = (i & 1) ^ 1  # a fresh barrier reports the phase before 0 as complete: the first pass does not wait
        r0, ok0 = _kv_rows(KV, IDX, t, stride_it, 2 * i, n_end, S_KV, BN, KV_STRIDE, rows)
        mbarrier.wait(empty_a.index(0), ph)
        _copy_cols(kn_bufs.index(0).slice(0, D_HALF, dim=1), r0, ok0, 0, D_HALF, CW, blk)
        async_copy.mbarrier_arrive(ready_a.index(0), increment_count=False)
        r1, ok1 = _kv_rows(KV, IDX, t, stride_it, 2 * i + 1, n_end, S_KV, BN, KV_STRIDE, rows)
        mbarrier.wait(empty_a.index(1), ph)
        _copy_cols(kn_bufs.index(1).slice(D_HALF, D_HALF, dim=1), r1, ok1, D_HALF, D_HALF, CW, blk)
        async_copy.mbarrier_arrive(ready_a.index(1), increment_count=False)
        mbarrier.wait(empty_b.index(0), ph)
        _copy_cols(kn_bufs.index(0).slice(D_HALF, D_HALF, dim=1), r0, ok0, D_HALF, D_HALF, CW, blk)
        _copy_cols(kr_bufs.index(0), r0, ok0, D_NOPE, D_ROPE, CW, blk)
        async_copy.mbarrier_arrive(ready_b.index(0), increment_count=False)
        mbarrier.wait(empty_b.index(1), ph)
        _copy_cols(kn_bufs.index(1).slice(0, D_HALF, dim=1), r1, ok1, 0, D_HALF, CW, blk)
        _copy_cols(kr_bufs.index(1), r1, ok1, D_NOPE, D_ROPE, CW, blk)
        async_copy.mbarrier_arrive(ready_b.index(1), increment_count=False)


@gluon.jit
def _consumer(IDX, EXT, OUT, LSE, stride_it, stride_ot, stride_oh, stride_lt, H, S_KV, N_HB, qk_scale_log2,
              qn_smem, qr_smem, kn_bufs, kr_bufs, q_bar, ready_a, ready_b, empty_a, empty_b, p_ready, r_buf, l_buf,
              BN: gl.constexpr, W: gl.constexpr):
    # Warpgroup W owns O[:, 256W:256W+256] and the key blocks j = 2i + W (slot W): it computes their scores once,
    # publishes P (bf16, relative to its row reference r) in the slot's rope tile with r and the row sums, and
    # applies the other warpgroup's P of block 2i + 1 - W straight from shared memory. That P cannot be rescaled
    # on its way into wgmma, so O is kept as acc * pend: acc is divided by the other block's factor
    # f = 2^(r_j - m) <= 1 instead (clamped at 2^-64, below which a block adds nothing visible).
    A_OFF: gl.constexpr = W * D_HALF  # this warpgroup's value half (part A of its own slot)
    B_OFF: gl.constexpr = (1 - W) * D_HALF
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, D_HALF, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
    row_o: gl.constexpr = gl.SliceLayout(1, mma_o)
    dtype: gl.constexpr = OUT.dtype.element_ty
    t, h0, n_end = _token_and_heads(EXT, N_HB)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_o)
    l_i = gl.full([BLOCK_H], 0.0, gl.float32, row_o)
    pend = gl.full([BLOCK_H], 1.0, gl.float32, row_o)
    acc = gl.zeros([BLOCK_H, D_HALF], gl.float32, mma_o)
    s_init = gl.zeros([BLOCK_H, BN], gl.float32, mma_s)
    kn = kn_bufs.index(W)
    kr = kr_bufs.index(W)
    kn_peer = kn_bufs.index(1 - W)
    mbarrier.wait(q_bar, 0)
    for i in range((n_end + 2 * BN - 1) // (2 * BN)):
        ph = i & 1
        mbarrier.wait(ready_a.index(W), ph)
        fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads through the async one
        sc = warpgroup_mma(qn_smem.slice(A_OFF, D_HALF, dim=1), kn.slice(A_OFF, D_HALF, dim=1).permute((1, 0)),
                           s_init, use_acc=False, is_async=True)
        mbarrier.wait(ready_b.index(W), ph)
        fence_async_shared()
        sc = warpgroup_mma(qn_smem.slice(B_OFF, D_HALF, dim=1), kn.slice(B_OFF, D_HALF, dim=1).permute((1, 0)),
                           sc, is_async=True)
        sc = warpgroup_mma(qr_smem, kr.permute((1, 0)), sc, is_async=True)
        offs = (2 * i + W) * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma_s))
        kid = gl.load(IDX + t * stride_it + offs, mask=offs < n_end, other=-1)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))

        ok = (kid >= 0) & (kid < S_KV)
        sc = gl.where(ok[None, :], sc * qk_scale_log2, float("-inf"))
        r = gl.maximum(gl.convert_layout(m_i, row_s), gl.max(sc, axis=1))
        p = gl.exp2(sc - gl.where(r == float("-inf"), 0.0, r)[:, None])  # nothing valid yet: avoid inf - inf
        rs = gl.sum(p, axis=1)
        p16 = p.to(dtype)
        kr.store(p16)  # the rope tile is free once the score MMAs are done
        r_buf.index(W).store(r)
        l_buf.index(W).store(rs)
        fence_async_shared()
        mbarrier.arrive(p_ready.index(W), count=1)

        r_o = gl.convert_layout(r, row_o)
        alpha = gl.exp2(m_i - gl.where(r_o == float("-inf"), 0.0, r_o))
        acc = acc * (pend * alpha)[:, None]
        pend = gl.full([BLOCK_H], 1.0, gl.float32, row_o)
        l_i = l_i * alpha + gl.convert_layout(rs, row_o)
        m_i = r_o
        acc = warpgroup_mma(gl.convert_layout(p16, p_layout), kn.slice(A_OFF, D_HALF, dim=1), acc, is_async=True)

        mbarrier.wait(p_ready.index(1 - W), ph)  # the other warpgroup's block, while this PV runs
        r_j = r_buf.index(1 - W).load(row_o)
        rs_j = l_buf.index(1 - W).load(row_o)
        m_new = gl.maximum(m_i, r_j)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        f = gl.exp2(r_j - m_use)
        f_c = gl.maximum(f, 5.421010862427522e-20)  # 2^-64
        l_i = l_i * alpha + f * rs_j
        m_i = m_new
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty_a.index(W), count=1)
        acc = acc * (pend * alpha / f_c)[:, None]
        pend = f_c
        mbarrier.wait(ready_b.index(1 - W), ph)
        fence_async_shared()
        acc = warpgroup_mma(kr_bufs.index(1 - W), kn_peer.slice(A_OFF, D_HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty_b.index(1 - W), count=1)

    o = acc * pend[:, None] / gl.where(l_i > 0.0, l_i, 1.0)[:, None]
    h = h0 + gl.arange(0, BLOCK_H, layout=row_o)
    c = A_OFF + gl.arange(0, D_HALF, layout=gl.SliceLayout(0, mma_o))
    gl.store(OUT + t * stride_ot + h.to(gl.int64)[:, None] * stride_oh + c[None, :], o.to(dtype),
             mask=(h < H)[:, None])
    if W == 0:
        l_safe = gl.where(l_i > 0.0, l_i, 1.0)
        lse = gl.where(l_i > 0.0, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        gl.store(LSE + t * stride_lt + h, lse, mask=h < H)


@gluon.jit
def _sparse_mla_fwd_ws_kernel(
    Q, KV, IDX, EXT, OUT, LSE,
    stride_qt, stride_qh, stride_it, stride_ot, stride_oh, stride_lt,
    H, S_KV, N_HB, qk_scale_log2,
    KV_STRIDE: gl.constexpr, BN: gl.constexpr, CW: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    dtype: gl.constexpr = Q.dtype.element_ty
    swizzled: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    qn_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D_NOPE], swizzled)
    qr_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D_ROPE], swizzled)
    kn_bufs = gl.allocate_shared_memory(dtype, [2, BN, D_NOPE], swizzled)
    kr_bufs = gl.allocate_shared_memory(dtype, [2, BN, D_ROPE], swizzled)
    stat_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    r_buf = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], stat_layout)
    l_buf = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], stat_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready_a = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready_b = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty_a = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty_b = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=num_warps * 32)  # every producer thread arrives once its copies land
    for s in gl.static_range(2):
        mbarrier.init(ready_a.index(s), count=num_warps * 32)
        mbarrier.init(ready_b.index(s), count=num_warps * 32)
        mbarrier.init(empty_a.index(s), count=1)  # freed by the slot's own warpgroup
        mbarrier.init(empty_b.index(s), count=1)  # freed by the other warpgroup
        mbarrier.init(p_ready.index(s), count=1)
    gl.warp_specialize([
        (_producer, (Q, KV, IDX, EXT, stride_qt, stride_qh, stride_it, H, S_KV, N_HB,
                     qn_smem, qr_smem, kn_bufs, kr_bufs, q_bar, ready_a, ready_b, empty_a, empty_b,
                     BN, CW, KV_STRIDE, num_warps)),
        (_consumer, (IDX, EXT, OUT, LSE, stride_it, stride_ot, stride_oh, stride_lt, H, S_KV, N_HB, qk_scale_log2,
                     qn_smem, qr_smem, kn_bufs, kr_bufs, q_bar, ready_a, ready_b, empty_a, empty_b, p_ready,
                     r_buf, l_buf, BN, 0)),
        (_consumer, (IDX, EXT, OUT, LSE, stride_it, stride_ot, stride_oh, stride_lt, H, S_KV, N_HB, qk_scale_log2,
                     qn_smem, qr_smem, kn_bufs, kr_bufs, q_bar, ready_a, ready_b, empty_a, empty_b, p_ready,
                     r_buf, l_buf, BN, 1)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def ws_forward_unsupported(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> str | None:
    """Why the Gluon kernel cannot run this call (None: it can). The caller falls back to the Triton kernel."""
    if not kernel_settings().sparse_mla_ws:
        return f"{WS_SETTING} = false"
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
    # 16-byte cp.async per thread: every gathered row must start on a 16-byte boundary
    strides = (q.stride(0), q.stride(1), kv.stride(0))
    if any(st % 8 for st in strides) or q.data_ptr() % 16 or kv.data_ptr() % 16:
        offsets = (q.data_ptr() % 16, kv.data_ptr() % 16)
        return f"rows not 16-byte aligned (strides {strides} elements, q/kv addresses {offsets} mod 16)"
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
