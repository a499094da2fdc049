"""SiTU-GLU feed-forward (spec §7.1), used by the dense layer 0 and the shared experts."""

from __future__ import annotations

import torch
import torch.nn as nn

from lowerings import ops
from titan_kimi.models.kimi_k3.init_specs import init_linear


class SituMLP(nn.Module):
    """``down(SiTU-GLU([gate | up](x)))``; gate and up are separate checkpoint tensors, one matmul here."""

    def __init__(self, dim: int, hidden: int, beta: float, beta_lin: float, init_std: float) -> None:
        super().__init__()
        self.hidden = hidden
        self.beta, self.beta_lin, self.init_std = beta, beta_lin, init_std
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=False)  # rows [gate | up]
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.situ_glu(self.gate_up_proj(x), self.beta, self.beta_lin))

    def init_weights(self) -> None:
        init_linear(self.gate_up_proj, self.init_std)
        init_linear(self.down_proj, self.init_std)
