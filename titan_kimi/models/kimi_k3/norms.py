"""Normalisation layers of the text model."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_kimi.models.kimi_k3.init_specs import InitSpec, init_declared

_ONES = {"weight": InitSpec("constant", value=1.0)}


class RMSNorm(nn.Module):
    """Kimi RMSNorm: normalise in fp32, round to the input dtype, then multiply by the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return self.weight.to(x.dtype) * normed

    def parameter_init_specs(self) -> dict[str, InitSpec]:
        return _ONES

    def init_weights(self) -> None:
        init_declared(self)


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim times sigmoid(gate), computed in fp32 (FLA FusedRMSNormGated, sigmoid)."""

    fp32_params = ("weight",)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (normed * torch.sigmoid(gate.float())).to(x.dtype)

    def parameter_init_specs(self) -> dict[str, InitSpec]:
        return _ONES

    def init_weights(self) -> None:
        init_declared(self)


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm with weight and bias, computed in fp32 and cast back (the indexer key norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() if self.weight is not None else None
        bias = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)

    def parameter_init_specs(self) -> dict[str, InitSpec]:  # nn.LayerNorm's reset_parameters
        return {"weight": InitSpec("constant", value=1.0), "bias": InitSpec("constant", value=0.0)}

    def init_weights(self) -> None:
        init_declared(self)
