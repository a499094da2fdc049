"""Trains the 2,048-token BPE tokenizer shipped in titan_kimi/assets/tokenizer/: python scripts/tools/build_tokenizer.py [--out-dir DIR]

    python scripts/tools/build_tokenizer.py [--out-dir titan_kimi/assets/tokenizer]

The output is in the Kimi tiktoken format (see titan_kimi/data/tokenizer.py): ``tiktoken.model``
with the 256 single bytes at ranks 0..255 followed by 1,536 learned merges (base vocabulary 1,792),
and ``tokenizer_config.json`` naming the 256 reserved special ids 1,792..2,047, so vocab_size = 2,048.

Training data: the sample corpora in titan_kimi/assets/data/ (run scripts/tools/make_sample_data.py
first if they are missing) plus the literal text of the chat format, so that chat headers are short.
Text is pre-split with the Kimi regex (the one the tokenizer uses at run time), then merges are
learned greedily: the most frequent adjacent pair wins, ties go to the pair of smallest ids. The run
is deterministic (the same files every time) and takes a few seconds.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import regex

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # scripts run from a checkout, not an installed package

from titan_kimi.data.tokenizer import (  # noqa: E402
    CONFIG_FILE,
    KIMI_PAT_STR,
    MODEL_FILE,
    NUM_RESERVED_SPECIAL_TOKENS,
    KimiTokenizer,
)

BASE_VOCAB_SIZE = 1792
DATA_DIR = REPO_ROOT / "titan_kimi" / "assets" / "data"
DEFAULT_OUT_DIR = REPO_ROOT / "titan_kimi" / "assets" / "tokenizer"

# Offsets into the reserved range. The first ones follow the public Kimi-K2 layout ([BOS] at N,
# [EOS] at N+1, ...); the chat-format tokens of K3 have unknown ids upstream and are placed after.
SPECIAL_TOKEN_OFFSETS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    17: "<|im_middle|>",
    21: "<|kimi_image_placeholder|>",
    22: "<|open|>",
    23: "<|close|>",
    24: "<|sep|>",
    25: "<|end_of_msg|>",
    254: "[UNK]",
    255: "[PAD]",
}

# Literal text of the chat format (titan_kimi/data/chat.py), repeated so its pieces get merged.
CHAT_PHRASES = [
    'message role="system"', 'message role="user"', 'message role="assistant"', 'message role="tool"',
    ' type="tool-declare"', ' type="thinking-effort"', ' name="', ' tool="', ' index="', "think",
    "response", "tools", 'call tool="', 'argument key="', ' type="string"', ' type="number"',
    ' type="boolean"', ' type="object"', ' type="array"', ' type="null"', 'json type="object"', "message",
    "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n", "\n```",
    "low", "medium", "high", "max",
]
CHAT_PHRASE_REPEATS = 20


def training_texts(data_dir: Path) -> list[str]:
    text_path = data_dir / "sample_text.jsonl"
    hellaswag_path = data_dir / "sample_hellaswag.jsonl"
    for path in (text_path, hellaswag_path):
        if not path.is_file():
            raise SystemExit(f"missing {path}; run scripts/tools/make_sample_data.py first")
    texts = [json.loads(line)["text"] for line in text_path.read_text(encoding="utf-8").splitlines() if line]
    for line in hellaswag_path.read_text(encoding="utf-8").splitlines():
        if line:
            item = json.loads(line)
            texts.append(item["ctx"])
            texts.extend(" " + ending for ending in item["endings"])
    texts.extend(CHAT_PHRASES * CHAT_PHRASE_REPEATS)
    return texts


def count_pieces(texts: list[str]) -> Counter[bytes]:
    # V1 is the `regex` flavour that reads `&&` as class intersection, as tiktoken's Rust regex does.
    pattern = regex.compile(KIMI_PAT_STR, regex.V1)
    counts: Counter[bytes] = Counter()
    for text in texts:
        counts.update(piece.encode("utf-8") for piece in pattern.findall(text))
    return counts


def merge_pair(seq: list[int], a: int, b: int, new_id: int) -> list[int]:
    out: list[int] = []
    i = 0
    while i < len(seq):
        if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return out


def train_bpe(piece_counts: Counter[bytes], base_vocab_size: int) -> list[bytes]:
    """Returns the token byte strings in rank order: 256 single bytes, then merges."""
    vocab = [bytes([i]) for i in range(256)]
    id_of = {tok: i for i, tok in enumerate(vocab)}
    pieces = sorted(piece_counts)  # fixed order, so the run is deterministic
    seqs = [list(p) for p in pieces]
    freqs = [piece_counts[p] for p in pieces]

    pair_counts: Counter[tuple[int, int]] = Counter()
    pieces_with: defaultdict[tuple[int, int], set[int]] = defaultdict(set)  # may hold stale entries
    for pi, seq in enumerate(seqs):
        for pair in zip(seq, seq[1:]):
            pair_counts[pair] += freqs[pi]
            pieces_with[pair].add(pi)

    while len(vocab) < base_vocab_size:
        if not pair_counts:
            raise SystemExit(f"corpus too small: no pairs left after {len(vocab)} tokens")
        (a, b), _ = max(pair_counts.items(), key=lambda kv: (kv[1], -kv[0][0], -kv[0][1]))
        merged = vocab[a] + vocab[b]
        # Two different pairs can spell the same bytes; reuse the token instead of a duplicate rank.
        new_id = id_of.get(merged)
        if new_id is None:
            new_id = len(vocab)
            vocab.append(merged)
            id_of[merged] = new_id
        for pi in sorted(pieces_with.pop((a, b))):
            seq, freq = seqs[pi], freqs[pi]
            for pair in zip(seq, seq[1:]):
                pair_counts[pair] -= freq
                if pair_counts[pair] <= 0:
                    del pair_counts[pair]
            seq = merge_pair(seq, a, b, new_id)
            seqs[pi] = seq
            for pair in zip(seq, seq[1:]):
                pair_counts[pair] += freq
                pieces_with[pair].add(pi)
    return vocab


def tokenizer_config(base_vocab_size: int) -> dict:
    added = {}
    for offset in range(NUM_RESERVED_SPECIAL_TOKENS):
        name = SPECIAL_TOKEN_OFFSETS.get(offset)
        if name is not None:
            added[str(base_vocab_size + offset)] = {
                "content": name, "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": True,
            }
    roles = ("[BOS]", "[EOS]", "[UNK]", "[PAD]")
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": [n for n in SPECIAL_TOKEN_OFFSETS.values() if n not in roles],
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }


def write_tokenizer(out_dir: Path, vocab: list[bytes]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / MODEL_FILE, "w", encoding="ascii", newline="\n") as f:
        for rank, token in enumerate(vocab):
            f.write(f"{base64.b64encode(token).decode('ascii')} {rank}\n")
    config = tokenizer_config(len(vocab))
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)
    args = parser.parse_args()

    start = time.perf_counter()
    texts = training_texts(args.data_dir)
    vocab = train_bpe(count_pieces(texts), BASE_VOCAB_SIZE)
    write_tokenizer(args.out_dir, vocab)

    # Check the result loads and round-trips the training text.
    tok = KimiTokenizer(args.out_dir)
    n_tokens = 0
    n_bytes = 0
    for text in texts:
        ids = tok.encode(text)
        if tok.decode(ids) != text:
            raise SystemExit(f"round trip failed on {text[:60]!r}")
        n_tokens += len(ids)
        n_bytes += len(text.encode("utf-8"))
    print(
        f"wrote {args.out_dir}: vocab_size={tok.vocab_size} "
        f"({len(vocab)} base + {NUM_RESERVED_SPECIAL_TOKENS} special), "
        f"{n_bytes / n_tokens:.2f} bytes/token on the training text, {time.perf_counter() - start:.1f}s"
    )


if __name__ == "__main__":
    main()
