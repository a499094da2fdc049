"""Causal depthwise short convolution with SiLU, reset at every segment start (the KDA q/k/v convs)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from lowerings import ops
from titan_kimi.models.kimi_k3.init_specs import InitSpec, init_declared


class ShortConv(nn.Module):
    """``y_t = SiLU(sum_i w[:, W-1-i] x_{t-i})`` over the current segment only; weight ``[C, 1, W]`` in fp32.

    The op ``lowerings.ops.short_conv`` (its reference is this formula as shifted multiply-adds, which Inductor
    fuses into one pointwise kernel); under context parallelism each piece runs it with the previous rank's rows.
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
        return ops.short_conv(x, self.weight, pos_in_seg)

    def _pieces(self, x: torch.Tensor, pos_in_seg: torch.Tensor, halo: torch.Tensor) -> torch.Tensor:
        # Each piece with its halo rows in front is one row of the op; pos_in_seg is the position in the whole
        # segment, so it also masks halo rows of another document. The halo rows' own outputs are dropped.
        B, S, C = x.shape
        P, n = halo.shape[1], self.kernel_size - 1
        L = S // P
        ext = torch.cat([halo.reshape(B * P, n, C).to(x.dtype), x.reshape(B * P, L, C)], dim=1)
        pos = pos_in_seg.reshape(B * P, L)
        pos_ext = torch.cat([pos.new_zeros(B * P, n), pos], dim=1)
        return ops.short_conv(ext, self.weight, pos_ext)[:, n:].reshape(B, S, C)

    def parameter_init_specs(self) -> dict[str, InitSpec]:
        # PyTorch's Conv1d default: kaiming_uniform(a=sqrt(5)) == U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        bound = 1.0 / math.sqrt(self.kernel_size)
        return {"weight": InitSpec("uniform", low=-bound, high=bound)}

    def init_weights(self) -> None:
        init_declared(self)
