"""Nonpacked MedPix-VQA image-text SFT: one conversation per row, padded to ``seq_len``, never packed.

Each row (an image, a question, an answer; see image_text_records.py) becomes

    user: [image] question        assistant: answer

encoded with the XTML chat format; the image is **one** placeholder token, which the model expands into the
image's ``(h/2)(w/2)`` positions (spec §10.4, §16c). Loss is taken on the assistant body only.

A sample describes the sequence the model sees *after* expansion, so the batch shapes are static:

- ``input_ids [seq_len]``: the unexpanded tokens (one placeholder per image) right-padded with the pad id.
  Expansion adds ``n - 1`` positions per image; what it pushes past ``seq_len`` is padding, dropped;
- ``labels [seq_len]`` and ``doc_ids [seq_len]`` in expanded positions: ``labels[t]`` is the token after
  expanded position t where that token is an assistant token, else -100 (image slots never are targets);
  doc id 1 on the conversation (its image slots included), 0 on padding;
- ``pixel_values [L, 3, 14, 14]`` and ``grid_thws [images, 3]``, batched by ``collate_image_text``.

A conversation longer than ``seq_len`` after expansion is cut at the end (``num_truncated`` counts them);
one whose prompt (with its image) alone does not fit is a ValueError naming the row.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from titan_kimi.data.batch import IGNORE_INDEX, POSITION_KEYS, Batch, Sample
from titan_kimi.data.chat import IMAGE_PLACEHOLDER, encode_chat
from titan_kimi.data.image_processor import ImageProcessor, open_image
from titan_kimi.data.image_text_records import ImageTextRecords
from titan_kimi.data.tokenizer import KimiTokenizer


def medpix_messages(question: str, answer: str) -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
        {"role": "assistant", "content": answer},
    ]


def expanded_labels(ids: Sequence[int], mask: Sequence[bool], placeholder_id: int, tokens_per_image: Sequence[int],
                    length: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Shifted labels and doc ids ``[length]`` of the expanded sequence of ``ids`` (placeholder ``i`` taking
    ``tokens_per_image[i]`` positions); returns them and the expanded length."""
    targets: list[int] = []  # the expanded sequence's per-position targets (-100 = not trained)
    images = iter(tokens_per_image)
    for token, trained in zip(ids, mask):
        if token == placeholder_id:
            targets.extend([IGNORE_INDEX] * next(images))
        else:
            targets.append(token if trained else IGNORE_INDEX)
    n = len(targets)
    if n > length:
        raise ValueError(f"expanded sequence of {n} positions exceeds {length}")
    labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
    labels[: n - 1] = targets[1:]
    doc_ids = np.zeros(length, dtype=np.int32)
    doc_ids[:n] = 1
    return labels, doc_ids, n


class MedPixDataset:
    """Map-style: one sample per row, in file order. Images are decoded when a sample is read."""

    def __init__(self, path: str | Path, tokenizer: KimiTokenizer, seq_len: int, processor: ImageProcessor) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 for image-text samples, got {seq_len}")
        specials = tokenizer.special_tokens
        if IMAGE_PLACEHOLDER not in specials:
            raise ValueError(f"tokenizer {tokenizer!r} has no {IMAGE_PLACEHOLDER} special token for images")
        self.placeholder_id = specials[IMAGE_PLACEHOLDER]
        self.pad_id = tokenizer.pad_id
        self.seq_len = seq_len
        self.processor = processor
        self.records = ImageTextRecords(path)
        self.num_truncated = 0
        # Per row: the unexpanded ids, the grid of its image and the expanded length, built once.
        self._items: list[tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, int, int]]] = []
        for index in range(len(self.records)):
            self._items.append(self._encode(index, tokenizer))
        if not self._items:
            raise ValueError(f"{path} holds no image-text rows")

    def _encode(self, index: int, tokenizer: KimiTokenizer):
        where, row = self.records.where(index), self.records.row(index)
        question, answer = row.get("question"), row.get("answer")
        for name, value in (("question", question), ("answer", answer)):
            if not isinstance(value, str):
                raise ValueError(f"{where}: '{name}' must be a string, got {value!r}")
        with open_image(row["image"], where) as image:  # reads the header only; closes the file
            size = image.size
        grid = self.processor.grid_for_size(*size, where=where)
        n_image = self.processor.tokens_for_grid(grid)
        ids, mask = encode_chat(tokenizer, medpix_messages(question, answer))
        expanded = len(ids) + n_image - 1
        if expanded > self.seq_len:
            prompt = mask.index(True) if True in mask else len(ids)
            keep = self.seq_len - (n_image - 1)
            if keep <= prompt:
                raise ValueError(
                    f"{where}: the prompt takes {prompt + n_image - 1} positions with its {n_image}-token image, "
                    f"which leaves no room for the answer in seq_len = {self.seq_len}; raise training.seq_len or "
                    f"lower data.image_max_pixels"
                )
            ids, mask = ids[:keep], mask[:keep]
            self.num_truncated += 1
        labels, doc_ids, _ = expanded_labels(ids, mask, self.placeholder_id, [n_image], self.seq_len)
        input_ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        input_ids[: len(ids)] = ids
        return input_ids, labels, doc_ids, grid

    def __len__(self) -> int:
        return len(self._items)

    def image_bounds(self) -> tuple[int, int]:
        """``(images, patches)`` of the largest sample: one image per row, the most patches of any row's image
        (known from the headers read at build time; pipeline stages pad every sample's images to it)."""
        return 1, max(t * h * w for *_, (t, h, w) in self._items)

    def __getitem__(self, index: int) -> Sample:
        input_ids, labels, doc_ids, grid = self._items[index]
        where = self.records.where(index)
        with open_image(self.records.row(index)["image"], where) as image:
            processed = self.processor(image, where)
        if processed.grid_thw != grid:  # the file changed since the dataset was built
            raise ValueError(f"{where}: the image now has patch grid {processed.grid_thw}, not {grid}")
        return {
            "input_ids": torch.from_numpy(input_ids.copy()),
            "labels": torch.from_numpy(labels.copy()),
            "doc_ids": torch.from_numpy(doc_ids.copy()),
            "pixel_values": processed.pixel_values,
            "grid_thws": torch.tensor([processed.grid_thw], dtype=torch.int64),
        }


def collate_image_text(samples: Sequence[Sample]) -> Batch:
    """Stacks the ``[seq_len]`` fields and concatenates the images of all samples, in sample order (the order
    of the placeholders in ``input_ids``): ``pixel_values [sum L, 3, 14, 14]``, ``grid_thws [images, 3]``."""
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    batch = {key: torch.stack([s[key] for s in samples]) for key in POSITION_KEYS}
    batch["pixel_values"] = torch.cat([s["pixel_values"] for s in samples])
    batch["grid_thws"] = torch.cat([s["grid_thws"] for s in samples])
    return batch


MedPixDataset.collate = staticmethod(collate_image_text)  # the dataloader batches samples with it
