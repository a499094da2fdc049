"""The reference linear cross-entropy: chunks of tokens, logits for one chunk at a time in fp32.

Runs anywhere (the CPU path) and is what every fused backend is tested against. Returns the loss summed over
valid tokens and, only when asked, the gradients of that sum; no gradient work or buffer exists otherwise.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def linear_cross_entropy_reference(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
    grad_hidden: bool, grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``hidden [T, H]``, ``weight [V, H]``, ``labels [T]`` -> (summed CE fp32, d/dhidden or None, d/dweight or None)."""
    tokens = hidden.shape[0]
    need_grads = grad_hidden or grad_weight
    d_hidden = torch.empty_like(hidden) if grad_hidden else None
    # fp32 accumulation over chunks: the reference's precision, not a fused backend's memory budget.
    d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grad_weight else None
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
        if not need_grads:
            continue
        # d(sum CE)/d(logits) = softmax - onehot on valid rows, 0 on ignored ones.
        grad_logits = torch.exp(logits - lse.unsqueeze(1))
        grad_logits.scatter_add_(1, target.unsqueeze(1), torch.full_like(picked, -1.0).unsqueeze(1))
        grad_logits = grad_logits * valid.unsqueeze(1)
        if d_hidden is not None:
            d_hidden[start : start + chunk_size] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
        if d_weight is not None:
            d_weight += grad_logits.t() @ h.float()
    return total, d_hidden, None if d_weight is None else d_weight.to(weight.dtype)
