"""The longest document of a host batch: how many causal keys its last token can attend to.

Read on the CPU before the batch moves to the device, it lets the model decide shape-level questions (may the
DSA layers attend densely?) as a Python fact, without a device sync.
"""

from __future__ import annotations

import torch


def longest_document(doc_ids: torch.Tensor) -> int:
    """Length of the longest run of one nonzero doc id within a row of ``doc_ids [B, S]`` (0 = padding, whose
    runs do not count); 0 for a batch of padding only.

    Runs, as the model's segments are (``titan_kimi.models.kimi_k3.sequence``): a query attends only to keys of
    its own run, so no trained query has more causal keys than this."""
    if doc_ids.device.type != "cpu":
        raise ValueError(f"doc_ids on {doc_ids.device}: longest_document reads host batches (device 'cpu') so that "
                         f"it never waits for the device")
    if doc_ids.dim() != 2:
        raise ValueError(f"doc_ids has shape {tuple(doc_ids.shape)}; expected [batch, seq_len]")
    if doc_ids.numel() == 0:
        return 0
    ids = doc_ids.long()
    span = int(ids.max()) + 1
    # Distinct ids per row, so runs never continue from one row into the next.
    rows = ids + torch.arange(ids.shape[0]).unsqueeze(1) * span
    values, counts = torch.unique_consecutive(rows.reshape(-1), return_counts=True)
    counts = counts[values % span != 0]
    return int(counts.max()) if counts.numel() else 0
