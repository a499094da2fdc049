"""Adapter to Apple's cut-cross-entropy (``cut-cross-entropy==25.1.1``, Apple sample-code licence: use, modify
and redistribute allowed): Triton kernels that never materialise logits.

The forward kernel computes each row's logsumexp over vocabulary blocks in SRAM; the backward kernel
recomputes the logits block by block and accumulates d/dhidden and d/dweight (in the inputs' dtype, under
locks), so no ``[T, V]`` or fp32 ``[V, H]`` buffer exists. We call the package's kernels directly rather than
its autograd Function, so that the gradients of the summed loss come out of one call inside our custom op
(the project's contract: grads computed in the forward, backward only scales them).

``filter_eps``: None computes every gradient block (exact); a float skips the vocabulary blocks whose softmax
is below it everywhere (the paper's gradient filtering, faster, opt-in as ``cce_filtered``).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
HALF_DTYPES = (torch.bfloat16, torch.float16)  # the backward kernel asserts a half-precision hidden


def cce_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, grad_hidden: bool, grad_weight: bool,
    filter_eps: float | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``hidden [T, H]`` (bf16/fp16, CUDA), ``weight [V, H]``, ``labels [T]`` -> (summed CE fp32, grads or None)."""
    from cut_cross_entropy.cce_backward import cce_backward_kernel
    from cut_cross_entropy.cce_lse_forward import cce_lse_forward_kernel
    from cut_cross_entropy.indexed_dot import indexed_neg_dot_forward_kernel

    if hidden.dtype not in HALF_DTYPES:
        raise ValueError(f"cut-cross-entropy needs a bf16/fp16 hidden, got {hidden.dtype}")
    e = hidden.contiguous()
    labels = labels.contiguous()
    valid = labels != IGNORE_INDEX
    rows = valid.nonzero().squeeze(1).to(torch.int32)  # host sync: the kernels' grid is the valid-row count
    if rows.numel() == 0:
        return (hidden.new_zeros((), dtype=torch.float32),
                torch.zeros_like(hidden) if grad_hidden else None,
                torch.zeros_like(weight) if grad_weight else None)
    valids = None if rows.numel() == labels.numel() else rows
    need_grads = grad_hidden or grad_weight
    filtered = need_grads and filter_eps is not None
    out = cce_lse_forward_kernel(e, weight, valids, softcap=None, return_logit_avg=filtered)
    lse, logit_avg = out if filtered else (out, None)
    neg_dot = indexed_neg_dot_forward_kernel(e, weight, labels, False, valids, None, lse.dtype)
    loss = (neg_dot + lse).sum()
    if not need_grads:
        return loss, None, None
    # Filtering visits the vocabulary in order of average logit so that skipped blocks cluster.
    ordering = torch.argsort(logit_avg).to(torch.int32) if logit_avg is not None else None
    c = weight.detach().requires_grad_(grad_weight)  # the kernel writes d/dweight only when c requires grad
    d_hidden, d_weight = cce_backward_kernel(
        torch.ones((), dtype=torch.float32, device=e.device), e, c, lse, valids, None, filter_eps,
        targets=labels, shift=False, vocab_ordering=ordering, grad_scale=1.0,
    )
    return loss, d_hidden if grad_hidden else None, d_weight if grad_weight else None


def filter_eps_for(dtype: torch.dtype) -> float:
    """The package's "high" threshold: a 32nd of the dtype's epsilon (bf16: 2.4e-4)."""
    return torch.finfo(dtype).eps / 32
