"""``titan_kimi::router_logits``: the MoE router's fp32 logits ``x.float() @ weight.float().t()``, with the GEMMs on
tensor cores.

Backends (op ``router_logits``): ``reference`` is the formula itself (an fp32 GEMM: on CUDA a SIMT sgemm, TF32
being off); ``tensor_core`` runs the custom ops below when ``x`` and ``weight`` are both bf16 CUDA tensors (other
calls run the reference). The product of two bf16 numbers is exact in fp32, so a bf16 tensor-core GEMM that
accumulates in fp32 and writes fp32 (``torch.mm(..., out_dtype=torch.float32)``) sums the reference's products.
Its accumulation is not IEEE fp32 addition, though: on Hopper its error leans toward zero and grows with the
reduction length, well past the sgemm's at the router's 7,168 columns. The forward therefore sums ``CHUNK``-column slices, each one tensor-core GEMM, in fp32 (error as low as
the sgemm's; tests/test_router_logits.py's GPU test holds it to that). The backward's incoming gradient is fp32:
it is split into two bf16 halves ``hi = g.bfloat16()``, ``lo = (g - hi).bfloat16()`` (about 16 mantissa bits
together, 2^-17 relative), each multiplied the same way (unchunked: the gradients are then rounded to bf16, as the
reference's are by the casts' backward, far coarser than either error). The ops are opaque to Inductor on
purpose: it would lower the fp32 matmul to an sgemm again.
"""

from __future__ import annotations

import torch

from lowerings.autocast import autocast_off, autocast_operands
from lowerings.ops.registry import cuda_available, on_cuda, op_backends, selected_backend

BACKENDS = op_backends("router_logits")
BACKENDS.add("tensor_core", cuda_available, auto_rank=0)

_EMPTY = (0,)
CHUNK = 256  # columns summed inside one tensor-core GEMM: its accumulation error grows with this length
GROUP = 8  # chunks per batched GEMM: bounds the fp32 partial sums to GROUP * T * E (the reference's x.float() at k31)


def _fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # Inside compiled regions too, unlike routed_combine: Inductor has no tensor-core lowering of an fp32 matmul.
    return (selected_backend("router_logits") == "tensor_core" and on_cuda(x)
            and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16)


def router_logits_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    with autocast_off(x):  # the spec's fp32 matmul: autocast would run it in bf16
        return x.float() @ weight.float().t()


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [T, D]``, ``weight [E, D]`` -> fp32 logits ``[T, E]``.

    Under autocast (one device's stand-in for FSDP's ``param_dtype``: fp32 master weights, bf16 compute) both
    operands are first cast to autocast's dtype, as FSDP would hand the weight over; the product is summed in fp32
    either way."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router_logits needs x [T, D] and weight [E, D], got x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)}")
    x, weight = autocast_operands(x, weight)
    if _fused(x, weight):
        return router_logits_op(x, weight)
    return router_logits_reference(x, weight)


# ------------------------------------------------------------------------------------------- the custom ops

def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` summed and returned in fp32: on CUDA one GEMM of the inputs' dtype (bf16: tensor cores, exact
    products) with fp32 accumulation and output; elsewhere (``mm``'s ``out_dtype`` runs on CUDA only) the same
    sum over fp32 copies."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``mm_fp32`` for each matrix of the batches ``a [n, M, K]`` and ``b [n, K, N]``."""
    if a.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def logits_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.t()`` in fp32 with the reduction in ``CHUNK``-column slices, each one ``mm_fp32``, summed in
    fp32 (a batched GEMM over up to ``GROUP`` slices at a time, then a leftover slice narrower than ``CHUNK``)."""
    T, D = x.shape
    E = weight.shape[0]
    out = None
    for start in range(0, D, CHUNK * GROUP):
        stop = min(start + CHUNK * GROUP, D)
        n, tail = divmod(stop - start, CHUNK)
        parts = []
        if n:
            mid = start + n * CHUNK
            xs = x[:, start:mid].reshape(T, n, CHUNK).transpose(0, 1)  # [n, T, CHUNK]
            ws = weight[:, start:mid].reshape(E, n, CHUNK).permute(1, 2, 0)  # [n, CHUNK, E]
            parts.append(bmm_fp32(xs, ws).sum(0))
        if tail:
            parts.append(mm_fp32(x[:, stop - tail:stop], weight[:, stop - tail:stop].t()))
        for part in parts:
            out = part if out is None else out.add_(part)
    return out if out is not None else x.new_zeros((T, E), dtype=torch.float32)


def split_bf16(g: torch.Tensor) -> torch.Tensor:
    """``[hi | lo]`` along the last dim: ``hi = g.bfloat16()``, ``lo = (g - hi).bfloat16()``; ``hi + lo`` is ``g``
    to about 2^-17 relative (a single bf16 cast: 2^-9)."""
    hi = g.bfloat16()
    return torch.cat([hi, (g - hi.float()).bfloat16()], dim=-1)


def split_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, grad_x: bool = True,
                   grad_weight: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The fp32 gradients ``(dx [T, D], dw [E, D])`` of ``x @ weight.t()`` for the fp32 ``grad [T, E]``, before
    any rounding (None where not asked for). Each is one GEMM over both halves: ``[hi | lo] @ [w; w]`` for dx,
    ``[hi | lo]^T @ x`` summed over the halves for dw."""
    halves = split_bf16(grad.float())  # [T, 2E]
    dx = mm_fp32(halves, torch.cat([weight, weight]).to(halves.dtype)) if grad_x else None
    dw = None
    if grad_weight:
        both = mm_fp32(halves.t(), x.to(halves.dtype))  # [2E, D]: the hi and the lo products
        dw = both.view(2, weight.shape[0], -1).sum(0)
    return dx, dw


@torch.library.custom_op("titan_kimi::router_logits", mutates_args=())
def router_logits_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 ``x @ weight.t()`` of bf16 ``x [T, D]`` and ``weight [E, D]``."""
    with autocast_off(x):  # the op sets its own precision
        return logits_fp32(x, weight)


@router_logits_op.register_fake
def _(x, weight):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


@torch.library.custom_op("titan_kimi::router_logits_backward", mutates_args=())
def router_logits_backward_op(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, grad_x: bool,
                              grad_weight: bool) -> list[torch.Tensor]:
    """``[dx, dw]`` in the dtypes of ``x`` and ``weight``; a gradient not asked for is an empty tensor."""
    with autocast_off(x):
        dx, dw = split_backward(grad, x, weight, grad_x, grad_weight)
    return [dx.to(x.dtype) if grad_x else x.new_empty(_EMPTY),
            dw.to(weight.dtype) if grad_weight else weight.new_empty(_EMPTY)]


@router_logits_backward_op.register_fake
def _(grad, x, weight, grad_x, grad_weight):
    return [x.new_empty(x.shape if grad_x else _EMPTY), weight.new_empty(weight.shape if grad_weight else _EMPTY)]


def _setup_context(ctx, inputs, output):
    x, weight = inputs
    ctx.save_for_backward(x, weight)


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x, grad_weight = ctx.needs_input_grad
    dx, dw = router_logits_backward_op(grad, x, weight, grad_x, grad_weight)
    return dx if grad_x else None, dw if grad_weight else None


torch.library.register_autograd("titan_kimi::router_logits", _backward, setup_context=_setup_context)
