"""``kernels.indexer_topk = cudnn``: cuDNN frontend's DSA indexer kernels (CuTe DSL, sm90) behind the indexer op.

Per chunk of query rows (the fp32 scores of one chunk stay under ``SCORE_BYTES_CAP``):

1. ``indexer_forward_wrapper`` in its dense layout (one batch row, ``ratio = 1``: uncompressed keys) writes
   ``sm_scale * sum_h w[t,h] relu(q[t,h].k[s])`` for the chunk against the keys up to its last query, -inf past
   each query's causal position; ``q_causal_offsets`` places the chunk's first query among the keys (a
   context-parallel rank's run of queries, or a later chunk).
2. Keys before the query's document start become -inf (one masked write over the chunk's scores).
3. ``indexer_top_k_wrapper``: a radix top-k per row over its causal prefix, ties to the larger key index (the
   most recent key, as the reference breaks them), deterministic (valid picks ascending).
4. Picks with a -inf score (rows whose document holds fewer than k keys) become -1, and ``compactify_wrapper``
   packs each row's valid picks to the front: ascending, -1 suffix, the op's contract.

Dense rather than cuDNN's THD layout because THD needs the longest document as a host integer: the op sees only
``seg_start`` on the device, and reading it back would be a host sync in every MLA layer. The cost is scoring
keys of earlier documents that step 2 then masks (scripts/bench_cudnn_dsa_indexer.py measures both layouts).

Calls the kernels cannot take (not bf16 q/k, head dim other than 128, an index head count other than 16, 32 or
64, or a GPU other than sm90) go to the Triton kernel: :func:`cudnn_takes` says why.
"""

from __future__ import annotations

import importlib.util

import torch

# fp32 scores of one row chunk, at most (the reference and the Triton kernel bound theirs alike)
SCORE_BYTES_CAP = 1 << 30
HEAD_DIM = 128
INDEX_HEADS = (16, 32, 64)  # the sm90 kernel's query heads per key head (one key head)
MAX_TOPK = 2048  # the radix top-k kernel's limit
# the frontend's DSA kernels and the CuTe-DSL runtime they are written in (nvidia-cutlass-dsl[cu13], whose
# runtime imports tvm_ffi from apache-tvm-ffi)
_MODULES = ("cudnn", "cutlass", "tvm_ffi")


def unavailable_reason() -> str | None:
    """None when the cudnn indexer backend can run on this machine, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    capability = torch.cuda.get_device_capability()
    if capability != (9, 0):
        return (f"the cuDNN frontend's sm90 DSA indexer needs compute capability 9.0; this GPU "
                f"({torch.cuda.get_device_name()}) has {capability[0]}.{capability[1]}")
    for module in _MODULES:
        if importlib.util.find_spec(module) is None:
            return (f"python module {module!r} is not installed (the cudnn indexer needs nvidia-cudnn-frontend, "
                    "nvidia-cutlass-dsl[cu13] and apache-tvm-ffi: pip install 'titan_kimi[gpu]')")
    try:
        from cudnn.deepseek_sparse_attention import indexer_forward_wrapper  # noqa: F401  (imports CuTe DSL)
    except Exception as err:  # a broken runtime says so at config time, not mid-step
        return f"cudnn.deepseek_sparse_attention does not import: {type(err).__name__}: {err}"
    return None


def cudnn_takes(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int) -> str | None:
    """Why the cuDNN kernels cannot take this call (None when they can); such calls run the Triton kernel."""
    if not q.is_cuda:
        return "needs CUDA tensors"
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
                       scale: float, q_offset: int = 0) -> torch.Tensor:
    """The op's contract (lowerings/ops/indexer_topk.py): ``[T, min(topk, Tk)]`` int32 key ids per query,
    ascending, -1 in unused slots; query t at key position ``q_offset + t`` sees keys
    ``seg_start[t] <= s <= q_offset + t``."""
    from cudnn.deepseek_sparse_attention import (compactify_wrapper, indexer_forward_wrapper,
                                                 indexer_top_k_wrapper)

    T, HI, D = q.shape
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
