"""Per-step router load: how evenly the MoE layers spread tokens over their experts (balance decides how fast
expert parallelism runs: the most loaded EP rank sets the pace of every all-to-all)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.training.process.distributed import all_reduce_sum


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

    def reduce_and_reset(self) -> torch.Tensor | None:
        """The load since the last call, left on the device: ``[max, min, any expert used]`` (``load_of`` reads
        it), so the step reads it in its one device-to-host copy (ratios are immune to activation recomputation
        counting twice). None for a model without MoE layers."""
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
        used = counts.sum(dim=1) > 0  # layers that routed tokens; a mask, not an index (no device sync)
        inf = torch.full((), float("inf"), device=device)
        return torch.stack([torch.where(used, ratio.amax(dim=1), -inf).max(),
                            torch.where(used, ratio.amin(dim=1), inf).min(), used.any().float()])

    def read_and_reset(self) -> Load | None:
        """``reduce_and_reset`` read at once."""
        reduced = self.reduce_and_reset()
        return None if reduced is None else load_of(reduced.tolist())


def load_of(values: list[float]) -> Load | None:
    """The host values of ``RouterLoad.reduce_and_reset``; None when no layer routed a token."""
    most, least, used = values
    return Load(max=most, min=least) if used else None
