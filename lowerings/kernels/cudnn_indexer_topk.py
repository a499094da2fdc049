"""``kernels.indexer_topk = cudnn``: cuDNN frontend's DSA indexer kernels (CuTe DSL, sm90) behind the indexer op.

Two layouts, both ending in cuDNN's radix top-k (ties to the larger key index, the most recent key, as the
reference breaks them; deterministic: valid picks ascending, -1 after them):

- **Documents (THD)**, when the caller passes the documents' ``cu_seqlens`` and a bound ``max_seqlen`` on their
  length (the model passes its padded ``cu_seqlens`` and the row length, so nothing is read back to the host and
  the shapes never change): ``indexer_forward_wrapper`` scores each query against its own document only, fp32
  ``[T, max_seqlen]``; the top-k runs over each query's causal prefix inside the document
  (``t - seg_start[t] + 1`` columns); ``local_to_global_wrapper`` adds the document start back. Every key inside
  that prefix has a finite score, so nothing needs compacting.
- **Dense**, otherwise (no ``cu_seqlens``, a context-parallel run of queries, or THD scores over
  ``SCORE_BYTES_CAP``), per chunk of query rows: scores against the keys up to the chunk's last query (-inf past
  each query's causal position; ``q_causal_offsets`` places the chunk among the keys), keys before the query's
  document start masked to -inf, the top-k over the causal prefix, -inf picks set to -1 and
  ``compactify_wrapper`` packing each row's valid picks to the front. It scores keys of earlier documents only to
  throw them away (scripts/bench/indexer_topk.py measures both layouts).

Calls the kernels cannot take (not bf16 q/k, head dim other than 128, an index head count other than 16, 32 or
64, or a GPU other than sm90) go to the Triton kernel: :func:`cudnn_takes` says why.
"""

from __future__ import annotations

import torch

from lowerings.kernels.cudnn_dsa_runtime import dsa_unavailable_reason

# fp32 scores of one row chunk, at most (the reference and the Triton kernel bound theirs alike)
SCORE_BYTES_CAP = 1 << 30
HEAD_DIM = 128
INDEX_HEADS = (16, 32, 64)  # the sm90 kernel's query heads per key head (one key head)
MAX_TOPK = 2048  # the radix top-k kernel's limit


def unavailable_reason() -> str | None:
    """None when the cudnn indexer backend can run on this machine, else why not."""
    return dsa_unavailable_reason("the cudnn indexer backend", "cudnn.deepseek_sparse_attention",
                                  "indexer_forward_wrapper")


def cudnn_takes(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int) -> str | None:
    """Why the cuDNN kernels cannot take this call (None when they can); such calls run the Triton kernel. The
    device is the op's rule (``lowerings.ops.indexer_topk.forward_kernel``: CPU tensors run the reference)."""
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16:
        return f"needs bf16 q and k, got {q.dtype}/{k.dtype}"
    if w.dtype not in (torch.float32, torch.bfloat16):
        return f"needs fp32 or bf16 head weights, got {w.dtype}"
    if q.shape[-1] != HEAD_DIM:
        return f"needs head dim {HEAD_DIM}, got {q.shape[-1]}"
    if q.shape[1] not in INDEX_HEADS:
        return f"needs {INDEX_HEADS} index heads, got {q.shape[1]}"
    if min(topk, k.shape[0]) > MAX_TOPK:
        return f"top-k {topk} exceeds the radix kernel's {MAX_TOPK}"
    return None


def cudnn_indexer_topk(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, seg_start: torch.Tensor, topk: int,
                       scale: float, q_offset: int = 0, cu_seqlens: torch.Tensor | None = None,
                       max_seqlen: int = 0) -> torch.Tensor:
    """The op's contract (lowerings/ops/indexer_topk.py): ``[T, min(topk, Tk)]`` int32 key ids per query,
    ascending, -1 in unused slots; query t at key position ``q_offset + t`` sees keys
    ``seg_start[t] <= s <= q_offset + t``. ``cu_seqlens`` (the same documents as ``seg_start``, padded with
    zero-length ones at the end) and ``max_seqlen`` (at least the longest document) select the THD layout."""
    T = q.shape[0]
    if (cu_seqlens is not None and q_offset == 0 and k.shape[0] == T and 0 < max_seqlen
            and 4 * T * max_seqlen <= SCORE_BYTES_CAP):
        return _documents(q, k, w, seg_start, topk, scale, cu_seqlens, max_seqlen)
    return _dense(q, k, w, seg_start, topk, scale, q_offset)


def _documents(q, k, w, seg_start, topk, scale, cu_seqlens, max_seqlen):
    from cudnn.deepseek_sparse_attention import (indexer_forward_wrapper, indexer_top_k_wrapper,
                                                 local_to_global_wrapper)

    T, _, D = q.shape
    width = min(topk, T)
    out = torch.full((T, width), -1, dtype=torch.int32, device=q.device)
    if T == 0:
        return out
    cu = cu_seqlens.contiguous()  # int32: the op's wrapper casts it
    scores = indexer_forward_wrapper(q.contiguous(), k.contiguous().view(T, 1, D), w.contiguous(), ratio=1,
                                     sm_scale=scale, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
                                     max_seqlen_k=max_seqlen)["scores"]  # [T, max_seqlen], document-local keys
    prefix = (torch.arange(T, dtype=torch.int32, device=q.device) - seg_start.to(torch.int32) + 1).contiguous()
    kc = min(width, max_seqlen)
    local = indexer_top_k_wrapper(scores, prefix, top_k=kc, next_n=1, return_val=False, tie_break=2,
                                  deterministic=True)["indices"]
    out[:, :kc] = local_to_global_wrapper(local, max_seqlen, cu_seqlens_q=cu, cu_seqlens_k=cu)["indices"]
    return out


def _dense(q, k, w, seg_start, topk, scale, q_offset):
    from cudnn.deepseek_sparse_attention import (compactify_wrapper, indexer_forward_wrapper,
                                                 indexer_top_k_wrapper)

    T, _, D = q.shape
    width = min(topk, k.shape[0])
    out = torch.full((T, width), -1, dtype=torch.int32, device=q.device)
    if T == 0:
        return out
    end = q_offset + T  # keys after the last query are never reachable
    rows = max(1, min(T, SCORE_BYTES_CAP // (4 * end)))
    q, k, w = q.contiguous(), k.contiguous(), w.contiguous()
    for r0 in range(0, T, rows):
        n = min(rows, T - r0)
        first = q_offset + r0  # the chunk's first query's position among the keys
        keys = first + n
        offset = torch.full((1,), first, dtype=torch.int32, device=q.device)
        scores = indexer_forward_wrapper(q[r0:r0 + n].unsqueeze(0), k[:keys].view(1, keys, 1, D),
                                         w[r0:r0 + n].unsqueeze(0), ratio=1, sm_scale=scale,
                                         q_causal_offsets=offset)["scores"][0]  # [n, keys]
        cols = torch.arange(keys, dtype=torch.int32, device=q.device)
        scores.masked_fill_(cols < seg_start[r0:r0 + n, None], float("-inf"))
        prefix = torch.arange(first + 1, keys + 1, dtype=torch.int32, device=q.device)  # causal row lengths
        kc = min(width, keys)
        picked = indexer_top_k_wrapper(scores, prefix, top_k=kc, next_n=1, return_val=True, tie_break=2,
                                       deterministic=True)
        idx = torch.where(torch.isfinite(picked["values"]), picked["indices"], -1)
        out[r0:r0 + n, :kc] = compactify_wrapper(idx)["indices"]
    return out
