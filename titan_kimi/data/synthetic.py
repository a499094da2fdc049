"""Deterministic, learnable synthetic token rows for smoke tests and benchmarks (no files needed).

A fixed pool of short random n-gram patterns is drawn from the seed. Each row is a run of documents;
a document repeats one pool pattern (from a random phase) for a random length, then ends with EOS
when an ``eos_id`` is given. A model lowers the loss by memorising the pool and by copying the period
within a document; the first token of each document stays unpredictable (and carries no loss).
Row ``i`` depends only on ``(seed, i)``, so any row can be rebuilt at any time, on any rank.
"""

from __future__ import annotations

import numpy as np

from titan_kimi.data.batch import Sample, make_sample, next_token_labels

DEFAULT_NUM_SAMPLES = 65_536  # the epoch length; the loader wraps around after it
NUM_PATTERNS = 64
PATTERN_LENGTHS = (3, 12)  # inclusive range of n-gram lengths
REPEATS_PER_DOCUMENT = (2, 12)  # inclusive range of pattern repetitions per document


class SyntheticDataset:
    """Map-style: ``num_samples`` rows of ``seq_len`` tokens with ids in ``[0, vocab_size)``."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        seed: int,
        *,
        num_samples: int = DEFAULT_NUM_SAMPLES,
        eos_id: int | None = None,
    ):
        if vocab_size < 3:
            raise ValueError(f"vocab_size must be >= 3 for synthetic data, got {vocab_size}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if eos_id is not None and not 0 <= eos_id < vocab_size:
            raise ValueError(f"eos_id {eos_id} is outside the vocabulary [0, {vocab_size})")
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.num_samples, self.eos_id = num_samples, eos_id
        rng = np.random.default_rng([seed, 0x5EED])
        # Pattern tokens avoid the EOS id, so EOS only ever marks a document end.
        candidates = np.arange(vocab_size, dtype=np.int64)
        if eos_id is not None:
            candidates = candidates[candidates != eos_id]
        lo, hi = PATTERN_LENGTHS
        self.patterns = [rng.choice(candidates, size=int(rng.integers(lo, hi + 1))) for _ in range(NUM_PATTERNS)]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"row {index} out of range [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, 1, index])
        need = self.seq_len + 1
        tokens: list[np.ndarray] = []
        docs: list[np.ndarray] = []
        total = 0
        while total < need:
            pattern = self.patterns[int(rng.integers(len(self.patterns)))]
            repeats = int(rng.integers(REPEATS_PER_DOCUMENT[0], REPEATS_PER_DOCUMENT[1] + 1))
            phase = int(rng.integers(len(pattern)))
            doc = np.roll(np.tile(pattern, repeats), -phase)
            if self.eos_id is not None:
                doc = np.append(doc, self.eos_id)
            tokens.append(doc)
            docs.append(np.full(len(doc), len(docs), dtype=np.int32))
            total += len(doc)
        window = np.concatenate(tokens)[:need]
        window_docs = np.concatenate(docs)[:need]
        return make_sample(*next_token_labels(window, window_docs))
