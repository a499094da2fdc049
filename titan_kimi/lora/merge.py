"""Merging adapters into their base weights: in place (a plain model again), or lazily for an HF export.

``merged_tensors(model)`` is the model's state under canonical names with every adapted base tensor replaced
by ``W + scale * B A`` and no factors, computed one tensor at a time when read (sharded tensors gathered
first), so ``export_hf_checkpoint(model, path, tensors=merged_tensors(model))`` writes a full HF checkpoint
that loads into a model without adapters.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titan_kimi.checkpoint.destinations import canonical_fqn
from titan_kimi.lora.modules import LoRAGroupedExperts, adapter_modules, is_adapter_parameter
from titan_kimi.models.kimi_k3.head import LMHead
from titan_kimi.models.kimi_k3.moe import GroupedExperts


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _merged(w: torch.Tensor, b: torch.Tensor, a: torch.Tensor, scale: float) -> torch.Tensor:
    w, b, a = _full(w), _full(b), _full(a)
    delta = (b.float() @ a.float()) * scale  # batched for stacked experts
    return (w.float() + delta).to(w.dtype)


def _merge_plan(model: nn.Module) -> dict[str, tuple[str, str, float]]:
    """``{base tensor name: (B name, A name, scale)}`` of every adapted tensor."""
    plan = {}
    for name, module in adapter_modules(model).items():
        name = canonical_fqn(name)
        if isinstance(module, LoRAGroupedExperts):
            for w in ("w13", "w2"):
                plan[f"{name}.{w}"] = (f"{name}.lora_B_{w}", f"{name}.lora_A_{w}", module.scaling)
        else:
            plan[f"{name}.weight"] = (f"{name}.lora_B.weight", f"{name}.lora_A.weight", module.scaling)
    return plan


class MergedState(Mapping):
    """Read-only ``{fqn: tensor}`` of the merged model; merges when an entry is read."""

    def __init__(self, model: nn.Module) -> None:
        self._state = {canonical_fqn(k): v for k, v in model.state_dict().items()}
        self._plan = _merge_plan(model)
        self._keys = [k for k in self._state if not is_adapter_parameter(k)]

    def __getitem__(self, fqn: str) -> torch.Tensor:
        if fqn not in self._plan:
            if fqn not in self._keys:
                raise KeyError(fqn)
            return self._state[fqn]
        b, a, scale = self._plan[fqn]
        return _merged(self._state[fqn], self._state[b], self._state[a], scale)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def merged_tensors(model: nn.Module) -> MergedState:
    return MergedState(model)


@torch.no_grad()
def merge_adapters_(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and turn the module back into its base class (in place; for a
    model that is not sharded). The result computes the adapted function without adapters."""
    for module in adapter_modules(model).values():
        if any(isinstance(p, DTensor) for p in module.parameters()):
            raise ValueError("merge_adapters_ needs an unsharded model; export a sharded one with merged_tensors")
        if isinstance(module, LoRAGroupedExperts):
            w13, w2 = module.merged_weights()
            module.w13.copy_(w13)
            module.w2.copy_(w2)
            for name in ("lora_A_w13", "lora_B_w13", "lora_A_w2", "lora_B_w2"):
                delattr(module, name)
            module.__class__ = GroupedExperts
        else:
            module.weight.copy_(module.merged_weight())
            del module.lora_A, module.lora_B
            module.__class__ = LMHead if isinstance(module, LMHead) else nn.Linear
        del module.lora_dropout
        for attr in ("lora_rank", "lora_alpha", "scaling"):
            module.__dict__.pop(attr, None)
    return model
