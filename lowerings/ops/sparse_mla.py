"""``titan_kimi::sparse_mla``: attention over the selected keys in the absorbed latent (MQA) form."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

import torch

from lowerings.autocast import autocast_off
from lowerings.ops.registry import cuda_available, op_backends, selected_backend

BACKENDS = op_backends("sparse_mla")
BACKENDS.add("dense")
BACKENDS.add("triton", cuda_available, auto_rank=0)


def _cudnn_available() -> str | None:  # sm90, cuDNN frontend's DSA backward and the CuTe-DSL runtime
    from lowerings.kernels.cudnn_sparse_mla_bwd import unavailable_reason

    return unavailable_reason()


# cudnn: our forward (cuDNN has no sm90 sparse forward) with cuDNN's sm90 DSA backward. auto's first choice: at
# T = 8,192, top-2,048 on the H200 its backward takes 26.2 ms against Triton's 45.1 at 96 heads (12.2 / 16.5 at 16)
# with the same error, so forward + backward beats flash_mla's (FlashMLA forward + Triton backward) too
BACKENDS.add("cudnn", _cudnn_available, auto_rank=0)


def _flash_mla_available() -> str | None:  # sm90 and an importable flash_mla (scripts/tools/build_flash_mla.sh)
    from lowerings.kernels.flash_mla_sparse import unavailable_reason

    return unavailable_reason()


# flash_mla: FlashMLA's sm90 sparse prefill forward with our Triton backward (FlashMLA has no sparse backward);
# calls it cannot take (dtype, head dims) run our forward. auto's choice after cudnn: its forward measured 8.0 ms
# against our Gluon kernel's 8.9 at 96 heads (3.8 / 4.5 at 16), the backward being the same
BACKENDS.add("flash_mla", _flash_mla_available, auto_rank=1)


@dataclass(frozen=True)
class SparseMlaKernels:
    """The kernels one ``kernels.sparse_mla`` backend runs on CUDA tensors, per direction."""

    forward: str  # flash_mla, triton, dense or reference
    backward: str  # cudnn, triton, dense or reference


# The rule table the op consults; configure_backends picks the row (the op's resolved backend).
SPARSE_MLA_KERNELS: Mapping[str, SparseMlaKernels] = MappingProxyType({
    "cudnn": SparseMlaKernels(forward="triton", backward="cudnn"),
    "flash_mla": SparseMlaKernels(forward="flash_mla", backward="triton"),
    "triton": SparseMlaKernels(forward="triton", backward="triton"),
    "dense": SparseMlaKernels(forward="dense", backward="dense"),
    "reference": SparseMlaKernels(forward="reference", backward="reference"),
})
CUDA_KERNELS = frozenset({"cudnn", "flash_mla", "triton"})  # CPU tensors run the reference instead
ShapeRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], "str | None"]  # why a call is refused


def _flash_mla_refuses(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, d_v: int) -> str | None:
    from lowerings.kernels.flash_mla_sparse import flash_mla_takes

    return flash_mla_takes(q, kv, idx, d_v)


def _cudnn_refuses(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, d_v: int) -> str | None:
    from lowerings.kernels.cudnn_sparse_mla_bwd import cudnn_takes

    return cudnn_takes(q, kv, idx, d_v)


# The fused kernels that take only some call shapes: kernel -> (its rule, the kernel that runs what it refuses).
# FlashMLA: bf16, Dqk 576, d_v 512, within int32 offsets; cuDNN's backward: bf16 / fp16, (Dqk, d_v) in
# {(576, 512), (512, 512)}, two or more heads, a top-k column.
SHAPE_RULES: Mapping[str, tuple[ShapeRule, str]] = MappingProxyType({
    "flash_mla": (_flash_mla_refuses, "triton"),
    "cudnn": (_cudnn_refuses, "triton"),
})


def _kernel_for(kernel: str, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, d_v: int, cuda: bool) -> str:
    if kernel in CUDA_KERNELS and not cuda:
        return "reference"
    rule = SHAPE_RULES.get(kernel)
    if rule is not None and rule[0](q, kv, idx, d_v) is not None:
        return rule[1]
    return kernel


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


def forward_kernel(backend: str, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, d_v: int,
                   *, cuda: bool | None = None) -> str:
    """The forward ``forward_by_backend`` runs for this call under ``backend`` (its row of ``SPARSE_MLA_KERNELS``, then
    ``SHAPE_RULES``). ``cuda`` (default ``q.is_cuda``) lets tests ask for the GPU decision with CPU tensors."""
    cuda = q.is_cuda if cuda is None else cuda
    return _kernel_for(SPARSE_MLA_KERNELS[backend].forward, q, kv, idx, d_v, cuda)


def backward_kernel(backend: str, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, d_v: int,
                    *, cuda: bool | None = None) -> str:
    """The backward ``sparse_mla_backward_op`` runs for this call under ``backend``, as ``forward_kernel``."""
    cuda = q.is_cuda if cuda is None else cuda
    return _kernel_for(SPARSE_MLA_KERNELS[backend].backward, q, kv, idx, d_v, cuda)


def forward_by_backend(q, kv, idx, scale, d_v):
    """(out, lse) from the forward kernel the resolved ``kernels.sparse_mla`` backend runs for this call."""
    kernel = forward_kernel(selected_backend("sparse_mla"), q, kv, idx, d_v)
    if kernel == "flash_mla":
        from lowerings.kernels.flash_mla_sparse import flash_mla_sparse_forward

        return flash_mla_sparse_forward(q, kv, idx, scale, d_v)
    if kernel == "triton":
        from lowerings.kernels.sparse_mla_fwd import sparse_mla_forward

        return sparse_mla_forward(q, kv, idx, scale, d_v)
    if kernel == "dense":
        return sparse_mla_dense(q, kv, idx, scale, d_v)
    return sparse_mla_reference(q, kv, idx, scale, d_v)


@torch.library.custom_op("titan_kimi::sparse_mla", mutates_args=())
def sparse_mla_op(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    with autocast_off(q):  # the op sets its own precision (the reference and dense forms: fp32)
        return forward_by_backend(q, kv, idx, scale, d_v)


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
    kernel = backward_kernel(selected_backend("sparse_mla"), q, kv, idx, d_v)
    with autocast_off(q):
        if kernel == "cudnn":
            from lowerings.kernels.cudnn_sparse_mla_bwd import cudnn_sparse_mla_backward

            return list(cudnn_sparse_mla_backward(d_out, q, kv, idx, out, lse, scale, d_v))
        if kernel == "triton":  # also flash_mla's backward (FlashMLA has none): ours reads its out and lse
            from lowerings.kernels.sparse_mla_bwd import sparse_mla_backward

            return list(sparse_mla_backward(d_out, q, kv, idx, out, lse, scale, d_v))
        forward = sparse_mla_dense if kernel == "dense" else sparse_mla_reference
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
