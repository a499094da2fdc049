"""Per-step router load: how evenly the MoE layers spread tokens over their experts (balance decides how fast
expert parallelism runs: the most loaded EP rank sets the pace of every all-to-all)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.parallel.distributed import all_reduce_sum


@dataclass(frozen=True)
class Load:
    max: float  # most tokens any expert got, as a multiple of the balanced share (1.0 = perfect), worst layer
    min: float  # fewest tokens any expert got, as a multiple of the balanced share, worst layer


class RouterLoad:
    """Reads the MoE layers' ``tokens_per_expert`` counters of this rank's model parts, sums them over every
    rank (each layer lives on one pipeline rank; data-parallel ranks add their tokens), resets them."""

    def __init__(self, parts: list[nn.Module], args: KimiK3ModelArgs) -> None:
        self.layers = sorted(i for i in range(args.n_layers) if args.is_moe_layer(i))
        self.row = {layer: n for n, layer in enumerate(self.layers)}
        self.num_experts = args.num_experts
        self.owned = []
        for part in parts:
            for name, module in part.named_modules():
                if hasattr(module, "tokens_per_expert") and isinstance(module.tokens_per_expert, torch.Tensor):
                    layer = int(name.split("layers.")[1].split(".")[0])
                    self.owned.append((self.row[layer], module))
                    module.tokens_per_expert.zero_()  # a buffer, not a weight: initialisation leaves it unset

    def read_and_reset(self) -> Load | None:
        """The load since the last call (ratios are immune to activation recomputation counting twice)."""
        if not self.layers:
            return None
        device = self.owned[0][1].tokens_per_expert.device if self.owned else torch.device("cpu")
        counts = torch.zeros(len(self.layers), self.num_experts, dtype=torch.float32, device=device)
        for row, module in self.owned:
            counts[row] += module.tokens_per_expert
            module.tokens_per_expert.zero_()
        counts = all_reduce_sum(counts)
        share = counts.mean(dim=1, keepdim=True).clamp(min=1e-12)
        ratio = counts / share
        used = counts.sum(dim=1) > 0
        if not bool(used.any()):
            return None
        stats = torch.stack([ratio.amax(dim=1)[used].max(), ratio.amin(dim=1)[used].min()]).tolist()
        return Load(max=stats[0], min=stats[1])
