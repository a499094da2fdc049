"""``titan_kimi::sparse_mla``: attention over the selected keys in the absorbed latent (MQA) form."""

from __future__ import annotations

import torch

from lowerings.ops.registry import cuda_available, not_built, op_backends, selected_backend

BACKENDS = op_backends("sparse_mla")
BACKENDS.add("dense")
BACKENDS.add("triton", cuda_available, auto_rank=0)
BACKENDS.add("cudnn", not_built("the cuDNN frontend sparse-attention backend"))
BACKENDS.add("flash_mla", not_built("the FlashMLA sparse forward (used only where a flash_mla module is importable)"))


def _softmax_attend(scores: torch.Tensor, values: torch.Tensor, equation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim of masked fp32 scores; empty rows give zeros and lse = -inf."""
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1).masked_fill(torch.isinf(lse).unsqueeze(-1), 0.0))
    return torch.einsum(equation, p, values), lse


def sparse_mla_reference(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather form: each query reads only its selected latent rows."""
    valid = idx >= 0
    rows = kv.float()[idx.long().clamp(min=0)]  # [T, k, Dqk]
    scores = torch.einsum("thd,tkd->thk", q.float(), rows) * scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    out, lse = _softmax_attend(scores, rows[..., :d_v], "thk,tkd->thd")
    return out.to(q.dtype), lse


def sparse_mla_dense(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense-masked form: full [T, H, T] scores with everything but the selected keys masked out."""
    T = q.shape[0]
    S = kv.shape[0]
    # -1 slots scatter into a spare column S that is dropped, so they cannot clear a real selection.
    allowed = torch.zeros(T, S + 1, dtype=torch.bool, device=q.device)
    allowed.scatter_(1, torch.where(idx >= 0, idx.long(), S), True)
    allowed = allowed[:, :S]
    scores = torch.einsum("thd,sd->ths", q.float(), kv.float()) * scale
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    out, lse = _softmax_attend(scores, kv.float()[:, :d_v], "ths,sd->thd")
    return out.to(q.dtype), lse


def _forward(q, kv, idx, scale, d_v):
    backend = selected_backend("sparse_mla")
    if backend == "triton" and q.is_cuda:
        from lowerings.kernels.sparse_mla_fwd import sparse_mla_forward

        return sparse_mla_forward(q, kv, idx, scale, d_v)
    if backend == "dense":
        return sparse_mla_dense(q, kv, idx, scale, d_v)
    return sparse_mla_reference(q, kv, idx, scale, d_v)


@torch.library.custom_op("titan_kimi::sparse_mla", mutates_args=())
def sparse_mla_op(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, kv, idx, scale, d_v)


@sparse_mla_op.register_fake
def _(q, kv, idx, scale, d_v):
    T, H, _ = q.shape
    return q.new_empty((T, H, d_v)), q.new_empty((T, H), dtype=torch.float32)


@torch.library.custom_op("titan_kimi::sparse_mla_backward", mutates_args=())
def sparse_mla_backward_op(
    d_out: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    d_v: int,
) -> list[torch.Tensor]:
    """Gradients for (q, kv). Fused backends reuse ``out`` and ``lse``; the reference recomputes."""
    backend = selected_backend("sparse_mla")
    if backend == "triton" and q.is_cuda:
        from lowerings.kernels.sparse_mla_bwd import sparse_mla_backward

        return list(sparse_mla_backward(d_out, q, kv, idx, out, lse, scale, d_v))
    forward = sparse_mla_dense if backend == "dense" else sparse_mla_reference
    with torch.enable_grad():
        _, vjp = torch.func.vjp(lambda q_, kv_: forward(q_, kv_, idx, scale, d_v)[0], q, kv)
    return [g.contiguous() for g in vjp(d_out)]


@sparse_mla_backward_op.register_fake
def _(d_out, q, kv, idx, out, lse, scale, d_v):
    return [torch.empty_like(q), torch.empty_like(kv)]


def _setup_context(ctx, inputs, output):
    q, kv, idx, scale, d_v = inputs
    out, lse = output
    ctx.save_for_backward(q, kv, idx, out, lse)
    ctx.mark_non_differentiable(lse)
    ctx.static = (scale, d_v)


def _backward(ctx, d_out, d_lse):
    q, kv, idx, out, lse = ctx.saved_tensors
    dq, dkv = sparse_mla_backward_op(d_out.contiguous(), q, kv, idx, out, lse, *ctx.static)
    return dq, dkv, None, None, None


torch.library.register_autograd("titan_kimi::sparse_mla", _backward, setup_context=_setup_context)


def sparse_mla(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, *, scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T,H,D]`` attends to ``kv [S,D]`` rows listed in ``idx [T,k]``; returns ``out [T,H,d_v]``, ``lse [T,H]``.

    ``lse`` is not differentiable.
    """
    if q.dim() != 3 or kv.dim() != 2 or kv.shape[1] != q.shape[2] or idx.shape[0] != q.shape[0] or d_v > q.shape[2]:
        raise ValueError(
            f"sparse_mla expects q [T,H,D], kv [S,D], idx [T,k], d_v <= D; got q {tuple(q.shape)}, "
            f"kv {tuple(kv.shape)}, idx {tuple(idx.shape)}, d_v {d_v}"
        )
    if idx.dtype != torch.int32:
        raise ValueError(f"sparse_mla needs int32 indices, got {idx.dtype}")
    return sparse_mla_op(q.contiguous(), kv.contiguous(), idx.contiguous(), scale, d_v)
