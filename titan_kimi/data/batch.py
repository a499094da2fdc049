"""The sample and batch format every titan_kimi dataset produces.

A sample is a dict of 1-D tensors of length ``seq_len``; a batch stacks them to ``[B, S]``:

- ``input_ids`` (int64): the tokens the model reads;
- ``labels`` (int64): the next-token target of each position, already shifted
  (``labels[t]`` is the token after ``input_ids[t]``), or ``IGNORE_INDEX`` where no loss is taken;
- ``doc_ids`` (int32): 0 on padding, 1, 2, ... for the documents of the row (distinct within a row,
  increasing), so the model can reset attention and recurrent state at every document start.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

IGNORE_INDEX = -100
POSITION_KEYS = ("input_ids", "labels", "doc_ids")  # the entries with one value per position [B, S]
Sample = dict[str, torch.Tensor]
Batch = dict[str, torch.Tensor]


def make_sample(input_ids: np.ndarray, labels: np.ndarray, doc_ids: np.ndarray) -> Sample:
    return {
        "input_ids": torch.as_tensor(np.asarray(input_ids, dtype=np.int64)),
        "labels": torch.as_tensor(np.asarray(labels, dtype=np.int64)),
        "doc_ids": torch.as_tensor(np.asarray(doc_ids, dtype=np.int32)),
    }


def next_token_labels(window: np.ndarray, window_docs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Splits a ``seq_len + 1`` token window into (input_ids, labels, doc_ids).

    ``window_docs`` holds a non-decreasing document index per token. A position whose next token
    starts another document gets no loss (nothing in the current document predicts it).
    """
    inputs = window[:-1]
    same_doc = window_docs[1:] == window_docs[:-1]
    labels = np.where(same_doc, window[1:], IGNORE_INDEX)
    doc_ids = window_docs[:-1] - window_docs[0] + 1
    return inputs, labels, doc_ids


def collate(samples: Sequence[Sample]) -> Batch:
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
