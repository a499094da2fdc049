"""Indexer distillation (K3.1 indexer training): the KL from the main attention to the indexer's softmax.

Ops (``torch.ops.titan_kimi.*``; math and notation in ``lowerings/ops/indexer_kl_reference.py``, contracts in
docs/ops.md), backend ``kernels.indexer_distillation``:

* ``indexer_sparse_target``: the head-summed, L1-normalised main-attention probabilities at the selected keys,
  from the sparse-MLA forward's queries, latent keys and per-head LSE (no gradient);
* ``indexer_scores_at``: the indexer's scores at the selected keys, differentiable in its q, k and weights;
* ``attention_lse``: the main attention's per-head LSE over every causal key of the document (no gradient);
* ``indexer_dense_kl``: the KL over every causal key, blockwise (no ``[T, T]`` tensor), with its backward;
* ``sparse_mla_distilled``: ``sparse_mla`` whose backward also gives the indexer's scores at the selected keys
  the gradient of their KL: the target comes from the probabilities the sparse-MLA backward recomputes anyway
  (``sparse_mla_backward_with_target``), so the sparse stage gathers the selected keys no more often than a
  frozen indexer does.

``sparse_indexer_kl`` composes the first two with the row KL (plain torch, which a compile fuses): the KL's
value. The main attention's tensors enter detached: the KL trains the indexer only.
"""

from __future__ import annotations

import torch

from lowerings.autocast import autocast_off
from lowerings.ops.indexer_kl_reference import (attention_lse_reference, dense_kl_backward_reference,
                                                dense_kl_reference, normalise, row_kl, row_kl_score_grad,
                                                scores_at_backward_reference, scores_at_reference,
                                                sparse_target_reference)
from lowerings.ops.registry import cuda_available, op_backends, selected_backend
from lowerings.ops.sparse_mla import backward_kernel, forward_by_backend, sparse_mla_backward_op

BACKENDS = op_backends("indexer_distillation")
BACKENDS.add("triton", cuda_available, auto_rank=0)


def _triton(t: torch.Tensor) -> bool:
    return selected_backend("indexer_distillation") == "triton" and t.is_cuda


# ---------------------------------------------------------------- selected keys
@torch.library.custom_op("titan_kimi::indexer_sparse_target", mutates_args=())
def sparse_target_op(q: torch.Tensor, kv: torch.Tensor, lse: torch.Tensor, idx: torch.Tensor,
                     scale: float) -> torch.Tensor:
    with autocast_off(q):  # the op sets its own precision (the references: fp32)
        if _triton(q):
            from lowerings.kernels.indexer_kl import sparse_target

            return sparse_target(q, kv, lse, idx, scale)
        return sparse_target_reference(q, kv, lse, idx, scale)


@sparse_target_op.register_fake
def _(q, kv, lse, idx, scale):
    return q.new_empty(idx.shape, dtype=torch.float32)


@torch.library.custom_op("titan_kimi::indexer_scores_at", mutates_args=())
def scores_at_op(iq: torch.Tensor, ik: torch.Tensor, iw: torch.Tensor, idx: torch.Tensor,
                 index_scale: float) -> torch.Tensor:
    with autocast_off(iq):
        if _triton(iq):
            from lowerings.kernels.indexer_kl import scores_at

            return scores_at(iq, ik, iw, idx, index_scale)
        return scores_at_reference(iq, ik, iw, idx, index_scale)


@scores_at_op.register_fake
def _(iq, ik, iw, idx, index_scale):
    return iq.new_empty(idx.shape, dtype=torch.float32)


@torch.library.custom_op("titan_kimi::indexer_scores_at_backward", mutates_args=())
def scores_at_backward_op(d_scores: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor, iw: torch.Tensor,
                          idx: torch.Tensor, index_scale: float) -> list[torch.Tensor]:
    with autocast_off(iq):
        if _triton(iq):
            from lowerings.kernels.indexer_kl import scores_at_backward

            return _as_dtypes(scores_at_backward(d_scores, iq, ik, iw, idx, index_scale), (iq, ik, iw))
        return list(scores_at_backward_reference(d_scores, iq, ik, iw, idx, index_scale))


