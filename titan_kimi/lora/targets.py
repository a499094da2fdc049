"""Which modules ``[lora] target_modules`` adapts.

Each entry is one of

- a group name: ``attention`` (every projection of KDA and MLA/DSA; never the indexer), ``mlp`` (the dense
  layer's MLP), ``shared_experts``, ``experts`` (the stacked routed experts, one low-rank pair per expert),
  ``latent_proj`` (the LatentMoE down/up projections), ``router`` (the gate), ``lm_head``, ``vision_tower``
  (its block projections) and ``projector``;
- a glob over module names, when it holds ``.`` or a wildcard (``layers.*.attention.o_proj``);
- a bare module name, matched against the last part of each name as PEFT does (``o_proj``).

Only adaptable modules count (``nn.Linear``, the lm_head, the grouped experts). The K3.1 indexer is never
adapted: groups skip it and an explicit pattern that names it is an error. Its own weights train only by
distillation, when ``indexer.mode`` says so (docs/indexer_training.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase

import torch.nn as nn

from titan_kimi.lora.modules import can_adapt

GROUPS: dict[str, tuple[str, ...]] = {
    "attention": ("layers.*.attention.*",),
    "mlp": ("layers.*.feed_forward.*",),
    "shared_experts": ("layers.*.moe.shared_experts.*",),
    "experts": ("layers.*.moe.experts",),
    "latent_proj": ("layers.*.moe.routed_expert_down_proj", "layers.*.moe.routed_expert_up_proj"),
    "router": ("layers.*.moe.router.gate",),
    "lm_head": ("output",),
    "vision_tower": ("vision_tower.*",),
    "projector": ("mm_projector.*",),
}
DEFAULT_TARGETS = ("attention", "mlp", "shared_experts", "experts")


def is_indexer(name: str) -> bool:
    return ".indexer." in f".{name}."


def _matches(entry: str, name: str) -> bool:
    if entry in GROUPS:
        return any(fnmatchcase(name, glob) for glob in GROUPS[entry])
    if any(c in entry for c in ".*?["):
        return fnmatchcase(name, entry)
    return name.rsplit(".", 1)[-1] == entry


def select_targets(model: nn.Module, entries: Sequence[str], *, require_matches: bool = True) -> list[str]:
    """Names of the modules the entries select, in model order. ValueError for an entry that selects nothing
    (with ``require_matches``: a whole model, not a pipeline stage that may hold none of them) or that names
    the indexer."""
    if not entries:
        raise ValueError(f"lora.target_modules is empty; valid: group names {sorted(GROUPS)}, module-name globs "
                         f"or bare module names (default {list(DEFAULT_TARGETS)})")
    adaptable = [name for name, module in model.named_modules() if name and can_adapt(module)]
    selected: set[str] = set()
    for entry in entries:
        hits = [name for name in adaptable if _matches(entry, name)]
        frozen = [name for name in hits if is_indexer(name)]
        if frozen and entry not in GROUPS:
            raise ValueError(f"lora.target_modules entry {entry!r} selects indexer modules ({frozen[0]!r}, ...); "
                             f"adapters never sit on the K3.1 indexer (indexer.mode = warmup / sparse trains its own "
                             f"weights): remove it")
        hits = [name for name in hits if not is_indexer(name)]
        if not hits and require_matches:
            raise ValueError(f"lora.target_modules entry {entry!r} matches no adaptable module of this model; "
                             f"valid: group names {sorted(GROUPS)}, globs over module names such as "
                             f"'layers.*.attention.o_proj', or bare names such as 'o_proj'")
        selected.update(hits)
    return [name for name in adaptable if name in selected]
