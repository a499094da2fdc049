"""Attention Residuals (spec §6): a learned softmax mix over the block bank and the current partial sum."""

from __future__ import annotations

import torch
import torch.nn as nn

from lowerings import ops
from titan_kimi.models.kimi_k3.init_specs import InitSpec, init_declared


class AttnResMix(nn.Module):
    """z_i = proj(RMSNorm_fp32(v_i)); out = sum_i softmax(z)_i v_i over v = (bank entries..., partial)."""

    def __init__(self, dim: int, eps: float, init_std: float) -> None:
        super().__init__()
        self.eps = eps
        self.init_std = init_std
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.proj_weight = nn.Parameter(torch.empty(1, dim))  # [1, H] like the checkpoint's Linear(H, 1)

    def forward(self, bank: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        """``bank [B*S, m, H]``, ``partial [B, S, H]`` -> ``[B, S, H]``."""
        B, S, H = partial.shape
        out = ops.attn_res_mix(bank, partial.reshape(B * S, H), self.norm_weight, self.proj_weight, self.eps)
        return out.view(B, S, H)

    def parameter_init_specs(self) -> dict[str, InitSpec]:
        return {"norm_weight": InitSpec("constant", value=1.0), "proj_weight": InitSpec("normal", std=self.init_std)}

    def init_weights(self) -> None:
        init_declared(self)
