"""DSA lightning-indexer scores + top-k over row chunks (docs/ops.md, op `indexer_topk`), in Triton.

    q [T, HI, D], k [Tk, D], w [T, HI] (fp32 or bf16, already scaled), seg_start [T] int32, topk, scale,
    q_offset -> idx [T, min(topk, Tk)] int32

    I(t, s) = sum_h w[t, h] * relu(scale * q[t, h] . k[s])   (fp32), valid for seg_start[t] <= s <= p(t),

where p(t) = q_offset + t is query t's position among the keys (q_offset = 0 and Tk = T: every token queries
its own sequence; a context-parallel rank passes a run of its queries and the whole sequence's keys).

The full [T, T] score matrix is never allocated: queries are processed in chunks of R rows, with R chosen
so that one [R, width] buffer stays under `mem_cap_bytes` (width = last row of the chunk + 1, i.e. only the
causally reachable keys). A Triton kernel fills the buffer, then torch.topk picks each row's keys; they are
sorted ascending with -1 in the unused tail slots.

The score kernel is keys-major: a program keeps a tile of BLOCK_N keys in shared memory and walks its
BLOCK_T query rows TOKS at a time (the per-step Q loads are async copies, pipelined by num_stages), so the
MMA is S^T = K_tile @ Q_step^T with the keys on M and the TOKS x HI (row, head) pairs on N; the sum over heads
then stays inside a thread quad of the wgmma accumulator. Rows that see none of the block's keys (before it
causally, or whose document starts after it) only get the masked value stored, without any math.

Ties go to the most recent key (docs/ops.md; ReLU scores tie at exactly 0 often), and torch.topk does not
order ties. Two ways to keep the rule (`select=`):
* "threshold" (default): the buffer holds fp32 scores; torch.topk only supplies each row's k-th value, and
  lowerings/kernels/topk_select.py keeps every key above it plus the most recent keys equal to it, writing
  them ascending (no sort). Half the bytes of the int64 keys, and fp32 radix passes.
* "sort_keys": the buffer holds int64 sort keys, (order-preserving int32 image of the fp32 score) << 32 |
  key index, INT64_MIN for masked keys, so the largest keys are the highest scores, most recent first; the
  index is read back from the low 32 bits and sorted. (-0.0 is folded into +0.0 so signed zeros tie.)
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import autotune_enabled, config_key, interpreting, launch, make_autotuner, next_pow2
from .topk_select import select_topk_by_threshold

__all__ = ["indexer_topk", "indexer_scores", "default_scores_config", "scores_configs"]


@triton.jit
def _indexer_scores_kernel(
    Q, K, W, SEG, OUT,
    stride_qt, stride_qh, stride_kt, stride_wt, stride_wh, stride_or,
    row0, n_rows, width, HI, D, scale, q_off,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, TOKS: tl.constexpr, BLOCK_HI: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, FILL_ROWS: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, SORT_KEYS: tl.constexpr,
):
    # Keys-major. One program: keys [n0, n0 + BLOCK_N) x query rows [t0, t1). The key tile stays resident;
    # a loop walks the rows TOKS at a time: S^T = K_tile @ Q^T is [BLOCK_N keys (MMA M), TOKS * BLOCK_HI
    # (token, head) pairs (MMA N)], and the head reduction runs along N, i.e. inside a thread and its quad of
    # the MMA accumulator layout (no shared-memory round trip). `scale` is >= 0 (the host folds its sign into
    # k), so relu(scale * x) * w = relu(x) * (scale * w). Rows are positions among the keys; the query at
    # position t is row t - q_off of Q, W and SEG (q_off > 0 when the queries are a slice of the sequence).
    n0 = tl.program_id(0) * BLOCK_N
    t0 = row0 + tl.program_id(1) * BLOCK_T
    t1 = tl.minimum(t0 + BLOCK_T, row0 + n_rows)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < width
    # Rows [ta, tb) are computed. Rows before n0 see none of these keys (causal); tb is one past the last row
    # whose window starts before the end of the key block. Rows of [ta, tb) are still masked elementwise, so
    # only the skipping (not correctness) relies on seg_start being nondecreasing, as packed documents are.
    ta = tl.minimum(tl.maximum(t0, n0), t1)
    offs_tb = t0 + tl.arange(0, BLOCK_T)
    seg_b = tl.load(SEG + (offs_tb - q_off), mask=offs_tb < t1, other=2147483647)
    tb = tl.max(tl.where((offs_tb >= ta) & (seg_b < n0 + BLOCK_N), offs_tb + 1, ta), 0)

    # rows [t0, ta) and [tb, t1): every key of the block is masked
    offs_f = tl.arange(0, FILL_ROWS)
    if SORT_KEYS:
        fill = tl.full([FILL_ROWS, BLOCK_N], -9223372036854775807 - 1, tl.int64)  # INT64_MIN
    else:
        fill = tl.full([FILL_ROWS, BLOCK_N], float("-inf"), tl.float32)
    for r in range(t0, ta, FILL_ROWS):
        rows = r + offs_f
        tl.store(OUT + tl.cast(r - row0, tl.int64) * stride_or + offs_f[:, None] * stride_or + offs_n[None, :],
                 fill, mask=(rows < ta)[:, None] & n_ok[None, :])
    for r in range(tb, t1, FILL_ROWS):
        rows = r + offs_f
        tl.store(OUT + tl.cast(r - row0, tl.int64) * stride_or + offs_f[:, None] * stride_or + offs_n[None, :],
                 fill, mask=(rows < t1)[:, None] & n_ok[None, :])

    offs_p = tl.arange(0, TOKS * BLOCK_HI)  # (token, head) pairs
    tok = offs_p // BLOCK_HI
    head = offs_p % BLOCK_HI
    h_ok = head < HI
    offs_d = tl.arange(0, BLOCK_D)
    if EVEN_D:  # no mask along D: a runtime-D mask would defeat the 16-byte (async) copies of Q and K
        d_ok = tl.full([BLOCK_D], 1, tl.int1)
    else:
        d_ok = offs_d < D
    kt = tl.load(K + offs_n.to(tl.int64)[:, None] * stride_kt + offs_d[None, :],
                 mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter cannot tl.dot bf16 (it multiplies the raw uint16 storage)
        kt = kt.to(tl.float32)
    offs_g = tl.arange(0, TOKS)
    for t in range(ta, tb, TOKS):
        t64 = tl.cast(t - q_off, tl.int64)
        p_ok = ((t + tok) < tb) & h_ok
        qt = tl.load(Q + t64 * stride_qt + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                     mask=p_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(W + t64 * stride_wt + tok * stride_wt + head * stride_wh, mask=p_ok, other=0.0)
        tt = t + offs_g
        t_ok = tt < tb
        seg = tl.load(SEG + (tt - q_off), mask=t_ok, other=0)
        if UPCAST:
            qt = qt.to(tl.float32)
        s = tl.dot(kt, tl.trans(qt), input_precision=DOT_PREC)  # [BLOCK_N, TOKS * BLOCK_HI] fp32
        s = tl.maximum(s, 0.0) * (w.to(tl.float32) * scale)[None, :]
        sc = tl.sum(tl.reshape(s, [BLOCK_N, TOKS, BLOCK_HI]), 2)  # [BLOCK_N, TOKS]
        valid = (offs_n[:, None] >= seg[None, :]) & (offs_n[:, None] <= tt[None, :])
        score = tl.where(valid, sc, float("-inf"))
        out_ptr = OUT + tl.cast(t - row0, tl.int64) * stride_or + offs_g[None, :] * stride_or + offs_n[:, None]
        out_mask = n_ok[:, None] & t_ok[None, :]
        if SORT_KEYS:
            score = tl.where(score == 0.0, 0.0, score)  # -0.0 -> +0.0
            bits = score.to(tl.int32, bitcast=True)
            ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # negative floats: reverse magnitude order
            key = (ordered.to(tl.int64) << 32) | offs_n.to(tl.int64)[:, None]
            key = tl.where(score == float("-inf"), -9223372036854775807 - 1, key)  # masked: INT64_MIN
            tl.store(out_ptr, key, mask=out_mask)
        else:
            tl.store(out_ptr, score, mask=out_mask)


def _toks(HI: int, n: int = 128) -> int:
    """Query rows per loop step: TOKS x next_pow2(HI) (token, head) pairs make an MMA N of n (>= 16)."""
    return max(1, n // next_pow2(max(HI, 1)))


def default_scores_config(HI: int, on_gpu: bool = True) -> dict:
    """256 keys (2 warpgroups x 2 x 64 MMA rows) x 1 query row of 64 heads (MMA N = 64) per step, K = 128: the
    fastest of `scores_configs` on an H200 at T = 32K fp32 scores (17.5 ms, 502 TFLOP/s of causal work, against
    19.6 / 22.7 / 25.0 ms for 128 x 1 row / 64 x 2 rows / 128 x 2 rows)."""
    if not on_gpu:  # interpreter: small tiles, so tests cover several programs, loop steps and skips
        return dict(BLOCK_N=16, BLOCK_T=8, TOKS=_toks(HI, 16), num_warps=4, num_stages=1)
    return dict(BLOCK_N=256, BLOCK_T=128, TOKS=_toks(HI, 64), num_warps=8, num_stages=2)


def scores_configs(HI: int) -> list[dict]:
    """sm90, HI = 64, D = 128, bf16 (ptxas: registers / shared memory / CTAs per SM, no spills):
    128 keys x 2 rows (N 128), 8 warps: 164 regs, 98 KiB, 1 CTA; 128 keys x 1 row (N 64): 79 regs, 81 KiB, 2;
    256 keys x 1 row: 127 regs, 98 KiB, 2 (half the Q traffic per FLOP); 64 keys x 2 rows, 4 warps: 125 regs,
    81 KiB, 2. The MMA result is consumed in the same step (wgmma wait 0), so the epilogue overlaps the
    tensor cores only across CTAs."""
    return [
        dict(BLOCK_N=256, BLOCK_T=128, TOKS=_toks(HI, 64), num_warps=8, num_stages=2),
        dict(BLOCK_N=128, BLOCK_T=128, TOKS=_toks(HI, 64), num_warps=8, num_stages=3),
        dict(BLOCK_N=128, BLOCK_T=128, TOKS=_toks(HI), num_warps=8, num_stages=2),
        dict(BLOCK_N=64, BLOCK_T=128, TOKS=_toks(HI), num_warps=4, num_stages=2),
    ]


@functools.lru_cache(maxsize=None)
def _autotuned_scores(cfg_key: tuple):
    return make_autotuner(_indexer_scores_kernel, cfg_key, ["HI", "D"])


def _check(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, seg_start: torch.Tensor, topk: int,
           q_offset: int = 0) -> None:
    if q.dim() != 3:
        raise ValueError(f"indexer_topk: q must be [T, HI, D], got shape {tuple(q.shape)}")
    T, HI, D = q.shape
    if k.dim() != 2 or k.shape[1] != D or k.shape[0] < q_offset + T or q_offset < 0:
        raise ValueError(f"indexer_topk: k must be [Tk >= q_offset + T = {q_offset} + {T}, D={D}] with q_offset "
                         f">= 0, got shape {tuple(k.shape)}")
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
    row0: int, n_rows: int, out: torch.Tensor, *, config: dict | None = None, q_offset: int = 0,
) -> torch.Tensor:
    """Fill out[:n_rows, :width] (width = row0 + n_rows) for the queries at positions row0 .. row0 + n_rows - 1
    (rows row0 - q_offset .. of q, w, seg_start): fp32 `out` gets the masked scores (-inf outside the window),
    int64 `out` the tie-breaking sort keys (INT64_MIN outside). `out` may be a strided view (unit stride along
    keys)."""
    T, HI, D = q.shape
    width = row0 + n_rows
    if (out.dim() != 2 or out.shape[0] < n_rows or out.shape[1] < width or out.stride(1) != 1
            or out.dtype not in (torch.float32, torch.int64)):
        raise ValueError(f"indexer_scores: out must be fp32 or int64 [>= {n_rows}, >= {width}] with unit key "
                         f"stride, got {out.dtype} {tuple(out.shape)}")
    if n_rows <= 0:
        return out
    if scale < 0:  # relu(scale * q.k) = |scale| relu(q.(-k)) exactly; the kernel folds scale into w
        k, scale = -k, -scale
    args = (q, k, w, seg_start, out,
            q.stride(0), q.stride(1), k.stride(0), w.stride(0), w.stride(1), out.stride(0),
            row0, n_rows, width, HI, D, float(scale), int(q_offset))
    meta = dict(BLOCK_HI=next_pow2(max(HI, 1)), BLOCK_D=next_pow2(max(D, 16)),
                EVEN_D=D == next_pow2(max(D, 16)), FILL_ROWS=8,
                DOT_PREC="ieee" if q.dtype == torch.float32 or interpreting() else "tf32",
                UPCAST=interpreting() and q.dtype != torch.float32, SORT_KEYS=out.dtype == torch.int64)
    use_tune = config is None and autotune_enabled(q)
    if use_tune:
        kernel = _autotuned_scores(config_key(scores_configs(HI)))
        launch(kernel, lambda m: (triton.cdiv(width, m["BLOCK_N"]), triton.cdiv(n_rows, m["BLOCK_T"])),
               *args, **meta)
    else:
        c = dict(config or default_scores_config(HI, on_gpu=q.is_cuda and not interpreting()))
        launch(_indexer_scores_kernel, (triton.cdiv(width, c["BLOCK_N"]), triton.cdiv(n_rows, c["BLOCK_T"])),
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
    select: str = "threshold",
    q_offset: int = 0,
) -> torch.Tensor:
    """Indexer top-k: idx [T, min(topk, Tk)] int32, each row's chosen keys ascending, -1 in unused slots.
    Query t sits at position q_offset + t among the Tk keys (see the module docstring).

    Rows with <= topk valid keys return all of them; among equal scores the most recent key wins.
    `mem_cap_bytes` bounds the score buffer of one row chunk (torch.topk needs workspace on top).
    `select`: "threshold" (default) = fp32 scores, torch.topk for each row's k-th value, then
    lowerings/kernels/topk_select.py writes the chosen keys ascending; "sort_keys" = int64 sort keys
    (score image << 32 | key), torch.topk on them and a sort. Same result; the first moves half the bytes."""
    if select not in ("threshold", "sort_keys"):
        raise ValueError(f"indexer_topk: select={select!r}; valid: 'threshold', 'sort_keys'")
    _check(q, k, w, seg_start, topk, q_offset)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    seg_start = seg_start.contiguous()
    T = q.shape[0]
    kk = min(topk, k.shape[0])
    idx = torch.full((T, kk), -1, dtype=torch.int32, device=q.device)
    if T == 0:
        return idx
    sort_keys = select == "sort_keys"
    elem = 8 if sort_keys else 4
    end = q_offset + T  # keys past the last query's position are never reachable
    rows = max(1, min(T, int(mem_cap_bytes) // (elem * end)))
    buf = torch.empty(rows, end, dtype=torch.int64 if sort_keys else torch.float32, device=q.device)
    masked = torch.iinfo(torch.int64).min
    for r0 in range(0, T, rows):
        n = min(rows, T - r0)
        width = q_offset + r0 + n
        scores = indexer_scores(q, k, w, seg_start, scale, q_offset + r0, n, buf[:n, :width], config=config,
                                q_offset=q_offset)
        kc = min(kk, width)
        top = torch.topk(scores, kc, dim=1, sorted=False).values
        if sort_keys:
            # masked picks (row has fewer than kc valid keys) go past every real index, then become -1
            sel = torch.where(top == masked, width, top & 0xFFFFFFFF).sort(dim=1).values
            idx[r0:r0 + n, :kc] = torch.where(sel == width, -1, sel).to(torch.int32)
        else:
            # keys after t are masked anyway: each row reads only its causal prefix [0, t]
            row_end = torch.arange(width - n + 1, width + 1, dtype=torch.int32, device=q.device)
            select_topk_by_threshold(scores, top.min(dim=1).values, row_end, idx[r0:r0 + n, :kc])
    return idx
