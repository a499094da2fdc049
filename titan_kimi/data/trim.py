"""Trailing padding cut from a batch (``training.pad_to_multiple_of``): the one rule for how long a batch runs.

Padded datasets (medpix, hellaswag) fill every row to ``seq_len``; a MedPix row of k31.toml holds ~1,152 real
tokens of 4,096. Every position before a row's last real token stays (interior padding included), and the
columns after the batch's last real token go, the length rounded up to a multiple of ``multiple`` so that the
shapes a compiled model sees take few values. Nothing real changes: attention and KDA are causal and padding is
its own segment, so a real token never reads the columns cut; their labels are ``IGNORE_INDEX``.
"""

from __future__ import annotations

import torch

from titan_kimi.data.batch import POSITION_KEYS, Batch


def padded_length(real_length: int, multiple: int, seq_len: int) -> int:
    """The length a batch whose last real token is at ``real_length - 1`` runs at: rounded up to a multiple of
    ``multiple`` (0: every batch at ``seq_len``), never above ``seq_len``, at least one multiple."""
    if multiple < 0:
        raise ValueError(f"training.pad_to_multiple_of = {multiple}: valid: 0 (rows at seq_len) or a positive count")
    if not 0 <= real_length <= seq_len:
        raise ValueError(f"real length {real_length}: valid: 0..seq_len ({seq_len})")
    if multiple == 0:
        return seq_len
    return min(seq_len, max(1, -(-real_length // multiple)) * multiple)


def real_length(doc_ids: torch.Tensor) -> int:
    """One past the last real position (doc id != 0) of any row of a host ``doc_ids [B, S]``; 0 for padding only."""
    if doc_ids.dim() != 2:
        raise ValueError(f"doc_ids has shape {tuple(doc_ids.shape)}; expected [batch, seq_len]")
    columns = (doc_ids != 0).any(dim=0).nonzero()
    return int(columns[-1]) + 1 if columns.numel() else 0


def trim_padding(batch: Batch, multiple: int) -> Batch:
    """``batch`` with its trailing padding columns cut (`padded_length`); the per-position entries
    (``POSITION_KEYS``) are views of the originals, the rest (images) unchanged. ``multiple`` 0 returns it as is."""
    if multiple == 0:
        return batch
    seq_len = batch["doc_ids"].shape[1]
    keep = padded_length(real_length(batch["doc_ids"]), multiple, seq_len)
    if keep == seq_len:
        return batch
    return {k: v[:, :keep] if k in POSITION_KEYS else v for k, v in batch.items()}
