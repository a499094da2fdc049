"""The dataset registry: a name and a local path (or None for the shipped sample) -> a map-style dataset.

Every dataset has ``__len__`` and ``__getitem__(i) -> sample`` (the format of batch.py) and is a
pure function of its arguments, which is what makes the dataloader resumable and rank-sharded.

| name          | path                                    | sample                                   |
|---------------|-----------------------------------------|------------------------------------------|
| ``packed_text`` | ``{"text": ...}`` JSON lines or parquet | packed documents + EOS, ``seq_len`` rows |
| ``hellaswag``   | HellaSwag JSON lines or parquet         | prompt/answer SFT, right-padded          |
| ``synthetic``   | none                                    | repeated n-gram documents                |
| ``medpix``      | MedPix-VQA parquet, save_to_disk folder, | image + question -> answer SFT, padded,  |
|                 | or (image path, question, answer) jsonl | with ``pixel_values`` and ``grid_thws``  |
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from titan_kimi.data.assets import (
    SAMPLE_HELLASWAG_PATH,
    SAMPLE_HELLASWAG_VALIDATION_PATH,
    SAMPLE_MEDPIX_PATH,
    SAMPLE_MEDPIX_VALIDATION_PATH,
    SAMPLE_TEXT_PATH,
    SAMPLE_TEXT_VALIDATION_PATH,
)
from titan_kimi.data.batch import Sample
from titan_kimi.data.hellaswag import HellaSwagDataset
from titan_kimi.data.image_processor import ImageProcessor
from titan_kimi.data.medpix import MedPixDataset
from titan_kimi.data.packed_text import PackedTextDataset
from titan_kimi.data.synthetic import SyntheticDataset
from titan_kimi.data.tokenizer import KimiTokenizer

DATASET_NAMES = ("packed_text", "hellaswag", "synthetic", "medpix")
SPLITS = ("train", "validation")
DEFAULT_PATHS = {
    "train": {"packed_text": SAMPLE_TEXT_PATH, "hellaswag": SAMPLE_HELLASWAG_PATH, "medpix": SAMPLE_MEDPIX_PATH},
    "validation": {"packed_text": SAMPLE_TEXT_VALIDATION_PATH, "hellaswag": SAMPLE_HELLASWAG_VALIDATION_PATH,
                   "medpix": SAMPLE_MEDPIX_VALIDATION_PATH},
}


class MapDataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Sample: ...


def build_dataset(
    name: str,
    path: str | Path | None,
    tokenizer: KimiTokenizer | None,
    *,
    seq_len: int,
    seed: int = 0,
    vocab_size: int | None = None,
    split: str = "train",
    image_processor: ImageProcessor | None = None,
) -> MapDataset:
    """Builds a dataset by name. ``path`` None (or "") means the sample shipped in titan_kimi/assets/data,
    its training or its validation ``split``.

    ``synthetic`` takes no path; its vocabulary is ``vocab_size`` or else the tokenizer's, and its
    documents end with the tokenizer's EOS when a tokenizer is given. ``medpix`` resizes its images with
    ``image_processor`` (default: ``ImageProcessor()``) and may be a folder (parquet files or a ``datasets``
    folder saved to disk).
    """
    if name not in DATASET_NAMES:
        raise ValueError(f"unknown dataset {name!r}; valid choices: {list(DATASET_NAMES)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {list(SPLITS)}")
    if name == "synthetic":
        if path:
            raise ValueError(f"dataset 'synthetic' takes no path, got {str(path)!r}")
        vocab = vocab_size if vocab_size is not None else (tokenizer.vocab_size if tokenizer is not None else None)
        if vocab is None:
            raise ValueError("dataset 'synthetic' needs vocab_size or a tokenizer")
        eos = tokenizer.eos_id if tokenizer is not None and tokenizer.eos_id < vocab else None
        return SyntheticDataset(vocab, seq_len, seed, eos_id=eos)

    if tokenizer is None:
        raise ValueError(f"dataset {name!r} needs a tokenizer")
    resolved = Path(path) if path else DEFAULT_PATHS[split][name]
    if name == "medpix":
        if not resolved.exists():
            raise ValueError(f"dataset path {str(resolved)!r} for 'medpix' does not exist; expected a local .jsonl or "
                             f".parquet file, a folder of parquet files or a datasets save_to_disk folder")
        return MedPixDataset(resolved, tokenizer, seq_len, image_processor or ImageProcessor())
    if not resolved.is_file():
        raise ValueError(
            f"dataset path {str(resolved)!r} for {name!r} is not a file; expected a local .jsonl or .parquet "
            f"file, or no path for the shipped sample {str(DEFAULT_PATHS[split][name])!r}"
        )
    if name == "packed_text":
        return PackedTextDataset(resolved, tokenizer, seq_len)
    return HellaSwagDataset(resolved, tokenizer, seq_len)
