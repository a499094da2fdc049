"""Packed pre-training text: documents tokenized, each followed by EOS, and cut into rows.

The whole file is tokenized once, at construction, into one token stream (fine for local corpora
up to a few hundred MB; every rank tokenizes it). Row ``r`` is the window of ``seq_len + 1``
tokens starting at ``r * seq_len``: its first ``seq_len`` tokens are the inputs and its last
``seq_len`` the labels, so consecutive rows overlap by one token and every adjacent token pair of
the stream is trained on exactly once.

A document cut at a row boundary continues in the next row, where it is a new document (doc id 1
of that row): the model starts it from a fresh state. The EOS position of a document gets no loss,
since the next document's first token cannot be predicted from it; the EOS itself is a target of
the document's last text token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from titan_kimi.data.batch import Sample, make_sample, next_token_labels
from titan_kimi.data.records import read_records
from titan_kimi.data.tokenizer import KimiTokenizer


class PackedTextDataset:
    """Map-style: ``len(ds)`` rows, ``ds[i]`` a sample of ``seq_len`` tokens (see batch.py)."""

    def __init__(self, path: str | Path, tokenizer: KimiTokenizer, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.path = Path(path)
        self.seq_len = seq_len
        token_chunks: list[np.ndarray] = []
        doc_chunks: list[np.ndarray] = []
        for row, record in read_records(self.path):
            text = record.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{self.path}: row {row} has no string 'text' field (got {type(text).__name__})")
            if not text:
                continue  # an empty document would only add a lone EOS
            ids = tokenizer.encode(text)
            ids.append(tokenizer.eos_id)
            token_chunks.append(np.asarray(ids, dtype=np.int32))
            doc_chunks.append(np.full(len(ids), len(doc_chunks), dtype=np.int32))
        self.tokens = np.concatenate(token_chunks) if token_chunks else np.zeros(0, dtype=np.int32)
        self.doc_index = np.concatenate(doc_chunks) if doc_chunks else np.zeros(0, dtype=np.int32)
        self.num_documents = len(token_chunks)
        self._num_rows = max(0, (len(self.tokens) - 1) // seq_len)
        if self._num_rows == 0:
            raise ValueError(
                f"{self.path} has {len(self.tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                f"use a smaller seq_len or more text"
            )

    def __len__(self) -> int:
        return self._num_rows

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < self._num_rows:
            raise IndexError(f"row {index} out of range [0, {self._num_rows})")
        start = index * self.seq_len
        end = start + self.seq_len + 1
        return make_sample(*next_token_labels(self.tokens[start:end], self.doc_index[start:end]))
