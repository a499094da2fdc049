"""HellaSwag as supervised fine-tuning data (the spec §12.3 recipe): one sample per item, no packing.

Each item of the public schema (``ctx``, ``endings`` list, ``label`` int or digit string) becomes
``prompt = ctx`` and ``answer = " " + endings[label]`` followed by EOS. Loss is taken on the answer
tokens (and the EOS) only. Samples are right-padded to ``seq_len`` with the pad id (doc id 0, label
-100). When prompt + answer is longer than ``seq_len + 1`` tokens the prompt is truncated from
the left (its start is dropped, the answer is kept whole); an answer that does not fit in
``seq_len`` tokens on its own is a ValueError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from titan_kimi.data.batch import IGNORE_INDEX, Sample, make_sample
from titan_kimi.data.records import read_records
from titan_kimi.data.tokenizer import KimiTokenizer


def hellaswag_prompt_answer(item: dict[str, Any], row: int, path: Path | str) -> tuple[str, str]:
    """``(ctx, " " + endings[label])`` of one item; ValueError naming the file and row if malformed."""
    ctx, endings, label = item.get("ctx"), item.get("endings"), item.get("label")
    if not isinstance(ctx, str):
        raise ValueError(f"{path}: row {row}: 'ctx' must be a string, got {ctx!r}")
    if not isinstance(endings, list) or not endings or not all(isinstance(e, str) for e in endings):
        raise ValueError(f"{path}: row {row}: 'endings' must be a non-empty list of strings, got {endings!r}")
    if isinstance(label, str) and label.strip().isdigit():
        index = int(label)
    elif isinstance(label, int) and not isinstance(label, bool):
        index = label
    else:
        index = None
    if index is None or not 0 <= index < len(endings):
        raise ValueError(
            f"{path}: row {row}: label {label!r} is not a valid index into its {len(endings)} endings "
            f"(expected an int or digit string in 0..{len(endings) - 1})"
        )
    return ctx, " " + endings[index]


class HellaSwagDataset:
    """Map-style: one sample per item, in file order; ``pad_id`` defaults to the tokenizer's."""

    def __init__(self, path: str | Path, tokenizer: KimiTokenizer, seq_len: int):
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 for prompt + answer samples, got {seq_len}")
        self.path = Path(path)
        self.seq_len = seq_len
        self.pad_id = getattr(tokenizer, "pad_id", tokenizer.eos_id)
        self.num_truncated = 0
        # (tokens, number of prompt tokens kept) per item; tensors are built on access.
        self._items: list[tuple[np.ndarray, int]] = []
        for row, item in read_records(self.path):
            prompt, answer = hellaswag_prompt_answer(item, row, self.path)
            prompt_ids = tokenizer.encode(prompt)
            answer_ids = tokenizer.encode(answer) + [tokenizer.eos_id]
            if len(answer_ids) > seq_len:
                raise ValueError(
                    f"{self.path}: row {row}: the answer is {len(answer_ids)} tokens with EOS, more than "
                    f"seq_len = {seq_len} allows; raise seq_len"
                )
            overflow = len(prompt_ids) + len(answer_ids) - (seq_len + 1)
            if overflow > 0:
                prompt_ids = prompt_ids[overflow:]
                self.num_truncated += 1
            self._items.append((np.asarray(prompt_ids + answer_ids, dtype=np.int64), len(prompt_ids)))
        if not self._items:
            raise ValueError(f"{self.path} holds no HellaSwag items")

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> Sample:
        tokens, prompt_len = self._items[index]
        n = len(tokens) - 1  # positions with a next token
        input_ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        doc_ids = np.zeros(self.seq_len, dtype=np.int32)
        input_ids[:n] = tokens[:-1]
        doc_ids[:n] = 1
        # Position t predicts tokens[t + 1]; the answer starts at index prompt_len.
        first = max(prompt_len - 1, 0)
        labels[first:n] = tokens[first + 1 :]
        return make_sample(input_ids, labels, doc_ids)
