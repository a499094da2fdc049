"""``titan_kimi::linear_cross_entropy``: the lm_head GEMM fused with the cross-entropy, logits never whole.

Contract of the op: ``(hidden [T, H], weight [V, H], labels [T], chunk_size, grad_hidden, grad_weight)`` ->
``(loss_sum, d_hidden, d_weight)``: the CE summed over tokens whose label is not -100, and the gradients of
that sum computed in the same pass (the loss is the graph's last node, so its upstream gradient is a scalar:
backward only scales them). A gradient not asked for is an empty tensor and costs nothing, so under no-grad
(validation) or with a frozen head the op computes only the loss. The division by the normaliser stays outside
the op, in plain autograd, so the backward's one scale is ``grad_output / normalizer``.

Backends (``kernels.linear_cross_entropy``): ``reference`` (chunked fp32 math, the CPU path and the numerics
reference; ``chunk_size`` = ``training.loss_chunk_size`` is its token chunk) and ``liger`` (liger-kernel's chunked fused
linear CE, CUDA tensors only; everything else runs the reference). Apple's cut-cross-entropy was measured too and
dropped: on the H200 at k3_small it took 88.7 ms fwd+bwd against liger's 28.2 ms, with a 2e-2 relative error on
the hidden-state gradient against liger's 5e-4 (docs/perf.md).
"""

from __future__ import annotations

import torch

from lowerings.autocast import autocast_off, autocast_operands
from lowerings.ops.linear_cross_entropy_reference import IGNORE_INDEX, linear_cross_entropy_reference
from lowerings.ops.registry import all_of, cuda_available, module_available, on_cuda, op_backends, selected_backend

BACKENDS = op_backends("linear_cross_entropy")
# liger on CUDA (measured on the H200: 28.2 ms fwd+bwd at k3_small, 5.9x the reference op; its three GEMMs per
# chunk are cuBLAS). scripts/bench/linear_cross_entropy.py prints the fastest backend per shape.
BACKENDS.add("liger", all_of(cuda_available, module_available("liger_kernel")), auto_rank=0)

_EMPTY = (0,)
# The fused backend syncs with the host (liger reads the count of valid labels with .item()): the tag makes Inductor's graph partitioning (reduce-overhead) run the op between CUDA
# graphs, never inside one. One op of a few long kernels per step: nothing to gain from capturing it.
_OUTSIDE_CUDA_GRAPHS = (torch._C.Tag.cudagraph_unsafe,)


def _run_backend(hidden, weight, labels, chunk_size, grad_hidden, grad_weight):
    backend = selected_backend("linear_cross_entropy")
    fused = backend != "reference" and on_cuda(hidden)
    if fused and backend == "liger":
        from lowerings.kernels.linear_cross_entropy_liger import liger_linear_cross_entropy

        return liger_linear_cross_entropy(hidden, weight, labels, grad_hidden, grad_weight)
    # CPU, or the reference backend.
    return linear_cross_entropy_reference(hidden, weight, labels, chunk_size, grad_hidden, grad_weight)


@torch.library.custom_op("titan_kimi::linear_cross_entropy", mutates_args=(), tags=_OUTSIDE_CUDA_GRAPHS)
def linear_cross_entropy_op(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int, grad_hidden: bool,
    grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The backends choose their own precision (bf16 GEMMs, fp32 softmax): autocast (whose casts the wrapper has
    # already applied to the operands) must not recast their inner matmuls.
    with autocast_off(hidden):
        loss, d_hidden, d_weight = _run_backend(hidden, weight, labels, chunk_size, grad_hidden, grad_weight)
    # Contiguous whatever the inputs' strides, as the fake says (compiled graphs check output strides).
    return (loss,
            d_hidden.to(hidden.dtype).contiguous() if grad_hidden else hidden.new_empty(_EMPTY),
            d_weight.to(weight.dtype).contiguous() if grad_weight else weight.new_empty(_EMPTY))


@linear_cross_entropy_op.register_fake
def _(hidden, weight, labels, chunk_size, grad_hidden, grad_weight):
    return (hidden.new_empty((), dtype=torch.float32),
            hidden.new_empty(hidden.shape) if grad_hidden else hidden.new_empty(_EMPTY),
            weight.new_empty(weight.shape) if grad_weight else weight.new_empty(_EMPTY))


def _setup_context(ctx, inputs, output):
    _, d_hidden, d_weight = output
    _, _, _, _, grad_hidden, grad_weight = inputs
    ctx.mark_non_differentiable(d_hidden, d_weight)
    ctx.save_for_backward(d_hidden, d_weight)
    ctx.wanted = (grad_hidden, grad_weight)


def _backward(ctx, grad_loss, _grad_d_hidden, _grad_d_weight):
    d_hidden, d_weight = ctx.saved_tensors
    grad_hidden, grad_weight = ctx.wanted
    return (d_hidden * grad_loss.to(d_hidden.dtype) if grad_hidden else None,
            d_weight * grad_loss.to(d_weight.dtype) if grad_weight else None,
            None, None, None, None)


torch.library.register_autograd("titan_kimi::linear_cross_entropy", _backward, setup_context=_setup_context)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    normalizer: torch.Tensor | float,
    chunk_size: int = 512,
) -> torch.Tensor:
    """``sum_t CE(hidden_t @ weight^T, labels_t) / normalizer`` over tokens whose label is not -100.

    ``hidden [..., H]``, ``labels [...]``. ``normalizer`` is the number of valid tokens over the whole
    optimizer step (all micro-batches and data-parallel ranks), so summing the per-micro-batch losses over
    ranks gives the global mean. ``chunk_size`` is the reference backend's token chunk.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} disagree on the hidden size")
    normalizer = torch.as_tensor(normalizer, dtype=torch.float32, device=hidden.device).clamp(min=1)
    hidden, weight = autocast_operands(hidden, weight)  # the fused backends see one half-precision dtype
    grads = torch.is_grad_enabled()
    loss_sum, _, _ = linear_cross_entropy_op(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk_size,
        grads and hidden.requires_grad, grads and weight.requires_grad,
    )
    return loss_sum / normalizer

