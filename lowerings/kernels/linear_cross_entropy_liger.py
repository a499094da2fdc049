"""Adapter to liger-kernel's fused linear cross-entropy (``liger-kernel==0.8.5``, BSD-2-Clause).

Liger materialises the logits of one token chunk at a time in the inputs' dtype, runs its Triton
cross-entropy kernel in place (loss and softmax - onehot in one pass over the chunk) and projects the chunk's
gradient with two GEMMs, accumulating d/dweight in the weight's dtype (no fp32 ``[V, H]`` buffer). We call its
forward routine directly, which returns the gradients of the summed loss, the project's contract.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
# Liger bounds the transient logits to CHUNK_MEM_CONST x T x H elements. 8 gives 1,024-token chunks at
# k3_small (V / H = 80) and 4,096 at full K3 (V / H = 23): fewer, larger GEMMs and fewer bf16 d/dweight
# accumulations than liger's default of 1 (128-token chunks), for at most ~1.3 GB of bf16 logits.
CHUNK_MEM_CONST = 8


def liger_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, grad_hidden: bool, grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``hidden [T, H]``, ``weight [V, H]`` (CUDA), ``labels [T]`` -> (summed CE fp32, grads or None)."""
    from liger_kernel.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_forward

    need_grads = grad_hidden or grad_weight
    with torch.no_grad():  # liger writes the logits into a reused buffer (mm out=) only outside grad mode
        loss, _, _, _, d_hidden, d_weight, _ = fused_linear_cross_entropy_forward(
            hidden.contiguous(), weight, labels.contiguous(), ignore_index=IGNORE_INDEX, reduction="sum",
            compute_gradients=need_grads, weight_requires_grad=grad_weight, chunk_mem_const=CHUNK_MEM_CONST,
        )
    return loss.float(), d_hidden if grad_hidden else None, d_weight if grad_weight else None
