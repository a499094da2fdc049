"""Data: the Kimi tokenizer, chat encoding, datasets and the resumable rank-sharded dataloader."""

from titan_kimi.data.assets import SAMPLE_HELLASWAG_PATH, SAMPLE_TEXT_PATH, TOKENIZER_DIR
from titan_kimi.data.batch import IGNORE_INDEX, collate
from titan_kimi.data.chat import encode_chat
from titan_kimi.data.dataloader import ShardedDataLoader, build_dataloader
from titan_kimi.data.datasets import DATASET_NAMES, build_dataset
from titan_kimi.data.tokenizer import KimiTokenizer

__all__ = [
    "DATASET_NAMES",
    "IGNORE_INDEX",
    "SAMPLE_HELLASWAG_PATH",
    "SAMPLE_TEXT_PATH",
    "TOKENIZER_DIR",
    "KimiTokenizer",
    "ShardedDataLoader",
    "build_dataloader",
    "build_dataset",
    "collate",
    "encode_chat",
]
