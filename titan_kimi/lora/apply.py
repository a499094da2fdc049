"""Injecting LoRA into a built model and the freezing rules that come with it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.nn as nn

from titan_kimi.lora.modules import add_adapter
from titan_kimi.models.kimi_k3.moe import GroupedExperts
from titan_kimi.lora.targets import select_targets

# CUDA grouped GEMMs need 16-byte aligned strides: a bf16 rank dimension of the expert factors must be a
# multiple of 8.
EXPERT_RANK_MULTIPLE = 8


@dataclass(frozen=True)
class LoRASettings:
    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]

    @classmethod
    def from_config(cls, lora) -> "LoRASettings":
        return cls(lora.rank, float(lora.alpha), float(lora.dropout), tuple(lora.target_modules))


def apply_lora(model: nn.Module, settings: LoRASettings, *, require_matches: bool = True) -> list[str]:
    """Freeze every parameter of ``model``, then add trainable adapters to the selected modules (in place, on any
    device, meta included: call ``reset_adapters`` after materialising). Returns the adapted module names.

    Frozen: every base weight, the indexer (never adapted) and the vision tower unless it is a target.
    """
    names = select_targets(model, settings.target_modules, require_matches=require_matches)
    modules = dict(model.named_modules())
    experts = [n for n in names if isinstance(modules[n], GroupedExperts)]
    if experts and settings.rank % EXPERT_RANK_MULTIPLE:
        raise ValueError(f"lora.rank = {settings.rank}: adapting the routed experts ({experts[0]!r}, ...) needs a "
                         f"multiple of {EXPERT_RANK_MULTIPLE} (grouped GEMMs align rows to 16 bytes)")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        add_adapter(modules[name], settings.rank, settings.alpha, settings.dropout)
    return names


def targets_summary(names: Sequence[str]) -> str:
    """``"attention.q_proj x 6, experts x 7, ..."``: adapted modules grouped by their name without layer index."""
    counts: dict[str, int] = {}
    for name in names:
        parts = name.split(".")
        key = ".".join(parts[2:]) if parts[0] == "layers" else ".".join(p for p in parts if not p.isdigit())
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} x {v}" for k, v in counts.items())
