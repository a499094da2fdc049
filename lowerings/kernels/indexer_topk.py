"""DSA lightning-indexer scores + top-k over row chunks (docs/ops.md, op `indexer_topk`), in Triton.

    q [T, HI, D], k [T, D], w [T, HI] (fp32 or bf16, already scaled), seg_start [T] int32, topk, scale
    -> idx [T, min(topk, T)] int32

    I(t, s) = sum_h w[t, h] * relu(scale * q[t, h] . k[s])   (fp32), valid for seg_start[t] <= s <= t.

The full [T, T] score matrix is never allocated: queries are processed in chunks of R rows, with R chosen
so that one [R, width] buffer stays under `mem_cap_bytes` (width = last row of the chunk + 1, i.e. only the
causally reachable keys). A Triton kernel fills the buffer, skipping the math for tiles entirely outside
every row's [seg_start, t] window, then torch.topk picks each row's keys; they are sorted ascending with -1
in the unused tail slots.

Ties go to the most recent key (docs/ops.md; ReLU scores tie at exactly 0 often). torch.topk does not order
ties, so the buffer holds int64 sort keys instead of floats: (order-preserving int32 image of the fp32 score)
<< 32 | key index, with INT64_MIN for masked keys. The largest keys are then exactly the highest scores,
most recent first among equal scores, and the index is read back from the low 32 bits. (-0.0 is folded into
+0.0 first so signed zeros tie.) indexer_scores can also write plain fp32 scores, for tests and debugging.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import autotune_enabled, interpreting, launch, next_pow2

__all__ = ["indexer_topk", "indexer_scores", "default_scores_config", "scores_configs"]


@triton.jit
def _indexer_scores_kernel(
    Q, K, W, SEG, OUT,
    stride_qt, stride_qh, stride_kt, stride_wt, stride_wh, stride_or,
    row0, n_rows, width, HI, D, scale,
    BLOCK_M: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, SORT_KEYS: tl.constexpr,
):
    # One program: BLOCK_M query rows x BLOCK_N keys. The BLOCK_M * BLOCK_HI (query, head) pairs form the
    # MMA M dimension (64 heads x 2 rows = 128), so the head reduction is a reshape + sum after the dot.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < n_rows
    t = row0 + offs_m
    seg = tl.load(SEG + t, mask=m_ok, other=0)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    t_hi = tl.max(tl.where(m_ok, t, -1), 0)
    seg_lo = tl.min(tl.where(m_ok, seg, 2147483647), 0)
    score = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
    if (n0 <= t_hi) & (n0 + BLOCK_N > seg_lo):
        offs_mh = tl.arange(0, BLOCK_M * BLOCK_HI)
        row = offs_mh // BLOCK_HI
        head = offs_mh % BLOCK_HI
        t_mh = (row0 + tl.program_id(0) * BLOCK_M + row).to(tl.int64)
        mh_ok = ((tl.program_id(0) * BLOCK_M + row) < n_rows) & (head < HI)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        qt = tl.load(Q + t_mh[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                     mask=mh_ok[:, None] & d_ok[None, :], other=0.0)
        kt = tl.load(K + offs_n.to(tl.int64)[:, None] * stride_kt + offs_d[None, :],
                     mask=(offs_n < width)[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter cannot tl.dot bf16 (it multiplies the raw uint16 storage)
            qt, kt = qt.to(tl.float32), kt.to(tl.float32)
        w = tl.load(W + t_mh * stride_wt + head * stride_wh, mask=mh_ok, other=0.0).to(tl.float32)
        s = tl.dot(qt, tl.trans(kt), input_precision=DOT_PREC)  # [BLOCK_M * BLOCK_HI, BLOCK_N] fp32
        s = tl.maximum(s * scale, 0.0) * w[:, None]
        sc = tl.sum(tl.reshape(s, [BLOCK_M, BLOCK_HI, BLOCK_N]), 1)
        valid = (offs_n[None, :] >= seg[:, None]) & (offs_n[None, :] <= t[:, None])
        score = tl.where(valid, sc, float("-inf"))
    out_ptr = OUT + offs_m.to(tl.int64)[:, None] * stride_or + offs_n[None, :]
    out_mask = m_ok[:, None] & (offs_n < width)[None, :]
    if SORT_KEYS:
        score = tl.where(score == 0.0, 0.0, score)  # -0.0 -> +0.0
        bits = score.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # negative floats: reverse magnitude order
        key = (ordered.to(tl.int64) << 32) | offs_n.to(tl.int64)[None, :]
        key = tl.where(score == float("-inf"), -9223372036854775807 - 1, key)  # masked: INT64_MIN
        tl.store(out_ptr, key, mask=out_mask)
    else:
        tl.store(out_ptr, score, mask=out_mask)


def default_scores_config(HI: int, on_gpu: bool = True) -> dict:
    """2 query rows x 64 heads = 128 MMA rows, 128 keys, K = 128: one wgmma tile per warpgroup pair."""
    bhi = next_pow2(max(HI, 1))
    bm = max(1, (128 if on_gpu else 16) // bhi)
    return dict(BLOCK_M=bm, BLOCK_N=128 if on_gpu else 16, num_warps=8 if on_gpu else 4,
                num_stages=2 if on_gpu else 1)


def scores_configs(HI: int) -> list[dict]:
    bhi = next_pow2(max(HI, 1))
    bm = max(1, 128 // bhi)
    return [
        dict(BLOCK_M=bm, BLOCK_N=128, num_warps=8, num_stages=2),
        dict(BLOCK_M=bm, BLOCK_N=64, num_warps=4, num_stages=3),
        dict(BLOCK_M=bm, BLOCK_N=128, num_warps=4, num_stages=2),
        dict(BLOCK_M=max(1, 64 // bhi), BLOCK_N=128, num_warps=4, num_stages=3),
    ]


@functools.lru_cache(maxsize=None)
def _autotuned_scores(cfg_key: tuple):
    configs = [
        triton.Config({k: v for k, v in c if not k.startswith("num_")},
                      num_warps=dict(c)["num_warps"], num_stages=dict(c)["num_stages"])
        for c in cfg_key
    ]
    return triton.autotune(configs=configs, key=["HI", "D"])(_indexer_scores_kernel)


def _check(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, seg_start: torch.Tensor, topk: int) -> None:
    if q.dim() != 3:
        raise ValueError(f"indexer_topk: q must be [T, HI, D], got shape {tuple(q.shape)}")
    T, HI, D = q.shape
    if k.shape != (T, D):
        raise ValueError(f"indexer_topk: k must be [T={T}, D={D}], got shape {tuple(k.shape)}")
    if w.shape != (T, HI):
        raise ValueError(f"indexer_topk: w must be [T={T}, HI={HI}], got shape {tuple(w.shape)}")
    if seg_start.shape != (T,) or seg_start.dtype != torch.int32:
        raise ValueError(f"indexer_topk: seg_start must be int32 [T={T}], got {seg_start.dtype} {tuple(seg_start.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or k.dtype != q.dtype:
        raise ValueError(f"indexer_topk: q/k must share a float dtype, got {q.dtype}/{k.dtype}")
    if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"indexer_topk: w must be fp32 or bf16, got {w.dtype}")
    if topk <= 0:
        raise ValueError(f"indexer_topk: topk must be positive, got {topk}")


def indexer_scores(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, seg_start: torch.Tensor, scale: float,
    row0: int, n_rows: int, out: torch.Tensor, *, config: dict | None = None,
) -> torch.Tensor:
    """Fill out[:n_rows, :width] (width = row0 + n_rows) for rows row0 .. row0 + n_rows - 1: fp32 `out` gets
    the masked scores (-inf outside the window), int64 `out` the tie-breaking sort keys (INT64_MIN outside).
    `out` may be a strided view (unit stride along keys)."""
    T, HI, D = q.shape
    width = row0 + n_rows
    if (out.dim() != 2 or out.shape[0] < n_rows or out.shape[1] < width or out.stride(1) != 1
            or out.dtype not in (torch.float32, torch.int64)):
        raise ValueError(f"indexer_scores: out must be fp32 or int64 [>= {n_rows}, >= {width}] with unit key "
                         f"stride, got {out.dtype} {tuple(out.shape)}")
    args = (q, k, w, seg_start, out,
            q.stride(0), q.stride(1), k.stride(0), w.stride(0), w.stride(1), out.stride(0),
            row0, n_rows, width, HI, D, float(scale))
    meta = dict(BLOCK_HI=next_pow2(max(HI, 1)), BLOCK_D=next_pow2(max(D, 16)),
                DOT_PREC="ieee" if q.dtype == torch.float32 or interpreting() else "tf32",
                UPCAST=interpreting() and q.dtype != torch.float32, SORT_KEYS=out.dtype == torch.int64)
    use_tune = config is None and autotune_enabled(q)
    if use_tune:
        kernel = _autotuned_scores(tuple(tuple(sorted(c.items())) for c in scores_configs(HI)))
        launch(kernel, lambda m: (triton.cdiv(n_rows, m["BLOCK_M"]), triton.cdiv(width, m["BLOCK_N"])),
                *args, **meta)
    else:
        c = dict(config or default_scores_config(HI, on_gpu=q.is_cuda and not interpreting()))
        launch(_indexer_scores_kernel, (triton.cdiv(n_rows, c["BLOCK_M"]), triton.cdiv(width, c["BLOCK_N"])),
                *args, **meta, **c)
    return out


def indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    seg_start: torch.Tensor,
    topk: int,
    scale: float,
    *,
    mem_cap_bytes: int = 1 << 30,
    config: dict | None = None,
) -> torch.Tensor:
    """Indexer top-k: idx [T, min(topk, T)] int32, each row's chosen keys ascending, -1 in unused slots.

    Rows with <= topk valid keys return all of them; among equal scores the most recent key wins.
    `mem_cap_bytes` bounds the int64 key buffer of one row chunk (torch.topk needs workspace on top)."""
    _check(q, k, w, seg_start, topk)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    seg_start = seg_start.contiguous()
    T = q.shape[0]
    kk = min(topk, T)
    idx = torch.full((T, kk), -1, dtype=torch.int32, device=q.device)
    if T == 0:
        return idx
    rows = max(1, min(T, int(mem_cap_bytes) // (8 * T)))
    buf = torch.empty(rows, T, dtype=torch.int64, device=q.device)
    masked = torch.iinfo(torch.int64).min
    for r0 in range(0, T, rows):
        n = min(rows, T - r0)
        width = r0 + n
        keys = indexer_scores(q, k, w, seg_start, scale, r0, n, buf[:n, :width], config=config)
        kc = min(kk, width)
        top = torch.topk(keys, kc, dim=1, sorted=False).values
        # masked picks (row has fewer than kc valid keys) go past every real index, then become -1
        sel = torch.where(top == masked, width, top & 0xFFFFFFFF).sort(dim=1).values
        idx[r0:width, :kc] = torch.where(sel == width, -1, sel).to(torch.int32)
    return idx
