"""The training loss, applied by the loop (or by the last pipeline stage) to the model's final hidden states.

The model returns normed hidden states; the loss runs the lm_head fused with the cross-entropy
(``lowerings.ops.linear_cross_entropy``, backend ``kernels.linear_cross_entropy``), so ``[tokens, vocab]``
logits never exist; ``training.loss_chunk_size`` is the reference backend's token chunk. It calls the head
module (not its weight) so that FSDP's hooks gather the sharded weight and reduce its gradient, and so that
``compile.components = ["loss"]`` compiles it (``titan_kimi.parallel.compile``).
"""

from __future__ import annotations

import torch
import torch.nn as nn


class LinearCrossEntropyLoss:
    """``loss(head, hidden [B,S,H], labels [B,S], normalizer)`` = summed CE over tokens whose label is not
    -100, divided by ``normalizer``: the step's global count of valid tokens (every micro-batch, pipeline
    microbatch and data-parallel rank), so that per-rank losses and gradients simply sum to the global mean."""

    def __init__(self, chunk_size: int) -> None:
        if chunk_size < 1:
            raise ValueError(f"training.loss_chunk_size = {chunk_size} must be >= 1")
        self.chunk_size = chunk_size

    def __call__(self, head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                 normalizer: torch.Tensor | float) -> torch.Tensor:
        if not torch.is_tensor(normalizer):  # a fill, not a host-to-device copy (which waits for the stream)
            normalizer = torch.full((), float(normalizer), dtype=torch.float32, device=hidden.device)
        return head(hidden, labels, normalizer=normalizer, chunk_size=self.chunk_size)