@scores_at_backward_op.register_fake
def _(d_scores, iq, ik, iw, idx, index_scale):
    return [torch.empty_like(iq), torch.empty_like(ik), torch.empty_like(iw)]


def _scores_setup(ctx, inputs, output):
    iq, ik, iw, idx, index_scale = inputs
    ctx.save_for_backward(iq, ik, iw, idx)
    ctx.index_scale = index_scale


def _scores_backward(ctx, d_scores):
    iq, ik, iw, idx = ctx.saved_tensors
    diq, dik, diw = scores_at_backward_op(d_scores.contiguous(), iq, ik, iw, idx, ctx.index_scale)
    return diq, dik, diw, None, None


torch.library.register_autograd("titan_kimi::indexer_scores_at", _scores_backward, setup_context=_scores_setup)


# ---------------------------------------------------------------- sparse attention carrying the KL's gradient
@torch.library.custom_op("titan_kimi::sparse_mla_backward_with_target", mutates_args=())
def sparse_mla_backward_with_target_op(d_out: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor,
                                       out: torch.Tensor, lse: torch.Tensor, scale: float,
                                       d_v: int) -> list[torch.Tensor]:
    """[dq, dkv, target p [T,k] fp32] (``sparse_target`` of the forward's lse). The Triton backward sums its
    recomputed probabilities over the heads on chip; the other backward kernels leave the target to
    ``indexer_sparse_target``."""
    with autocast_off(q):
        if backward_kernel(selected_backend("sparse_mla"), q, kv, idx, d_v) == "triton":
            from lowerings.kernels.sparse_mla_bwd import sparse_mla_backward

            dq, dkv, mass = sparse_mla_backward(d_out, q, kv, idx, out, lse, scale, d_v, head_mass=True)
            return [dq, dkv, normalise(mass)]
        dq, dkv = sparse_mla_backward_op(d_out, q, kv, idx, out, lse, scale, d_v)
        return [dq, dkv, sparse_target_op(q, kv, lse, idx, scale)]


@sparse_mla_backward_with_target_op.register_fake
def _(d_out, q, kv, idx, out, lse, scale, d_v):
    return [torch.empty_like(q), torch.empty_like(kv), q.new_empty(idx.shape, dtype=torch.float32)]


