"""DeepSeek FlashMLA's sparse prefill forward (sm90) behind titan_kimi's ``sparse_mla`` forward contract.

Our contract (docs/ops.md, lowerings/kernels/sparse_mla_fwd.py):
    q [T, H, 576] bf16, kv [S, 576] bf16 (one latent row per key; the values are its first 512 columns),
    idx [T, k] int32 rows of kv (-1, or anything outside [0, S), marks an unused slot)
    -> out [T, H, 512] (q's dtype), lse [T, H] fp32 natural log; rows without a valid key: out 0, lse -inf.

FlashMLA's ``flash_mla.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None,
topk_length=None) -> (out, max_logits, lse)`` (flash_mla/flash_mla_interface.py; checks in
csrc/api/sparse_fwd.h, kernel csrc/sm90/prefill/sparse/phase1.cuh) takes q [s_q, h_q, d_qk] bf16,
kv [s_kv, h_kv, d_qk] bf16, indices [s_q, h_kv, topk] int32 with -1 or >= s_kv for an unused slot; on sm90:
h_kv = 1, h_q 64 or 128 (64-head blocks), d_qk 576 or 512, d_v 512, topk a positive multiple of 128;
``topk_length[t]`` (optional) stops row t's key loop after that many slots. lse is natural log
(``log(l) + m ln 2``), and a row without a valid key gets out 0 and lse = +inf (max_logits -inf).

The glue here:
* heads: FlashMLA runs on windows of 64 or 128 heads (``head_windows``): K3.1's 96 heads run as heads [0, 64)
  and the window [32, 96) (views of q, no copy; the overlap is computed twice, as padding to 128 would), fewer
  than 64 heads are zero-padded to 64;
* top-k: indices are padded with -1 to a multiple of 128, and ``topk_length`` is one past each row's last valid
  slot, so the -1 suffix of early tokens and short documents costs no key blocks;
* empty rows are forced to out 0, lse -inf whatever the kernel returns (FlashMLA says +inf).
Backward: FlashMLA has none for sparse attention; the op pairs this forward with our Triton backward, which only
needs out and the natural-log lse.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Callable

import torch

__all__ = ["unavailable_reason", "flash_mla_takes", "flash_mla_sparse_forward", "head_windows",
           "SUPPORTED_HEADS", "TOPK_MULTIPLE", "D_QK", "D_V"]

SUPPORTED_HEADS = (64, 128)  # h_q the sm90 kernel takes (csrc/api/sparse_fwd.h)
TOPK_MULTIPLE = 128  # KU_ASSERT(params.topk % (2*B_TOPK) == 0) with B_TOPK = 64 (sm90 phase1.cuh)
D_QK, D_V = 576, 512  # the only shapes scripts/tools/build_flash_mla.sh's minimal build compiles
_INT32_MAX = 2**31 - 1
BUILD_HINT = "build it with scripts/tools/build_flash_mla.sh and put its target folder on PYTHONPATH"


def _flash_mla_sparse_fwd() -> Callable:
    # Looked up per call (a dict hit after the first import) so tests can swap in a stand-in module.
    return importlib.import_module("flash_mla").flash_mla_sparse_fwd


def unavailable_reason() -> str | None:
    """None when FlashMLA's sparse prefill forward can run here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    capability = torch.cuda.get_device_capability()
    if capability != (9, 0):  # the sm100 kernels exist upstream, but this build and its validation are sm90
        return (f"FlashMLA's sparse prefill forward is built and validated for sm90 only; this GPU "
                f"({torch.cuda.get_device_name()}) has compute capability {capability[0]}.{capability[1]}")
    try:
        module = importlib.import_module("flash_mla")
    except ModuleNotFoundError as err:
        if err.name != "flash_mla":  # the package is there but something it imports is not
            return f"python module 'flash_mla' does not import: {err}"
        return f"python module 'flash_mla' is not installed ({BUILD_HINT})"
    except Exception as err:  # a broken build (e.g. an extension built against another torch) fails here
        return f"python module 'flash_mla' does not import: {type(err).__name__}: {err}"
    if not callable(getattr(module, "flash_mla_sparse_fwd", None)):
        return f"flash_mla ({getattr(module, '__file__', '?')}) has no flash_mla_sparse_fwd (a FlashMLA before 2025-09)"
    return None


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _shape_reason(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, d_v: int) -> str | None:
    if q.dim() != 3 or kv.dim() != 2 or idx.dim() != 2 or idx.shape[0] != q.shape[0]:
        return f"needs q [T,H,D], kv [S,D], idx [T,k]; got {tuple(q.shape)}, {tuple(kv.shape)}, {tuple(idx.shape)}"
    if idx.dtype != torch.int32:
        return f"FlashMLA takes int32 indices, got {idx.dtype}"
    if q.shape[2] != D_QK or kv.shape[1] != D_QK:
        return f"FlashMLA (this build) takes Dqk = {D_QK}, got q {q.shape[2]} / kv {kv.shape[1]}"
    if d_v != D_V:
        return f"FlashMLA takes d_v = {D_V}, got {d_v}"
    T, H = q.shape[0], q.shape[1]
    k_pad = _round_up(max(idx.shape[1], 1), TOPK_MULTIPLE)
    # the kernel indexes indices and lse with int32 offsets (s_q_idx * stride, s_q_idx * h_q)
    if T * k_pad > _INT32_MAX or T * _round_up(max(H, 1), 64) > _INT32_MAX:
        return f"T = {T} with k = {idx.shape[1]} and H = {H} overflows FlashMLA's int32 offsets"
    return None


