"""Reading a layer's weight matrix directly, adapter-aware.

Most layers compute through their modules (``self.q_proj(x)``), so an adapter that replaces the module's
forward (LoRA) sees every use. A few read the matrix itself: DSA's absorbed ``kv_b_proj``, the router's gate
(fp32 logits) and the lm_head (chunked cross-entropy). They read it through ``linear_weight``, which returns the
adapted weight ``W + scale * B A`` when the module carries an adapter (``merged_weight()``), else ``W``: no
layer can bypass an adapter.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The weight ``[out, in]`` the module's layer multiplies by, including any adapter on it."""
    merged = getattr(module, "merged_weight", None)
    return merged() if merged is not None else module.weight
