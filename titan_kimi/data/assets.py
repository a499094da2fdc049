"""Paths of the small tokenizer and sample data shipped inside the package (titan_kimi/assets/)."""

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
# Our own byte-level BPE in the Kimi tiktoken format, vocab_size 2048 (scripts/tools/build_tokenizer.py).
TOKENIZER_DIR = ASSETS_DIR / "tokenizer"
# Our own generated corpora (scripts/tools/make_sample_data.py).
SAMPLE_TEXT_PATH = ASSETS_DIR / "data" / "sample_text.jsonl"
SAMPLE_HELLASWAG_PATH = ASSETS_DIR / "data" / "sample_hellaswag.jsonl"
# Their validation splits (no document or context of the training files), for data.validation_path = "".
SAMPLE_TEXT_VALIDATION_PATH = ASSETS_DIR / "data" / "sample_text_validation.jsonl"
SAMPLE_HELLASWAG_VALIDATION_PATH = ASSETS_DIR / "data" / "sample_hellaswag_validation.jsonl"
# Our own generated image-text sample in the MedPix-VQA schema (scripts/tools/make_sample_medpix.py).
SAMPLE_MEDPIX_PATH = ASSETS_DIR / "data" / "sample_medpix" / "sample_medpix.jsonl"
SAMPLE_MEDPIX_VALIDATION_PATH = ASSETS_DIR / "data" / "sample_medpix" / "sample_medpix_validation.jsonl"
