"""``titan_kimi::indexer_topk``: DSA indexer scores and top-k key selection (no gradient: hard selection)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from lowerings.autocast import autocast_off
from lowerings.ops.registry import cuda_available, op_backends, selected_backend


def _cudnn_available() -> str | None:  # sm90, the cuDNN frontend's DSA kernels and the CuTe-DSL runtime
    from lowerings.kernels.cudnn_indexer_topk import unavailable_reason

    return unavailable_reason()


BACKENDS = op_backends("indexer_topk")
BACKENDS.add("triton", cuda_available, auto_rank=0)
# auto's first choice where cuDNN's DSA runtime is installed: its document-wise (THD) layout measured faster than
# the Triton kernel on every layout at K3.1's shape with the same selections (docs/perf.md, docs/ops.md)
BACKENDS.add("cudnn", _cudnn_available, auto_rank=0)

# The rule table the op consults; configure_backends picks the row (the op's resolved backend): the kernel each
# backend runs on CUDA tensors. CPU tensors run the reference under the CUDA backends.
INDEXER_TOPK_KERNELS: Mapping[str, str] = MappingProxyType({
    "cudnn": "cudnn",
    "triton": "triton",
    "reference": "reference",
})
CUDA_KERNELS = frozenset({"cudnn", "triton"})
ShapeRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], "str | None"]  # why a call is refused


def _cudnn_refuses(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int) -> str | None:
    from lowerings.kernels.cudnn_indexer_topk import cudnn_takes

    return cudnn_takes(q, k, w, topk)


# The fused kernels that take only some call shapes: kernel -> (its rule, the kernel that runs what it refuses).
# cuDNN's DSA indexer: bf16 q and k, fp32 or bf16 head weights, head dim 128, 16 / 32 / 64 index heads, top-k
# within its radix kernel's 2,048.
SHAPE_RULES: Mapping[str, tuple[ShapeRule, str]] = MappingProxyType({
    "cudnn": (_cudnn_refuses, "triton"),
})


def forward_kernel(backend: str, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int,
                   *, cuda: bool | None = None) -> str:
    """The kernel ``indexer_topk_op`` runs for this call under ``backend`` (its row of ``INDEXER_TOPK_KERNELS``,
    then ``SHAPE_RULES``). ``cuda`` (default ``q.is_cuda``) lets tests ask for the GPU decision with CPU tensors."""
    kernel = INDEXER_TOPK_KERNELS[backend]
    if kernel in CUDA_KERNELS and not (q.is_cuda if cuda is None else cuda):
        return "reference"
    refuses, instead = SHAPE_RULES.get(kernel, (None, kernel))
    return instead if refuses is not None and refuses(q, k, w, topk) is not None else kernel


# Row chunks keep the fp32 [rows, heads, T] intermediate under this many bytes, so long sequences never
# materialise the whole [T, T] score matrix.
SCORE_BYTES_CAP = 1 << 30


def indexer_scores_reference(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, seg_start: torch.Tensor, rows: slice, scale: float,
    q_offset: int = 0,
) -> torch.Tensor:
    """I(t,s) = sum_h w[t,h] relu(scale q[t,h].k[s]) for t in ``rows``; -inf outside [seg_start[t], p(t)] with
    p(t) = q_offset + t, the query's position among the keys."""
    qt = q[rows].float()
    logits = torch.einsum("thd,sd->ths", qt, k.float()) * scale
    scores = torch.einsum("th,ths->ts", w[rows].float(), torch.relu(logits))
    t = torch.arange(rows.start + q_offset, rows.stop + q_offset, device=q.device).unsqueeze(1)
    s = torch.arange(k.shape[0], device=q.device).unsqueeze(0)
    valid = (s <= t) & (s >= seg_start[rows].unsqueeze(1).long())
    return scores.masked_fill(~valid, float("-inf"))


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k columns per row as ascending int32 indices, -1 in slots without a valid (finite) key.

    Ties go to the most recent key, so the choice depends only on positions relative to the query and a
    document selects the same keys whether it runs alone or packed with others (ReLU scores tie at 0 often).
    """
    # One int64 key per score, unique per row: the score's bits made order-preserving as an integer, then the
    # column, so a partial top-k (no full sort) picks the highest scores and, among equal ones, the latest key.
    bits = (scores.float() + 0.0).contiguous().view(torch.int32)  # + 0.0: -0.0 ties with 0.0, as in a sort
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()
    column = torch.arange(scores.shape[-1], device=scores.device)
    top = torch.topk((ordered << 32) | column, k, dim=-1).values
    idx = top & 0xFFFFFFFF
    finite = torch.isfinite(torch.gather(scores, -1, idx))
    idx = torch.where(finite, idx, torch.full_like(idx, torch.iinfo(torch.int64).max)).sort(dim=-1).values
    return torch.where(idx == torch.iinfo(torch.int64).max, torch.full_like(idx, -1), idx).to(torch.int32)


def indexer_topk_reference(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, seg_start: torch.Tensor, topk: int, scale: float,
    q_offset: int = 0,
) -> torch.Tensor:
    T, HI, _ = q.shape
    width = min(topk, k.shape[0])
    keys = k[: q_offset + T]  # keys after the last query's position are never reachable
    rows_per_chunk = max(1, SCORE_BYTES_CAP // max(1, 4 * HI * keys.shape[0]))
    out = []
    for start in range(0, T, rows_per_chunk):
        rows = slice(start, min(T, start + rows_per_chunk))
        scores = indexer_scores_reference(q, keys, w, seg_start, rows, scale, q_offset)
        chosen = select_topk(scores, min(width, keys.shape[0]))
        out.append(F.pad(chosen, (0, width - chosen.shape[1]), value=-1))
    return torch.cat(out, dim=0) if out else q.new_empty((0, width), dtype=torch.int32)


@torch.library.custom_op("titan_kimi::indexer_topk", mutates_args=())
def indexer_topk_op(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, seg_start: torch.Tensor, topk: int, scale: float,
    q_offset: int = 0, cu_seqlens: torch.Tensor | None = None, max_seqlen: int = 0,
) -> torch.Tensor:
    kernel = forward_kernel(selected_backend("indexer_topk"), q, k, w, topk)
    with autocast_off(q):  # the op sets its own precision (the reference: fp32 scores)
        if kernel == "cudnn":
            from lowerings.kernels.cudnn_indexer_topk import cudnn_indexer_topk

            return cudnn_indexer_topk(q, k, w, seg_start, topk, scale, q_offset, cu_seqlens, max_seqlen)
        if kernel == "triton":
            from lowerings.kernels.indexer_topk import indexer_topk as triton_indexer_topk

            return triton_indexer_topk(q, k, w, seg_start, topk, scale, q_offset=q_offset)
        return indexer_topk_reference(q, k, w, seg_start, topk, scale, q_offset)


@indexer_topk_op.register_fake
def _(q, k, w, seg_start, topk, scale, q_offset=0, cu_seqlens=None, max_seqlen=0):
    return q.new_empty((q.shape[0], min(topk, k.shape[0])), dtype=torch.int32)


def indexer_topk(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, seg_start: torch.Tensor, *, topk: int, scale: float,
    q_offset: int = 0, cu_seqlens: torch.Tensor | None = None, max_seqlen: int = 0,
) -> torch.Tensor:
    """Indices ``[T, min(topk, Tk)]`` (int32, ascending, -1 = empty) of the keys each query attends to.

    ``k [Tk, D]`` holds the keys; query t sits at key position ``q_offset + t`` and sees keys
    ``seg_start[t] <= s <= q_offset + t``. The default (q_offset 0, Tk = T) is a sequence querying itself; a
    context-parallel rank passes a run of its queries against the gathered keys.

    ``cu_seqlens`` (int32 document starts, ``T`` last; may repeat ``T`` as zero-length documents at the end) and
    ``max_seqlen`` (a bound on the longest document) describe the same documents as ``seg_start``, for backends
    that work per document (``cudnn``); the others ignore them and the result is the same.
    """
    T = q.shape[0]
    if (q.dim() != 3 or k.dim() != 2 or k.shape[1] != q.shape[2] or k.shape[0] < q_offset + T or q_offset < 0
            or w.shape != q.shape[:2] or seg_start.shape != (T,)):
        raise ValueError(
            f"indexer_topk expects q [T,HI,D], k [Tk >= q_offset + T, D], w [T,HI], seg_start [T], q_offset >= 0; "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(w.shape)}, {tuple(seg_start.shape)}, q_offset {q_offset}"
        )
    if topk < 1:
        raise ValueError(f"indexer_topk needs topk >= 1, got {topk}")
    if cu_seqlens is not None and (cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or max_seqlen < 1):
        raise ValueError(f"indexer_topk needs cu_seqlens [N+1 >= 2] with max_seqlen >= 1; got cu_seqlens "
                         f"{tuple(cu_seqlens.shape)}, max_seqlen {max_seqlen}")
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.int32)
    return indexer_topk_op(q.detach(), k.detach(), w.detach(), seg_start.to(torch.int32), topk, scale, q_offset,
                           cu_seqlens, max_seqlen)
