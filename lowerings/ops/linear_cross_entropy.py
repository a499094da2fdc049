"""Chunked linear + cross-entropy: logits exist for one chunk of tokens at a time, never the whole batch.

The forward computes, chunk by chunk, the loss and the gradients with respect to the hidden states and the
lm_head weight; backward only scales them. Peak memory is one ``[chunk, vocab]`` fp32 block, whatever the
sequence length (spec: ChunkedCrossEntropy, 512-token chunks).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size: int, normalizer):
        tokens, _ = hidden.shape
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, tokens, chunk_size):
            h = hidden[start : start + chunk_size]
            y = labels[start : start + chunk_size]
            logits = (h @ weight.t()).float()
            valid = y != IGNORE_INDEX
            target = torch.where(valid, y, 0)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, target.unsqueeze(1)).squeeze(1)
            total = total + torch.where(valid, lse - picked, 0.0).sum()
            # d(loss)/d(logits) = softmax - onehot on valid rows, already divided by the normaliser.
            grad_logits = torch.exp(logits - lse.unsqueeze(1))
            grad_logits.scatter_add_(1, target.unsqueeze(1), torch.full_like(picked, -1.0).unsqueeze(1))
            grad_logits = grad_logits * (valid.unsqueeze(1) / normalizer)
            grad_hidden[start : start + chunk_size] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            grad_weight += grad_logits.t() @ h.float()
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return total / normalizer

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_output.to(grad_hidden.dtype), grad_weight * grad_output.to(grad_weight.dtype), None, None, None


def chunked_linear_cross_entropy(
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
    ranks gives the global mean.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree")
    normalizer = torch.as_tensor(normalizer, dtype=torch.float32, device=hidden.device).clamp(min=1)
    return _ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk_size, normalizer
    )
