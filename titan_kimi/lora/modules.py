"""LoRA adapters: ``W x + scale * B A dropout(x)`` with ``scale = alpha / rank``, A ``[r, in]``, B ``[out, r]``.

An adapted module keeps its class's behaviour and its base parameters under their own names (so checkpoints,
FSDP and the HF key plans see the same model); ``add_adapter`` swaps it to the adapter subclass and adds the
factors, named as PEFT names them (``<module>.lora_A.weight``, ``<module>.lora_B.weight``):

- ``nn.Linear`` -> ``LoRALinear``: the low-rank path in ``forward``, and ``merged_weight()`` for layers that read
  the matrix itself (``titan_kimi.models.kimi_k3.weights.linear_weight``);
- ``LMHead`` -> ``LoRALMHead``: the head reads its weight through ``linear_weight``, so only ``merged_weight()``;
- ``GroupedExperts`` -> ``LoRAGroupedExperts``: per-expert factors stacked like the experts (``lora_A_w13
  [E, r, L]``, ``lora_B_w13 [E, 2F, r]``, ``lora_A_w2 [E, r, F]``, ``lora_B_w2 [E, L, r]``), applied inside the
  grouped GEMMs; their leading expert dim shards with the experts under expert parallelism.

B starts at zero, so an adapted model computes exactly what the base model does until it trains.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from lowerings import ops
from lowerings.autocast import matmul_dtype
from lowerings.ops.expert_gemm import grouped_mm
from titan_kimi.models.kimi_k3.head import LMHead
from titan_kimi.models.kimi_k3.init_specs import InitSpec, init_declared
from titan_kimi.models.kimi_k3.moe import GroupedExperts
from titan_kimi.models.kimi_k3.state_dict_adapter import is_adapter_key


class _LoRAMixin:
    """Shared by the adapter subclasses: scale, dropout, and the ``W + scale * B A`` merge of one matrix."""

    lora_rank: int
    lora_alpha: float
    scaling: float

    def _setup(self, rank: int, alpha: float, dropout: float) -> None:
        self.lora_rank, self.lora_alpha, self.scaling = rank, alpha, alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()


def _factor(rows: int, cols: int, like: torch.Tensor) -> nn.Linear:
    return nn.Linear(cols, rows, bias=False, device=like.device, dtype=like.dtype)


def _a_spec(fan_in: int) -> InitSpec:
    """Kaiming uniform with a = sqrt(5), as ``reset_lora_parameters`` draws A: U(+-1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    return InitSpec("uniform", low=-bound, high=bound)


class _MatrixLoRAMixin(_LoRAMixin):
    """One matrix ``weight`` with factors ``lora_A`` / ``lora_B`` (``nn.Linear`` modules, as PEFT names them)."""

    weight: nn.Parameter
    lora_A: nn.Linear
    lora_B: nn.Linear

    def merged_weight(self) -> torch.Tensor:
        return self.weight + (self.lora_B.weight @ self.lora_A.weight).to(self.weight.dtype) * self.scaling

    def factor_init_specs(self) -> dict[str, InitSpec]:
        """A like PEFT, B = 0."""
        return {"lora_A.weight": _a_spec(self.lora_A.weight.shape[1]), "lora_B.weight": InitSpec("constant")}

    def reset_lora_parameters(self) -> None:
        init_declared(self, self.factor_init_specs())

    def parameter_init_specs(self) -> dict[str, InitSpec]:
        """The base module's own specs, then the factors'."""
        base = getattr(super(), "parameter_init_specs", None)
        return {**(base() if base is not None else {}), **self.factor_init_specs()}


class LoRALinear(_MatrixLoRAMixin, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


class LoRALMHead(_MatrixLoRAMixin, LMHead):
    """The head reads its weight through ``linear_weight``: ``merged_weight()`` is the whole adapter."""


class LoRAGroupedExperts(_LoRAMixin, GroupedExperts):
    lora_A_w13: nn.Parameter
    lora_B_w13: nn.Parameter
    lora_A_w2: nn.Parameter
    lora_B_w2: nn.Parameter

    def run(self, w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor,
            num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        dtype = matmul_dtype(x)  # as the base experts: autocast's dtype when it is on
        x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
        # Under expert parallelism the factors are Shard(0) DTensors like the experts: use the local experts'.
        factors = [p.to_local() if isinstance(p, DTensor) else p
                   for p in (self.lora_A_w13, self.lora_B_w13, self.lora_A_w2, self.lora_B_w2)]
        a13, b13, a2, b2 = (p.to(dtype) for p in factors)
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)

        def low_rank(v: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            down = grouped_mm(self.lora_dropout(v), a.transpose(-2, -1), offsets)
            return grouped_mm(down, b.transpose(-2, -1), offsets) * self.scaling

        h = grouped_mm(x, w13.transpose(-2, -1), offsets) + low_rank(x, a13, b13)
        h = ops.situ_glu(h, self.beta, self.beta_lin)
        return grouped_mm(h, w2.transpose(-2, -1), offsets) + low_rank(h, a2, b2)

    def merged_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 + scale * B13 A13, w2 + scale * B2 A2)``, expert by expert."""
        d13 = torch.bmm(self.lora_B_w13, self.lora_A_w13) * self.scaling
        d2 = torch.bmm(self.lora_B_w2, self.lora_A_w2) * self.scaling
        return self.w13 + d13.to(self.w13.dtype), self.w2 + d2.to(self.w2.dtype)

    def factor_init_specs(self) -> dict[str, InitSpec]:
        """Each expert's A like a Linear's (fan-in = its input width), B = 0."""
        return {"lora_A_w13": _a_spec(self.lora_A_w13.shape[2]), "lora_B_w13": InitSpec("constant"),
                "lora_A_w2": _a_spec(self.lora_A_w2.shape[2]), "lora_B_w2": InitSpec("constant")}

    def reset_lora_parameters(self) -> None:
        init_declared(self, self.factor_init_specs())

    def parameter_init_specs(self) -> dict[str, InitSpec]:
        """The experts' own specs, then the factors'."""
        return {**super().parameter_init_specs(), **self.factor_init_specs()}


_ADAPTER_CLASSES: dict[type, type] = {nn.Linear: LoRALinear, LMHead: LoRALMHead, GroupedExperts: LoRAGroupedExperts}
ADAPTER_TYPES = tuple(_ADAPTER_CLASSES.values())


def can_adapt(module: nn.Module) -> bool:
    return type(module) in _ADAPTER_CLASSES


def add_adapter(module: nn.Module, rank: int, alpha: float, dropout: float) -> nn.Module:
    """Turn ``module`` (an ``nn.Linear``, ``LMHead`` or ``GroupedExperts``) into its adapter subclass in place;
    the factors are created on the base weight's device and dtype (meta for a model not yet materialised)."""
    cls = type(module)
    if cls not in _ADAPTER_CLASSES:
        raise ValueError(f"cannot add a LoRA adapter to a {cls.__name__}; adaptable: "
                         f"{sorted(c.__name__ for c in _ADAPTER_CLASSES)}")
    if rank < 1:
        raise ValueError(f"lora.rank = {rank} must be >= 1")
    base = module.w13 if isinstance(module, GroupedExperts) else module.weight
    module.__class__ = _ADAPTER_CLASSES[cls]
    module._setup(rank, alpha, dropout)
    if isinstance(module, LoRAGroupedExperts):
        E, two_f, latent = module.w13.shape
        hidden = module.w2.shape[2]
        like = module.w13

        def stacked(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(E, *shape, device=like.device, dtype=like.dtype))

        module.lora_A_w13, module.lora_B_w13 = stacked(rank, latent), stacked(two_f, rank)
        module.lora_A_w2, module.lora_B_w2 = stacked(rank, hidden), stacked(latent, rank)
    else:
        out_features, in_features = module.weight.shape
        module.lora_A = _factor(rank, in_features, module.weight)
        module.lora_B = _factor(out_features, rank, module.weight)
    if base.device.type != "meta":
        with torch.no_grad():
            module.reset_lora_parameters()
    return module


def adapter_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{module name: adapted module}`` in model order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, ADAPTER_TYPES)}


def is_adapter_parameter(fqn: str) -> bool:
    """Whether a parameter name belongs to a LoRA factor (all are named ``*.lora_*``)."""
    return is_adapter_key(fqn)


def reset_adapters(model: nn.Module) -> None:
    """(Re)initialise every adapter: A like PEFT (Kaiming uniform), B = 0. Call after materialising the model."""
    with torch.no_grad():
        for module in adapter_modules(model).values():
            module.reset_lora_parameters()