@torch.library.custom_op("titan_kimi::sparse_mla_distilled", mutates_args=())
def sparse_mla_distilled_op(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scores: torch.Tensor,
                            weight: torch.Tensor, scale: float, d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    with autocast_off(q):
        return forward_by_backend(q, kv, idx, scale, d_v)


@sparse_mla_distilled_op.register_fake
def _(q, kv, idx, scores, weight, scale, d_v):
    T, H, _ = q.shape
    return q.new_empty((T, H, d_v)), q.new_empty((T, H), dtype=torch.float32)


def _distilled_setup(ctx, inputs, output):
    q, kv, idx, scores, weight, scale, d_v = inputs
    ctx.save_for_backward(q, kv, idx, scores, weight, *output)
    ctx.mark_non_differentiable(output[1])
    ctx.static = (scale, d_v)


def _distilled_backward(ctx, d_out, d_lse):
    q, kv, idx, scores, weight, out, lse = ctx.saved_tensors
    dq, dkv, target = sparse_mla_backward_with_target_op(d_out.contiguous(), q, kv, idx, out, lse, *ctx.static)
    d_scores = weight.unsqueeze(-1) * row_kl_score_grad(target, scores.detach(), idx >= 0)
    return dq, dkv, None, d_scores, None, None, None


torch.library.register_autograd("titan_kimi::sparse_mla_distilled", _distilled_backward,
                                setup_context=_distilled_setup)


# ---------------------------------------------------------------- every causal key
@torch.library.custom_op("titan_kimi::attention_lse", mutates_args=())
def attention_lse_op(q: torch.Tensor, kv: torch.Tensor, seg_start: torch.Tensor, scale: float,
                     q_offset: int = 0) -> torch.Tensor:
    with autocast_off(q):
        if _triton(q):
            from lowerings.kernels.indexer_kl import attention_lse as triton_attention_lse

            return triton_attention_lse(q, kv, seg_start, scale, q_offset)
        return attention_lse_reference(q, kv, seg_start, scale, q_offset)


@attention_lse_op.register_fake
def _(q, kv, seg_start, scale, q_offset=0):
    return q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("titan_kimi::indexer_dense_kl", mutates_args=())
def dense_kl_op(iq: torch.Tensor, ik: torch.Tensor, iw: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                lse: torch.Tensor, seg_start: torch.Tensor, q_offset: int, index_scale: float,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL [T], stats [T, 2]: the LSE of the indexer's scores and the target's total mass, for the backward)."""
    with autocast_off(q):
        if _triton(q):
            from lowerings.kernels.indexer_kl import dense_kl

            return dense_kl(iq, ik, iw, q, kv, lse, seg_start, q_offset, index_scale, scale)
        return dense_kl_reference(iq, ik, iw, q, kv, lse, seg_start, q_offset, index_scale, scale)


@dense_kl_op.register_fake
def _(iq, ik, iw, q, kv, lse, seg_start, q_offset, index_scale, scale):
    return q.new_empty(q.shape[:1], dtype=torch.float32), q.new_empty((q.shape[0], 2), dtype=torch.float32)


@torch.library.custom_op("titan_kimi::indexer_dense_kl_backward", mutates_args=())
def dense_kl_backward_op(grad: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor, iw: torch.Tensor,
                         q: torch.Tensor, kv: torch.Tensor, lse: torch.Tensor, seg_start: torch.Tensor,
                         stats: torch.Tensor, q_offset: int, index_scale: float, scale: float) -> list[torch.Tensor]:
    with autocast_off(q):
        if _triton(q):
            from lowerings.kernels.indexer_kl import dense_kl_backward

            grads = dense_kl_backward(grad, iq, ik, iw, q, kv, lse, seg_start, stats, q_offset, index_scale, scale)
            return _as_dtypes(grads, (iq, ik, iw))
        return list(dense_kl_backward_reference(grad, iq, ik, iw, q, kv, lse, seg_start, q_offset, index_scale, scale))


@dense_kl_backward_op.register_fake
def _(grad, iq, ik, iw, q, kv, lse, seg_start, stats, q_offset, index_scale, scale):
    return [torch.empty_like(iq), torch.empty_like(ik), torch.empty_like(iw)]


def _dense_setup(ctx, inputs, output):
    iq, ik, iw, q, kv, lse, seg_start, q_offset, index_scale, scale = inputs
    ctx.save_for_backward(iq, ik, iw, q, kv, lse, seg_start, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.static = (q_offset, index_scale, scale)


def _dense_backward(ctx, grad, grad_stats):
    diq, dik, diw = dense_kl_backward_op(grad.contiguous(), *ctx.saved_tensors, *ctx.static)
    return diq, dik, diw, None, None, None, None, None, None, None


torch.library.register_autograd("titan_kimi::indexer_dense_kl", _dense_backward, setup_context=_dense_setup)


def _as_dtypes(grads, like) -> list[torch.Tensor]:
    return [g.to(t.dtype) for g, t in zip(grads, like)]


# ---------------------------------------------------------------- what the model calls
def _check_main(q: torch.Tensor, kv: torch.Tensor, lse: torch.Tensor | None, op: str) -> None:
    if q.dim() != 3 or kv.dim() != 2 or kv.shape[1] != q.shape[2] or (lse is not None and lse.shape != q.shape[:2]):
        raise ValueError(f"{op} expects q [T,H,D], kv [Tk,D], lse [T,H]; got q {tuple(q.shape)}, "
                         f"kv {tuple(kv.shape)}, lse {None if lse is None else tuple(lse.shape)}")


def _check_indexer(iq: torch.Tensor, ik: torch.Tensor, iw: torch.Tensor, T: int, op: str) -> None:
    if iq.dim() != 3 or iq.shape[0] != T or ik.dim() != 2 or ik.shape[1] != iq.shape[2] or iw.shape != iq.shape[:2]:
        raise ValueError(f"{op} expects iq [T={T},HI,Di], ik [Tk,Di], iw [T,HI]; got iq {tuple(iq.shape)}, "
                         f"ik {tuple(ik.shape)}, iw {tuple(iw.shape)}")


def _check_dense_keys(seg_start: torch.Tensor, T: int, Tk: int, q_offset: int, op: str) -> None:
    if seg_start.shape != (T,) or q_offset < 0 or Tk < q_offset + T:
        raise ValueError(f"{op} expects seg_start [T={T}], q_offset >= 0 and at least q_offset + T keys; got "
                         f"seg_start {tuple(seg_start.shape)}, q_offset {q_offset}, {Tk} keys")


def attention_lse(q: torch.Tensor, kv: torch.Tensor, seg_start: torch.Tensor, *, scale: float,
                  q_offset: int = 0) -> torch.Tensor:
    """``lse [T,H]`` fp32 of ``scale q[t,h].kv[s]`` over keys ``seg_start[t] <= s <= q_offset + t`` (no gradient)."""
    _check_main(q, kv, None, "attention_lse")
    _check_dense_keys(seg_start, q.shape[0], kv.shape[0], q_offset, "attention_lse")
    return attention_lse_op(q.detach().contiguous(), kv.detach().contiguous(), seg_start.to(torch.int32), scale,
                            q_offset)


def sparse_indexer_kl(iq: torch.Tensor, ik: torch.Tensor, iw: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                      lse: torch.Tensor, idx: torch.Tensor, *, index_scale: float, scale: float) -> torch.Tensor:
    """KL_t ``[T]`` fp32 from the main attention at the selected keys ``idx [T,k]`` (int32, -1 = empty; flat
    indices into ``kv`` and ``ik``) to the indexer's softmax over the same keys. ``lse`` is the sparse-MLA
    forward's. Differentiable in ``iq``, ``ik``, ``iw`` only."""
    T = q.shape[0]
    _check_main(q, kv, lse, "sparse_indexer_kl")
    _check_indexer(iq, ik, iw, T, "sparse_indexer_kl")
    if idx.dim() != 2 or idx.shape[0] != T or idx.dtype != torch.int32 or ik.shape[0] != kv.shape[0]:
        raise ValueError(f"sparse_indexer_kl expects int32 idx [T={T},k] and as many indexer keys as latent keys; "
                         f"got idx {idx.dtype} {tuple(idx.shape)}, ik {tuple(ik.shape)}, kv {tuple(kv.shape)}")
    idx = idx.contiguous()
    target = sparse_target_op(q.detach().contiguous(), kv.detach().contiguous(), lse.detach().contiguous(), idx,
                              scale)
    scores = scores_at_op(iq.contiguous(), ik.contiguous(), iw.contiguous(), idx, index_scale)
    return row_kl(target, scores, idx >= 0)


def sparse_mla_distilled(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scores: torch.Tensor,
                         weight: torch.Tensor, *, scale: float, d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sparse_mla(q, kv, idx)`` (``out``, ``lse``) whose backward also gives ``scores [T,k]`` (the indexer's
    scores at ``idx``, from ``indexer_scores_at``) the gradient of ``sum_t weight[t] KL_t``, KL_t as in
    ``sparse_indexer_kl`` with this attention as the target (detached: the KL trains the indexer only). As if
    that sum had been added to the loss; ``out`` and the gradients of ``q`` and ``kv`` are sparse_mla's."""
    T = q.shape[0]
    if q.dim() != 3 or kv.dim() != 2 or kv.shape[1] != q.shape[2] or d_v > q.shape[2]:
        raise ValueError(f"sparse_mla_distilled expects q [T,H,D], kv [S,D], d_v <= D; got q {tuple(q.shape)}, "
                         f"kv {tuple(kv.shape)}, d_v {d_v}")
    if idx.dim() != 2 or idx.shape[0] != T or idx.dtype != torch.int32 or scores.shape != idx.shape or \
            weight.shape != (T,):
        raise ValueError(f"sparse_mla_distilled expects int32 idx [T={T},k], scores [T,k] and weight [T]; got idx "
                         f"{idx.dtype} {tuple(idx.shape)}, scores {tuple(scores.shape)}, weight {tuple(weight.shape)}")
    return sparse_mla_distilled_op(q.contiguous(), kv.contiguous(), idx.contiguous(), scores.contiguous(),
                                   weight.detach().float().contiguous(), scale, d_v)


def indexer_scores_at(iq: torch.Tensor, ik: torch.Tensor, iw: torch.Tensor, idx: torch.Tensor, *,
                      index_scale: float) -> torch.Tensor:
    """The indexer's scores ``[T,k]`` fp32 at ``idx`` (int32, -1 = empty: -inf there), differentiable in
    ``iq``, ``ik``, ``iw``."""
    _check_indexer(iq, ik, iw, iq.shape[0], "indexer_scores_at")
    if idx.dim() != 2 or idx.shape[0] != iq.shape[0] or idx.dtype != torch.int32:
        raise ValueError(f"indexer_scores_at expects int32 idx [T={iq.shape[0]},k]; got {idx.dtype} "
                         f"{tuple(idx.shape)}")
    return scores_at_op(iq.contiguous(), ik.contiguous(), iw.contiguous(), idx.contiguous(), index_scale)


def sparse_kl_from_scores(q: torch.Tensor, kv: torch.Tensor, lse: torch.Tensor, idx: torch.Tensor,
                          scores: torch.Tensor, *, scale: float) -> torch.Tensor:
    """KL_t ``[T]`` of ``sparse_indexer_kl`` from the indexer's scores at ``idx`` (no gradient: the value)."""
    _check_main(q, kv, lse, "sparse_kl_from_scores")
    with torch.no_grad():
        target = sparse_target_op(q.detach().contiguous(), kv.detach().contiguous(), lse.detach().contiguous(),
                                  idx.contiguous(), scale)
        return row_kl(target, scores.detach(), idx >= 0)


def dense_indexer_kl(iq: torch.Tensor, ik: torch.Tensor, iw: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                     lse: torch.Tensor, seg_start: torch.Tensor, *, index_scale: float, scale: float,
                     q_offset: int = 0) -> torch.Tensor:
    """KL_t ``[T]`` fp32 over every causal key of each query's document (``seg_start``, ``q_offset`` as in
    ``attention_lse``; ``lse`` over the same keys). Differentiable in ``iq``, ``ik``, ``iw`` only."""
    T = q.shape[0]
    _check_main(q, kv, lse, "dense_indexer_kl")
    _check_indexer(iq, ik, iw, T, "dense_indexer_kl")
    _check_dense_keys(seg_start, T, kv.shape[0], q_offset, "dense_indexer_kl")
    if ik.shape[0] != kv.shape[0]:
        raise ValueError(f"dense_indexer_kl expects as many indexer keys as latent keys; got ik {tuple(ik.shape)}, "
                         f"kv {tuple(kv.shape)}")
    return dense_kl_op(iq.contiguous(), ik.contiguous(), iw.contiguous(), q.detach().contiguous(),
                       kv.detach().contiguous(), lse.detach().contiguous(), seg_start.to(torch.int32), q_offset,
                       index_scale, scale)[0]


def selected_mass(lse_selected: torch.Tensor, lse_all: torch.Tensor) -> torch.Tensor:
    """``[T]``: the share of each query's main-attention probability mass (averaged over heads) on a key subset,
    from the per-head LSE over the subset and over every key: ``mean_h exp(lse_selected - lse_all)``."""
    share = torch.exp(lse_selected.float() - lse_all.float())
    return torch.nan_to_num(share, nan=0.0).clamp(max=1.0).mean(-1)
