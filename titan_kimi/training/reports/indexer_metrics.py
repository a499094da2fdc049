"""The indexer's distillation metrics of a run whose indexer trains (``indexer.mode`` warmup / sparse): the
mean KL per query and DSA layer, and the recall (the share of the main attention's probability mass inside
the selected top-k, over queries with more causal keys than top-k), read from the layers' counters on logging
steps only, so other steps pay no host sync."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from titan_kimi.models.kimi_k3.indexer import Indexer
from titan_kimi.training.process.distributed import all_reduce_sum


@dataclass(frozen=True)
class IndexerReading:
    # mean KL per real query and DSA layer over the forwards that measured it since the last reading (every
    # forward in the warm-up; in the sparse stage the measured, logging, ones); None: no query counted
    kl: float | None
    recall: float | None  # mean recall over the counted queries of the measured forwards; None: none counted


class IndexerMetrics:
    """Sums the ``distillation_stats`` counters of this rank's indexers over every rank (each layer lives on one
    pipeline rank; data- and context-parallel ranks add their queries), then resets them."""

    def __init__(self, parts: list[nn.Module], device: torch.device) -> None:
        self.indexers = [m for part in parts for m in part.modules() if isinstance(m, Indexer) and m.trains]
        self.device = device
        for indexer in self.indexers:
            indexer.distillation_stats.zero_()  # a buffer, not a weight: initialisation leaves it unset

    def read_and_reset(self) -> IndexerReading:
        """Every rank calls it on the same steps (a collective)."""
        total = torch.zeros(4, dtype=torch.float32, device=self.device)
        for indexer in self.indexers:
            total += indexer.distillation_stats
            indexer.distillation_stats.zero_()
        kl_sum, queries, mass_sum, counted = all_reduce_sum(total).tolist()
        return IndexerReading(kl=kl_sum / queries if queries else None,
                              recall=mass_sum / counted if counted else None)
