"""``kernels.sparse_mla = cudnn``: cuDNN frontend's sm90 DSA backward (CuTe DSL) behind the sparse MLA op.

cuDNN-FE 1.32.0 has no sm90 sparse forward, so this backend runs our forward (Gluon / Triton,
lowerings/kernels/sparse_mla_fwd*.py) and hands its ``out`` and ``lse`` to ``SparseAttentionBackward``. The
contracts line up: the absorbed MQA form (q ``[T, H, 576]``, one latent row per key ``kv [S, 576]`` whose first
512 columns are the value), global int32 top-k rows with entries outside ``[0, S)`` ignored (our -1 padding), a
natural-log, keys-only fp32 ``lse``. Two differences are bridged here:

- K3 has no attention sink; cuDNN's kernel always mixes one in, so it gets ``-inf`` per head (``p_sink = 0``,
  the log-sum-exp unchanged).
- Rows without any key have ``lse = -inf`` in our forward; cuDNN would read that as ``lse = 0`` and weight their
  (ignored) keys by ``exp(s)``. Given ``+inf`` instead, every probability of such a row is 0 and so are its
  gradients, as in the reference.

Plans (cuDNN's support check and its first-call compile of the three kernels) are cached per shape; each call
allocates its outputs and the kernel's fp32 scratch from torch's caching allocator (no tensors are kept between
calls, so a CUDA graph that captures a call owns everything it touches).
"""

from __future__ import annotations

import torch

from lowerings.kernels.cudnn_dsa_runtime import dsa_unavailable_reason

HEAD_DIMS = {576: 512, 512: 512}  # q / kv head dim -> value dim the sm90 kernel is tiled for
_PLANS: dict[tuple, object] = {}


def unavailable_reason() -> str | None:
    """None when the cudnn sparse-MLA backward can run on this machine, else why not."""
    return dsa_unavailable_reason("the cudnn sparse-MLA backward", "cudnn.deepseek_sparse_attention",
                                  "SparseAttentionBackward")


def cudnn_takes(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, d_v: int) -> str | None:
    """Why cuDNN's backward cannot take this call (None when it can); such calls run the Triton backward."""
    if not q.is_cuda:
        return "needs CUDA tensors"
    if q.dtype not in (torch.bfloat16, torch.float16) or kv.dtype != q.dtype:
        return f"needs bf16 or fp16 q and kv of one dtype, got {q.dtype}/{kv.dtype}"
    D = q.shape[-1]
    if HEAD_DIMS.get(D) != d_v:
        return f"needs (head dim, value dim) in {sorted(HEAD_DIMS.items())}, got ({D}, {d_v})"
    if q.shape[1] < 2:
        return f"needs more than one query head, got {q.shape[1]}"
    if idx.shape[1] == 0:
        return "needs at least one top-k column"
    return None


def _plan(q, kv, out, d_out, lse, sink, idx, scale: float):
    from cudnn.deepseek_sparse_attention import SparseAttentionBackward

    key = (q.device, q.dtype, tuple(q.shape), tuple(kv.shape), tuple(idx.shape), float(scale))
    plan = _PLANS.get(key)
    if plan is None:
        plan = SparseAttentionBackward(sample_q=q, sample_kv=kv, sample_out=out, sample_dout=d_out, sample_lse=lse,
                                       sample_attn_sink=sink, sample_topk_idxs=idx, softmax_scale=scale)
        plan.check_support()  # raises ValueError naming what it refuses
        plan.compile()
        _PLANS[key] = plan
    return plan


def cudnn_sparse_mla_backward(d_out: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, scale: float,
                              d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients ``(dq [T, H, D], dkv [S, D])`` of the sparse MLA op (lowerings/ops/sparse_mla.py) from its
    forward's ``out`` and natural-log ``lse``; ``d_v`` must be the value dim :func:`cudnn_takes` accepted."""
    q, kv, idx, out, d_out = (t.contiguous() for t in (q, kv, idx, out, d_out))
    lse = torch.where(torch.isneginf(lse), float("inf"), lse).contiguous()  # keyless rows: every p = 0
    sink = torch.full((q.shape[1],), float("-inf"), dtype=torch.float32, device=q.device)  # K3 has no sink
    plan = _plan(q, kv, out, d_out, lse, sink, idx, scale)
    dq, dkv, d_sink = torch.empty_like(q), torch.empty_like(kv), torch.empty_like(sink)
    workspace = torch.empty(plan.scratch_workspace_bytes(), dtype=torch.uint8, device=q.device)
    plan.execute(q, kv, out, d_out, lse, sink, idx, dq, dkv, softmax_scale=scale, workspace=workspace,
                 d_sink=d_sink)
    return dq, dkv
