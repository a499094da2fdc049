"""Sparse MLA forward in the absorbed latent form (docs/ops.md, op `sparse_mla`), in Triton.

    q [T, H, Dqk], kv [S_kv, Dqk] (one latent row per key, shared by all heads; kv[:, :d_v] are the values),
    idx [T, k] int32 global rows of kv (-1, or anything outside [0, S_kv), marks an unused slot)
    -> out [T, H, d_v] (dtype of q), lse [T, H] fp32, natural log; rows without a valid key give out = 0,
       lse = -inf.

Grid: (token, head block) over a head range [H0, H). Each program gathers BLOCK_N kv rows per step (split into
the value part [BLOCK_N, d_v] and the rope tail [BLOCK_N, Dqk - d_v]), computes scores with two dots, and runs
an online softmax in base 2 (scores pre-multiplied by scale * log2 e) with fp32 accumulation.

Two layouts of the same math (constexpr KEYS_MAJOR):
* keys-major (default): S^T = KV_blk @ Q^T, so the MMA M dimension is BLOCK_N keys and the heads are N.
  Hopper wgmma needs M % 64 == 0; this keeps both GEMMs on wgmma with Q and KV in shared memory even for
  32-head blocks, so 96 heads run as 3 x 32 with no padding. The accumulator is O^T [d_v, BLOCK_H].
* heads-major: the textbook flash layout (M = heads). With 64-head blocks and 8 warps (two warpgroups
  splitting the key and value columns) it is the faster layout on sm90: 256 TFLOP/s at 64 heads against 160
  for keys-major 32-head blocks (H200, T = 8K, top-k 2048).

Heads are therefore split into two launches on the GPU (`fwd_plan`): the largest multiple of 64 heads runs
heads-major in 64-head blocks, the remainder (32 of K3.1's 96) keys-major in 32-head blocks. One launch with
a half-empty second 64-head block wastes a quarter of the MMA work (194 TFLOP/s at 96 heads); the split
reaches ~215. Each launch gathers the kv rows again, which the L2 absorbs (kv is 9 MB at T = 8K).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import autotune_enabled, config_key, dedup_configs, interpreting, launch, make_autotuner, next_pow2

__all__ = ["sparse_mla_forward", "ws_forward_reason", "fwd_configs", "fwd_plan", "default_fwd_config", "row_extent",
           "HEADS_MAJOR_64"]


# ----------------------------------------------------------------------------------------------------------
# helpers shared with sparse_mla_bwd


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs (tests) use exact fp32 products; bf16/fp16 ignore the setting.
    return "ieee" if dtype == torch.float32 or upcast_dots(dtype) else "tf32"


def upcast_dots(dtype: torch.dtype) -> bool:
    """The CPU interpreter computes tl.dot on the raw uint16 storage of bf16 tensors, so under it 16-bit
    tiles are cast to fp32 before every dot (the compiled GPU path never does this)."""
    return interpreting() and dtype != torch.float32


def check_sparse_mla_inputs(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, d_v: int) -> None:
    if q.dim() != 3:
        raise ValueError(f"sparse_mla: q must be [T, H, Dqk], got shape {tuple(q.shape)}")
    if kv.dim() != 2:
        raise ValueError(f"sparse_mla: kv must be [S_kv, Dqk], got shape {tuple(kv.shape)}")
    if idx.dim() != 2 or idx.shape[0] != q.shape[0]:
        raise ValueError(f"sparse_mla: idx must be [T={q.shape[0]}, k], got shape {tuple(idx.shape)}")
    if idx.dtype != torch.int32:
        raise ValueError(f"sparse_mla: idx must be int32, got {idx.dtype}")
    if kv.shape[1] != q.shape[2]:
        raise ValueError(f"sparse_mla: q Dqk={q.shape[2]} != kv Dqk={kv.shape[1]}")
    if not 0 < d_v <= q.shape[2]:
        raise ValueError(f"sparse_mla: d_v={d_v} must be in (0, Dqk={q.shape[2]}]")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or kv.dtype != q.dtype:
        raise ValueError(f"sparse_mla: q/kv must share a float dtype (bf16, fp16, fp32), got {q.dtype}/{kv.dtype}")
    if not (q.device == kv.device == idx.device):
        raise ValueError(f"sparse_mla: q, kv, idx on different devices: {q.device}, {kv.device}, {idx.device}")


@triton.jit
def _row_extent_kernel(IDX, EXT, stride_it, S_KV, TOPK, BLOCK: tl.constexpr):
    # EXT[t] = 1 + last slot of row t holding a valid index (0 if none). Used as the key-loop bound so
    # rows with a -1 suffix (early tokens, short documents) skip their empty key blocks.
    t = tl.program_id(0)
    best = tl.zeros([BLOCK], tl.int32)
    for n0 in range(0, TOPK, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        kid = tl.load(IDX + t.to(tl.int64) * stride_it + offs, mask=offs < TOPK, other=-1)
        ok = (kid >= 0) & (kid < S_KV)
        best = tl.maximum(best, tl.where(ok, offs + 1, 0))
    tl.store(EXT + t, tl.max(best, 0))


def row_extent(idx: torch.Tensor, s_kv: int) -> torch.Tensor:
    """[T] int32: one past the last valid slot of each idx row."""
    T, k = idx.shape
    ext = torch.empty(T, dtype=torch.int32, device=idx.device)
    if T > 0:
        launch(_row_extent_kernel, (T,), idx, ext, idx.stride(0), s_kv, k, BLOCK=min(1024, next_pow2(max(k, 16))))
    return ext


# ----------------------------------------------------------------------------------------------------------
# forward kernel


@triton.jit
def load_key_tile(KV, idx_row, n0, n_end, S_KV, stride_kvt, offs_v, v_ok, offs_r, r_ok,
                  D_V: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    """The selected keys ``idx_row[n0 : n0 + BLOCK_N]`` (up to ``n_end``): which are valid, and their latent
    [BLOCK_N, BLOCK_DV] and rope [BLOCK_N, BLOCK_DR] tiles (zeros where invalid). Shared with the backward."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kid = tl.load(idx_row + offs_n, mask=offs_n < n_end, other=-1)
    ok = (kid >= 0) & (kid < S_KV)
    kv_row = KV + kid.to(tl.int64) * stride_kvt
    kn = tl.load(kv_row[:, None] + offs_v[None, :], mask=ok[:, None] & v_ok[None, :], other=0.0)
    kr = tl.load(kv_row[:, None] + D_V + offs_r[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)
    if UPCAST:  # interpreter only: it cannot tl.dot bf16
        kn, kr = kn.to(tl.float32), kr.to(tl.float32)
    return ok, kn, kr


@triton.jit
def _sparse_mla_fwd_kernel(
    Q, KV, IDX, EXT, OUT, LSE,
    stride_qt, stride_qh, stride_kvt, stride_it, stride_ot, stride_oh, stride_lt,
    H0, H, S_KV, qk_scale_log2,
    D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, KEYS_MAJOR: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = H0 + tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_v = tl.arange(0, BLOCK_DV)
    v_ok = offs_v < D_V
    offs_r = tl.arange(0, BLOCK_DR)
    r_ok = offs_r < D_R  # all False when D_R == 0: the rope dot then adds zeros
    n_end = tl.load(EXT + t)
    q_row = Q + t * stride_qt
    idx_row = IDX + t * stride_it
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)

    if KEYS_MAJOR:
        # Q^T tiles [D, BLOCK_H]: the B operand of S^T = KV @ Q^T.
        qn = tl.load(q_row + offs_h[None, :] * stride_qh + offs_v[:, None],
                     mask=v_ok[:, None] & h_ok[None, :], other=0.0)
        qr = tl.load(q_row + offs_h[None, :] * stride_qh + D_V + offs_r[:, None],
                     mask=r_ok[:, None] & h_ok[None, :], other=0.0)
        if UPCAST:
            qn, qr = qn.to(tl.float32), qr.to(tl.float32)
        acc = tl.zeros([BLOCK_DV, BLOCK_H], tl.float32)
        for n0 in range(0, n_end, BLOCK_N):
            ok, kn, kr = load_key_tile(KV, idx_row, n0, n_end, S_KV, stride_kvt, offs_v, v_ok, offs_r, r_ok,
                                       D_V, BLOCK_N, UPCAST)
            s = tl.dot(kn, qn, input_precision=DOT_PREC)
            s = tl.dot(kr, qr, s, input_precision=DOT_PREC)  # [BLOCK_N, BLOCK_H]
            s = tl.where(ok[:, None], s * qk_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked so far: avoid inf - inf
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            acc = acc * alpha[None, :]
            acc = tl.dot(tl.trans(kn), p.to(kn.dtype), acc, input_precision=DOT_PREC)  # [D_V, BLOCK_H]
            m_i = m_new
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[None, :]
        tl.store(OUT + t * stride_ot + offs_h[None, :] * stride_oh + offs_v[:, None],
                 o.to(OUT.dtype.element_ty), mask=v_ok[:, None] & h_ok[None, :])
    else:
        qn = tl.load(q_row + offs_h[:, None] * stride_qh + offs_v[None, :],
                     mask=h_ok[:, None] & v_ok[None, :], other=0.0)
        qr = tl.load(q_row + offs_h[:, None] * stride_qh + D_V + offs_r[None, :],
                     mask=h_ok[:, None] & r_ok[None, :], other=0.0)
        if UPCAST:
            qn, qr = qn.to(tl.float32), qr.to(tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        for n0 in range(0, n_end, BLOCK_N):
            ok, kn, kr = load_key_tile(KV, idx_row, n0, n_end, S_KV, stride_kvt, offs_v, v_ok, offs_r, r_ok,
                                       D_V, BLOCK_N, UPCAST)
            s = tl.dot(qn, tl.trans(kn), input_precision=DOT_PREC)
            s = tl.dot(qr, tl.trans(kr), s, input_precision=DOT_PREC)  # [BLOCK_H, BLOCK_N]
            s = tl.where(ok[None, :], s * qk_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(kn.dtype), kn, acc, input_precision=DOT_PREC)  # [BLOCK_H, D_V]
            m_i = m_new
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(OUT + t * stride_ot + offs_h[:, None] * stride_oh + offs_v[None, :],
                 o.to(OUT.dtype.element_ty), mask=h_ok[:, None] & v_ok[None, :])

    # natural-log LSE from the base-2 running max/sum: ln(sum e^x) = ln2 * (m + log2 l)
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + t * stride_lt + offs_h, lse, mask=h_ok)


# ----------------------------------------------------------------------------------------------------------
# configs


def _cfg(bh: int, bn: int, km: bool, warps: int, stages: int) -> dict:
    return dict(BLOCK_H=bh, BLOCK_N=bn, KEYS_MAJOR=km, num_warps=warps, num_stages=stages)


def _head_block(H: int, largest: int = 32) -> int:
    # 16 <= BLOCK_H <= largest, preferring a divisor of H (96 -> 32, 16 -> 16, 64/128 -> 32).
    for bh in (largest, 32, 16):
        if bh <= largest and H % bh == 0:
            return bh
    return max(16, min(largest, next_pow2(H)))


# heads-major, 64 heads = the MMA M of one warpgroup, two warpgroups splitting N; 221 KB of shared memory
# (Q 72 KB + two 72 KB kv stages), no spills (sm90 AOT compile, triton 3.6).
HEADS_MAJOR_64 = _cfg(64, 64, False, 8, 2)


def fwd_plan(H: int, on_gpu: bool = True) -> list[tuple[int, int, dict | None]]:
    """Launches as (first head, end head, pinned config or None = autotune / `default_fwd_config` of the
    range). On the GPU, whole 64-head blocks go heads-major and the rest keys-major (module docstring)."""
    main = (H // 64) * 64 if on_gpu else 0
    plan: list[tuple[int, int, dict | None]] = [(0, main, HEADS_MAJOR_64)] if main else []
    if main < H:
        plan.append((main, H, None))
    return plan


def default_fwd_config(H: int, on_gpu: bool = True) -> dict:
    """The config used when autotuning is off. Keys-major, 4 warps = one warpgroup owning M = 64 keys;
    a [64, 576] bf16 kv tile is 72 KB, so 2 stages + Q^T (36 KB at 32 heads) fit in sm90 shared memory."""
    if not on_gpu:  # interpreter: small tiles, the loop bodies still run several times in tests
        return _cfg(16, 16, True, 4, 1)
    return _cfg(_head_block(H), 64, True, 4, 2)


def fwd_configs(H: int) -> list[dict]:
    """Small autotune list (each config is a full compile). From an sm90 AOT compile at 96 heads:
    32/64/keys-major/4 warps/2 stages: 188 KB shared memory, 255 registers, ~0.1 KB spills (the O^T
    accumulator [512, 32] fp32 is 128 registers/thread); 8 warps: 196 registers, no spills, but the
    [64, 32] score GEMM is replicated on both warpgroups (Triton puts chained-dot warps along M)."""
    bh = _head_block(H)
    cfgs = [
        _cfg(bh, 64, True, 4, 2),
        _cfg(bh, 64, True, 4, 3),
        _cfg(bh, 64, True, 8, 2),
        _cfg(16, 64, True, 4, 2),
        _cfg(bh, 32, False, 4, 2),  # heads-major fallback (mma.sync at 32 heads)
    ]
    if H >= 64:
        cfgs.append(HEADS_MAJOR_64)
    return dedup_configs(cfgs)


@functools.lru_cache(maxsize=None)
def _autotuned_fwd(cfg_key: tuple):
    return make_autotuner(_sparse_mla_fwd_kernel, cfg_key, ["H0", "H", "D_V", "D_R"])


# ----------------------------------------------------------------------------------------------------------
# entry point


def ws_forward_reason(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> str | None:
    """Why the Gluon forward does not serve this call (None: it does)."""
    if interpreting() or not q.is_cuda:
        return "not on a CUDA device"
    try:
        from .sparse_mla_fwd_ws import ws_forward_unsupported
    except ImportError as exc:  # a Triton without Gluon
        return f"triton.experimental.gluon unavailable ({exc})"
    return ws_forward_unsupported(q, kv, d_v)


def sparse_mla_forward(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    scale: float,
    d_v: int = 512,
    *,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA forward. Returns (out [T, H, d_v] in q's dtype, lse [T, H] fp32, natural log).

    Without `config`, on Hopper at K3 sizes (Dqk 576, d_v 512, bf16/fp16) the warp-specialized Gluon kernel
    runs (sparse_mla_fwd_ws; `ws_forward_reason` says why not elsewhere); otherwise the heads run as `fwd_plan`
    says. `config` (keys BLOCK_H, BLOCK_N, KEYS_MAJOR, num_warps, num_stages) pins one config for all heads in
    one launch of the Triton kernel and bypasses the autotuner; kernels.triton_autotune = false bypasses it too
    (the plan's pinned configs, else `default_fwd_config`)."""
    check_sparse_mla_inputs(q, kv, idx, d_v)
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    idx = idx if idx.stride(-1) == 1 else idx.contiguous()
    T, H, D = q.shape
    S_kv, k = kv.shape[0], idx.shape[1]
    d_r = D - d_v
    out = torch.empty(T, H, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0 or H == 0:
        return out, lse
    ext = row_extent(idx, S_kv) if k > 0 else torch.zeros(T, dtype=torch.int32, device=q.device)
    if config is None and ws_forward_reason(q, kv, d_v) is None:
        from .sparse_mla_fwd_ws import sparse_mla_forward_ws

        sparse_mla_forward_ws(q, kv, idx, ext, scale, out, lse)
        return out, lse
    meta = dict(D_V=d_v, D_R=d_r, BLOCK_DV=next_pow2(max(d_v, 16)), BLOCK_DR=next_pow2(max(d_r, 16)),
                DOT_PREC=dot_precision(q.dtype), UPCAST=upcast_dots(q.dtype))
    on_gpu = q.is_cuda and not interpreting()
    plan = [(0, H, config)] if config is not None else fwd_plan(H, on_gpu)
    for h0, h1, cfg in plan:
        args = (q, kv, idx, ext, out, lse,
                q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), out.stride(0), out.stride(1), lse.stride(0),
                h0, h1, S_kv, float(scale) * 1.4426950408889634)
        if cfg is None and autotune_enabled(q):
            kernel = _autotuned_fwd(config_key(fwd_configs(h1 - h0)))
            launch(kernel, lambda m, n=h1 - h0: (T, triton.cdiv(n, m["BLOCK_H"])), *args, **meta)
        else:
            c = dict(cfg or default_fwd_config(h1 - h0, on_gpu=on_gpu))
            launch(_sparse_mla_fwd_kernel, (T, triton.cdiv(h1 - h0, c["BLOCK_H"])), *args, **meta, **c)
    return out, lse