def flash_mla_takes(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, d_v: int) -> str | None:
    """Why this call cannot go to FlashMLA (None: it can): bf16, Dqk 576, d_v 512; any head count and top-k (the
    glue pads them). Shapes and dtypes only: the device, and whether flash_mla is installed
    (``unavailable_reason``), are the caller's checks."""
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        return f"FlashMLA takes bf16 q and kv, got {q.dtype} / {kv.dtype}"
    return _shape_reason(q, kv, idx, d_v)


@functools.lru_cache(maxsize=16)
def head_windows(H: int) -> tuple[tuple[int, int, int, int], ...]:
    """FlashMLA calls covering heads [0, H): (start, width, lo, hi) runs q heads [start, start + width) (zero-
    padded past H) and keeps the window's heads [lo, hi), i.e. global heads [start + lo, start + hi).

    Full 128-head windows, then a 64-head one, then for a remainder r < 64: the last 64 heads [H - 64, H)
    keeping their last r (a view of q), or, with fewer than 64 heads in all, one zero-padded 64-head window."""
    if H <= 0:
        raise ValueError(f"head_windows: H must be positive, got {H}")
    windows = []
    full = H // 64 * 64
    for start in range(0, full, 128):
        width = min(128, full - start)
        windows.append((start, width, 0, width))
    rem = H - full
    if rem and H >= 64:
        windows.append((H - 64, 64, 64 - rem, 64))
    elif rem:
        windows.append((0, 64, 0, H))
    return tuple(windows)


@functools.lru_cache(maxsize=8)
def _takes_topk_length(fn: Callable) -> bool:
    # topk_length arrived in FlashMLA after flash_mla_sparse_fwd; older builds still mask the -1 slots.
    try:
        return "topk_length" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _row_extent(idx: torch.Tensor, s_kv: int) -> torch.Tensor:
    """[T] int32: one past the last slot of each row holding a valid index (0: the row has none)."""
    valid = (idx >= 0) & (idx < s_kv)
    slot = torch.arange(1, idx.shape[1] + 1, dtype=torch.int32, device=idx.device)
    return torch.where(valid, slot, torch.zeros((), dtype=torch.int32, device=idx.device)).amax(dim=1)


def flash_mla_sparse_forward(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float, d_v: int = D_V
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA forward through FlashMLA: (out [T, H, d_v] in q's dtype, lse [T, H] fp32, natural log; rows
    without a valid key: out 0, lse -inf). Route calls with ``flash_mla_takes`` first."""
    # Not the dtype: FlashMLA itself refuses non-bf16, and the glue stays testable in fp32 with a stand-in.
    reason = _shape_reason(q, kv, idx, d_v)
    if reason is not None:
        raise ValueError(f"flash_mla_sparse_forward: {reason}")
    if not (q.device == kv.device == idx.device):
        raise ValueError(f"flash_mla_sparse_forward: q, kv, idx on different devices: {q.device}, {kv.device}, "
                         f"{idx.device}")
    T, H, D = q.shape
    S, k = kv.shape[0], idx.shape[1]
    if T == 0 or H == 0 or k == 0 or S == 0:  # nothing to attend to (FlashMLA would refuse topk = 0)
        return (torch.zeros(T, H, d_v, dtype=q.dtype, device=q.device),
                torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device))

    q = q if q.stride(-1) == 1 else q.contiguous()
    kv3 = (kv if kv.stride(-1) == 1 else kv.contiguous()).unsqueeze(1)  # [S, h_kv = 1, D]
    extent = _row_extent(idx, S)
    k_pad = _round_up(k, TOPK_MULTIPLE)
    idx3 = torch.nn.functional.pad(idx, (0, k_pad - k), value=-1) if k_pad != k else idx
    idx3 = idx3.contiguous().unsqueeze(1)  # [T, h_kv = 1, k_pad]
    empty = extent == 0
    neg_inf = torch.full((), float("-inf"), dtype=torch.float32, device=q.device)
    fn = _flash_mla_sparse_fwd()
    extra = {"topk_length": extent} if _takes_topk_length(fn) else {}

    windows = head_windows(H)
    if windows == ((0, H, 0, H),):  # 64 or 128 heads: one call, its out fixed in place (no second [T,H,d_v])
        out, _max_logits, lse = fn(q, kv3, idx3, float(scale), d_v, **extra)
        out.masked_fill_(empty[:, None, None], 0)
        return out, torch.where(empty[:, None] | torch.isposinf(lse), neg_inf, lse.float())

    out = torch.empty(T, H, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    for start, width, lo, hi in windows:
        if start + width <= H:
            qw = q[:, start:start + width]  # a view: FlashMLA reads q through its strides
        else:
            qw = q.new_zeros(T, width, D)
            qw[:, :H - start] = q[:, start:]
        o_w, _max_logits, lse_w = fn(qw, kv3, idx3, float(scale), d_v, **extra)
        heads = slice(start + lo, start + hi)
        # one pass per window both places its heads and forces the empty-row convention
        torch.where(empty[:, None, None], zero, o_w[:, lo:hi], out=out[:, heads])
        lse_w = lse_w[:, lo:hi].float()
        torch.where(empty[:, None] | torch.isposinf(lse_w), neg_inf, lse_w, out=lse[:, heads])
    return out, lse
