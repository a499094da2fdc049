"""PatchMergerMLPV2 (spec §10.3): merged tower tokens into the text model's hidden space.

``[n, kh*kw*D] -> Linear -> GELU (erf) -> Linear -> RMSNorm(eps 1e-5)``, no biases; checkpoint names
``mm_projector.proj.0.weight``, ``mm_projector.proj.2.weight``, ``mm_projector.post_norm.weight``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from titan_kimi.models.kimi_k3.init_specs import InitSpec, init_declared
from titan_kimi.models.kimi_k3.vision import VisionRMSNorm, vision_init_specs
from titan_kimi.models.kimi_k3.vision_args import KimiK3VisionArgs


class PatchMergerMLP(nn.Module):
    def __init__(self, args: KimiK3VisionArgs, text_dim: int) -> None:
        super().__init__()
        self.init_std = args.init_std
        width = args.merged_dim
        self.proj = nn.Sequential(nn.Linear(width, width, bias=False), nn.GELU(),
                                  nn.Linear(width, text_dim, bias=False))
        self.post_norm = VisionRMSNorm(text_dim, eps=args.projector_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(x))

    def init_weights(self) -> None:
        init_declared(self)

    def parameter_init_specs(self) -> dict[str, InitSpec]:
        return vision_init_specs(self, self.init_std)
