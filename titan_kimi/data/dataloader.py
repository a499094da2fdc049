"""A resumable, rank-sharded dataloader over a map-style dataset.

Each epoch has one sample order, the same on every rank: a permutation drawn from ``(seed, epoch)``
when shuffling, else file order. Its first ``dp_world_size * (len // dp_world_size)`` entries are dealt
round-robin, so dp rank r takes positions r, r + W, r + 2W, ...: the shards are disjoint and equally
long. Each rank yields ``len // (W * local_batch_size)`` full batches per epoch (the remainder is
dropped) and, when ``infinite``, moves on to the next epoch's order.

Because every rank yields the same number of batches, the state (epoch, samples of the epoch's order
consumed by all ranks together) is the same on every rank, and it does not depend on the layout: the
``W * B`` samples of a step are positions ``[t W B, (t + 1) W B)`` of the order for any split of that global
batch into ``W`` ranks of ``B`` (the epoch length, ``len // (W B)`` global batches, too). So a state saved
under one data-parallel degree resumes under another, continuing with exactly the samples that would have
come next, whenever the position falls on a batch boundary of the new split.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from titan_kimi.data.batch import Batch, collate
from titan_kimi.data.datasets import MapDataset, build_dataset
from titan_kimi.data.image_processor import ImageProcessor
from titan_kimi.data.tokenizer import KimiTokenizer

STATE_VERSION = 2
# Saved fields that must match the loader a state is loaded into (the data-parallel split may differ).
_MATCHING_FIELDS = ("dataset", "num_samples", "seed", "shuffle")


class ShardedDataLoader:
    def __init__(
        self,
        dataset: MapDataset,
        *,
        local_batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        seed: int,
        shuffle: bool,
        infinite: bool = True,
        name: str = "",
    ):
        if dp_world_size < 1:
            raise ValueError(f"dp_world_size must be >= 1, got {dp_world_size}")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_world_size})")
        if local_batch_size < 1:
            raise ValueError(f"local_batch_size must be >= 1, got {local_batch_size}")
        self.dataset = dataset
        self.collate = getattr(dataset, "collate", collate)  # image-text datasets batch their images themselves
        self.name = name
        self.local_batch_size = local_batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.seed, self.shuffle, self.infinite = seed, shuffle, infinite
        self.num_samples = len(dataset)
        self.samples_per_rank = self.num_samples // dp_world_size
        self.batches_per_epoch = self.samples_per_rank // local_batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"dataset {name!r} has {self.num_samples} samples, fewer than dp_world_size * local_batch_size "
                f"= {dp_world_size * local_batch_size} needed for one batch per rank"
            )
        self._epoch = 0
        self._batch_in_epoch = 0
        self._order_epoch: int | None = None
        self._order: np.ndarray | None = None

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return self.batches_per_epoch

    def rank_indices(self, epoch: int) -> np.ndarray:
        """The sample indices this rank visits in ``epoch``, in order."""
        if self._order_epoch != epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
            self._order = order[: self.samples_per_rank * self.dp_world_size][self.dp_rank :: self.dp_world_size]
            self._order_epoch = epoch
        assert self._order is not None
        return self._order

    def __iter__(self) -> Iterator[Batch]:
        """Yields from the current position; without ``infinite`` it stops at the epoch's end, and
        the next ``iter()`` starts the following epoch."""
        while True:
            if self._batch_in_epoch >= self.batches_per_epoch:
                self._epoch += 1
                self._batch_in_epoch = 0
            start = self._batch_in_epoch * self.local_batch_size
            indices = self.rank_indices(self._epoch)[start : start + self.local_batch_size]
            batch = self.collate([self.dataset[int(i)] for i in indices])
            self._batch_in_epoch += 1  # counted before the yield: a state saved after this batch resumes after it
            yield batch
            if not self.infinite and self._batch_in_epoch >= self.batches_per_epoch:
                return

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "samples_in_epoch": self._batch_in_epoch * self.local_batch_size * self.dp_world_size,
            "dataset": self.name,
            "num_samples": self.num_samples,
            "dp_world_size": self.dp_world_size,
            "local_batch_size": self.local_batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version = state.get("version")
        if version not in (1, STATE_VERSION):
            raise ValueError(f"dataloader state version {version!r} is not {STATE_VERSION} (or 1)")
        current = self.state_dict()
        for field in _MATCHING_FIELDS:
            if state.get(field) != current[field]:
                raise ValueError(
                    f"dataloader state was saved with {field}={state.get(field)!r} but this loader has "
                    f"{field}={current[field]!r}; resuming needs the same value"
                )
        epoch = int(state["epoch"])
        if version == 1:  # batches of one rank, counted under the saved split
            consumed = int(state["batch_in_epoch"]) * int(state["local_batch_size"]) * int(state["dp_world_size"])
        else:
            consumed = int(state["samples_in_epoch"])
        per_batch = self.local_batch_size * self.dp_world_size
        if consumed % per_batch:
            raise ValueError(
                f"dataloader state: {consumed} samples of epoch {epoch} were consumed (saved with "
                f"{state.get('dp_world_size')} data-parallel ranks x {state.get('local_batch_size')} sequences); "
                f"this run's batches of {self.dp_world_size} x {self.local_batch_size} = {per_batch} do not end "
                f"there: resume with a global batch that divides {consumed}")
        batch = consumed // per_batch
        if epoch < 0 or not 0 <= batch <= self.batches_per_epoch:
            raise ValueError(f"dataloader state has epoch={epoch}, {consumed} samples consumed, out of range")
        self._epoch, self._batch_in_epoch = epoch, batch


def build_dataloader(
    dataset_name: str,
    path: str | Path | None,
    tokenizer: KimiTokenizer | None,
    *,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    seed: int,
    shuffle: bool,
    infinite: bool = True,
    vocab_size: int | None = None,
    split: str = "train",
    image_processor: ImageProcessor | None = None,
) -> ShardedDataLoader:
    """Builds ``dataset_name`` (see datasets.py; ``path`` None = the shipped sample's ``split``) and shards it.

    Batches are ``{"input_ids": int64 [B,S], "labels": int64 [B,S] (shifted, -100 = no loss),
    "doc_ids": int32 [B,S] (0 = padding)}`` with ``B = local_batch_size``, ``S = seq_len``; ``medpix`` batches
    add ``pixel_values [L, 3, 14, 14]`` and ``grid_thws [images, 3]`` (see medpix.py).
    """
    dataset = build_dataset(dataset_name, path, tokenizer, seq_len=seq_len, seed=seed, vocab_size=vocab_size,
                            split=split, image_processor=image_processor)
    return ShardedDataLoader(
        dataset,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        seed=seed,
        shuffle=shuffle,
        infinite=infinite,
        name=dataset_name,
    )
