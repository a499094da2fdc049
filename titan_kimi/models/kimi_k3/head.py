"""The lm_head: logits, or (for the training loss) the fused linear cross-entropy op, in which logits never exist
for the whole batch."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from lowerings import ops
from titan_kimi.models.kimi_k3.init_specs import InitSpec, init_declared
from titan_kimi.models.kimi_k3.weights import linear_weight


class LMHead(nn.Module):
    """``forward(hidden)`` -> logits; ``forward(hidden, labels, normalizer=N)`` -> summed CE / N.

    The model's forward only produces logits; the training loss (``titan_kimi.training.loss``) calls the head
    with labels, through ``forward`` so that FSDP's hooks see every use of the weight.
    """

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        normalizer: torch.Tensor | float | None = None,
        chunk_size: int = 512,
    ) -> torch.Tensor:
        weight = linear_weight(self)
        if labels is None:
            return hidden @ weight.t()
        if normalizer is None:
            normalizer = (labels != ops.IGNORE_INDEX).sum()
        return ops.linear_cross_entropy(hidden, weight, labels, normalizer=normalizer, chunk_size=chunk_size)

    def parameter_init_specs(self) -> dict[str, InitSpec]:
        std = 1.0 / math.sqrt(self.weight.shape[1])  # spec §14: truncated normal, std H^-1/2, cutoff 3 std
        return {"weight": InitSpec("trunc_normal", std=std, low=-3 * std, high=3 * std)}

    def init_weights(self) -> None:  # this class's weight: an adapter subclass draws its factors on reset
        init_declared(self, LMHead.parameter_init_specs(self))
