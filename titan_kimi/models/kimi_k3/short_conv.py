"""Causal depthwise short convolution with SiLU, reset at every segment start (the KDA q/k/v convs)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_kimi.models.kimi_k3.init_specs import InitSpec, init_declared


class ShortConv(nn.Module):
    """``y_t = SiLU(sum_i w[:, W-1-i] x_{t-i})`` over the current segment only; weight ``[C, 1, W]`` in fp32.

    Written as shifted multiply-adds so Inductor fuses it into one pointwise kernel.
    """

    fp32_params = ("weight",)

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))

    def forward(self, x: torch.Tensor, pos_in_seg: torch.Tensor | None,
                halo: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B,S,C]``. ``halo [B,P,W-1,C]`` (context parallelism): ``x`` holds P equal pieces of each row and
        these are the W-1 rows before each piece; without it the rows before the first are zeros."""
        if halo is not None:
            return self._pieces(x, pos_in_seg, halo)
        S = x.shape[1]
        w = self.weight.float().squeeze(1)  # [C, W]; w[:, W-1] multiplies the current token
        xf = x.float()
        y = xf * w[:, -1]
        for shift in range(1, self.kernel_size):
            past = F.pad(xf, (0, 0, shift, 0))[:, :S]
            if pos_in_seg is not None:
                past = past * (pos_in_seg >= shift).unsqueeze(-1)
            y = y + past * w[:, -1 - shift]
        return F.silu(y).to(x.dtype)

    def _pieces(self, x: torch.Tensor, pos_in_seg: torch.Tensor, halo: torch.Tensor) -> torch.Tensor:
        B, S, C = x.shape
        P, n = halo.shape[1], self.kernel_size - 1
        L = S // P
        w = self.weight.float().squeeze(1)
        xf = x.float().reshape(B * P, L, C)
        pos = pos_in_seg.reshape(B * P, L)
        ext = torch.cat([halo.float().reshape(B * P, n, C), xf], dim=1)
        y = xf * w[:, -1]
        for shift in range(1, self.kernel_size):
            # pos_in_seg is the position in the whole segment, so it also masks halo rows of another document
            past = ext[:, n - shift: n - shift + L] * (pos >= shift).unsqueeze(-1)
            y = y + past * w[:, -1 - shift]
        return F.silu(y).to(x.dtype).reshape(B, S, C)

    def parameter_init_specs(self) -> dict[str, InitSpec]:
        # PyTorch's Conv1d default: kaiming_uniform(a=sqrt(5)) == U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        bound = 1.0 / math.sqrt(self.kernel_size)
        return {"weight": InitSpec("uniform", low=-bound, high=bound)}

    def init_weights(self) -> None:
        init_declared(self)
