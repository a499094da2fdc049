"""Kimi tiktoken tokenizer, loaded from a local directory (architecture spec §11.1).

The directory holds two files:

- ``tiktoken.model``: one ``<base64 token bytes> <rank>`` pair per line. The ranks must be exactly
  0..N-1; N is the base vocabulary size.
- ``tokenizer_config.json``: ``added_tokens_decoder`` (``"id": {"content": name}``) names the 256
  reserved special ids N..N+255; unnamed ones become ``<|reserved_token_{id}|>``. ``bos_token``,
  ``eos_token`` and ``pad_token`` pick among them (defaults ``[BOS]`` and ``[EOS]``; without a
  ``pad_token`` the pad id is the eos id, which is safe because padded positions never carry loss).

Nothing is downloaded: a missing directory or file is a ``ValueError`` naming the path.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import tiktoken
from torchtitan.components.tokenizer import BaseTokenizer

MODEL_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"

# The Kimi pre-tokenizer, verbatim from the public Kimi-K2 ``tokenization_kimi.py``: Han runs; two
# Latin word patterns (lower-case-ending and upper-case words) that exclude Han, with English
# contractions; numbers in groups of 1-3 digits; punctuation runs with trailing newlines; newline
# runs; trailing whitespace; whitespace. ``&&`` is character-class intersection (Rust regex syntax).
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

NUM_RESERVED_SPECIAL_TOKENS = 256
# tiktoken's Rust core can panic on very long inputs (openai/tiktoken#195), so text is encoded in
# chunks of at most this many characters ...
MAX_ENCODE_CHARS = 400_000
# ... and runs of whitespace or of non-whitespace longer than this are cut.
MAX_CONSECUTIVE_SAME_CLASS_CHARS = 25_000

DEFAULT_BOS_TOKEN = "[BOS]"
DEFAULT_EOS_TOKEN = "[EOS]"


def load_mergeable_ranks(model_path: Path) -> dict[bytes, int]:
    """Reads a ``tiktoken.model`` file; ranks must be unique and cover 0..N-1."""
    if not model_path.is_file():
        raise ValueError(f"tokenizer file not found: {model_path} (expected a {MODEL_FILE} file)")
    ranks: dict[bytes, int] = {}
    seen_ranks: dict[int, int] = {}  # rank -> line number, for the duplicate message
    with open(model_path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            line = raw.strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(
                    f"{model_path}:{line_no}: malformed line {raw[:80]!r}; expected '<base64 token> <rank>'"
                )
            try:
                token = base64.b64decode(parts[0], validate=True)
                rank = int(parts[1])
            except (binascii.Error, ValueError) as e:
                raise ValueError(
                    f"{model_path}:{line_no}: malformed line {raw[:80]!r}; expected '<base64 token> <rank>' ({e})"
                ) from None
            if rank in seen_ranks:
                raise ValueError(
                    f"{model_path}:{line_no}: duplicate rank {rank} (first seen on line {seen_ranks[rank]})"
                )
            if token in ranks:
                raise ValueError(f"{model_path}:{line_no}: duplicate token {token!r} (rank {ranks[token]})")
            seen_ranks[rank] = line_no
            ranks[token] = rank
    if not ranks:
        raise ValueError(f"{model_path}: no tokens found")
    if max(seen_ranks) != len(ranks) - 1 or min(seen_ranks) != 0:
        missing = next(r for r in range(len(ranks)) if r not in seen_ranks)
        raise ValueError(
            f"{model_path}: ranks must be exactly 0..{len(ranks) - 1} (one per token); rank {missing} is missing"
        )
    return ranks


def _token_name(value: Any, field: str, config_path: Path) -> str | None:
    """HF configs store a special token either as a string or as an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{config_path}: '{field}' must be a string or {{'content': str}}, got {value!r}")


def load_special_tokens(config_path: Path, num_base_tokens: int) -> tuple[dict[str, int], dict[str, Any]]:
    """Names the reserved ids num_base_tokens..+255 from ``added_tokens_decoder``; returns (specials, config)."""
    if not config_path.is_file():
        raise ValueError(f"tokenizer config not found: {config_path} (expected a {CONFIG_FILE} file)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object at top level")

    first, end = num_base_tokens, num_base_tokens + NUM_RESERVED_SPECIAL_TOKENS
    names: dict[int, str] = {}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise ValueError(f"{config_path}: added_tokens_decoder key {key!r} is not an integer id") from None
        if not first <= token_id < end:
            raise ValueError(
                f"{config_path}: added token id {token_id} is outside the reserved range [{first}, {end})"
            )
        name = _token_name(entry, f"added_tokens_decoder[{key}]", config_path)
        if name is None:
            raise ValueError(f"{config_path}: added_tokens_decoder[{key}] has no content")
        names[token_id] = name

    specials: dict[str, int] = {}
    for token_id in range(first, end):
        name = names.get(token_id, f"<|reserved_token_{token_id}|>")
        if name in specials:
            raise ValueError(f"{config_path}: special token {name!r} names both id {specials[name]} and {token_id}")
        specials[name] = token_id
    return specials, config


def split_long_runs(text: str, max_run: int = MAX_CONSECUTIVE_SAME_CLASS_CHARS) -> Iterator[str]:
    """Cuts ``text`` so that no piece holds more than ``max_run`` consecutive whitespace or
    non-whitespace characters (tiktoken can overflow its stack on such runs, openai/tiktoken#195)."""
    if not text:
        return
    run_len = 0
    run_is_space = text[0].isspace()
    piece_start = 0
    for i, ch in enumerate(text):
        is_space = ch.isspace()
        if is_space != run_is_space:
            run_is_space = is_space
            run_len = 1
            continue
        run_len += 1
        if run_len > max_run:
            yield text[piece_start:i]
            piece_start = i
            run_len = 1
    yield text[piece_start:]


class KimiTokenizer(BaseTokenizer):
    """Byte-level BPE with the Kimi pre-tokenizer and 256 reserved special ids.

    ``encode`` never adds BOS or EOS. With ``allow_special=False`` (the default, and what user text
    must use) a string such as ``"<|im_end|>"`` is encoded as ordinary text, so data cannot inject
    control tokens; with ``allow_special=True`` every special-token name in the text becomes its id.
    """

    pat_str = KIMI_PAT_STR

    def __init__(self, tokenizer_dir: str | os.PathLike[str]):
        # BaseTokenizer.__init__ only assigns eos_id = None, which our read-only property replaces.
        path = Path(tokenizer_dir)
        if not path.is_dir():
            raise ValueError(
                f"tokenizer directory not found: {path} (expected a directory holding {MODEL_FILE} and {CONFIG_FILE})"
            )
        self.path = path
        ranks = load_mergeable_ranks(path / MODEL_FILE)
        self.num_base_tokens = len(ranks)
        specials, config = load_special_tokens(path / CONFIG_FILE, self.num_base_tokens)
        self._special_tokens = specials
        self._model = tiktoken.Encoding(
            name=f"kimi:{path}", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials
        )
        # Longest names first so that a name that is a prefix of another never wins.
        names = sorted(specials, key=len, reverse=True)
        self._special_regex = re.compile("(" + "|".join(re.escape(n) for n in names) + ")")

        config_path = path / CONFIG_FILE
        bos = _token_name(config.get("bos_token"), "bos_token", config_path) or DEFAULT_BOS_TOKEN
        eos = _token_name(config.get("eos_token"), "eos_token", config_path) or DEFAULT_EOS_TOKEN
        pad = _token_name(config.get("pad_token"), "pad_token", config_path)
        self._bos_id = self._lookup_special(bos, "bos_token")
        self._eos_id = self._lookup_special(eos, "eos_token")
        self._pad_id = self._eos_id if pad is None else self._lookup_special(pad, "pad_token")

    def _lookup_special(self, name: str, field: str) -> int:
        if name not in self._special_tokens:
            raise ValueError(
                f"{self.path / CONFIG_FILE}: {field} {name!r} is not one of the special tokens "
                f"(named in added_tokens_decoder)"
            )
        return self._special_tokens[name]

    # -- sizes and special ids ------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.num_base_tokens + NUM_RESERVED_SPECIAL_TOKENS

    def get_vocab_size(self) -> int:
        return self.vocab_size

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:  # type: ignore[override]  # BaseTokenizer declares a plain attribute
        return self._eos_id

    @property
    def pad_id(self) -> int:
        """The configured ``pad_token``'s id, or the eos id when the config names none."""
        return self._pad_id

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id >= self.num_base_tokens

    def token_to_id(self, token: str) -> int:
        """Id of a special-token name, or of a base token whose UTF-8 bytes are ``token``."""
        if token in self._special_tokens:
            return self._special_tokens[token]
        try:
            return self._model.encode_single_token(token.encode("utf-8"))
        except KeyError:
            raise ValueError(f"{token!r} is neither a special token nor a single base token of {self.path}") from None

    # -- encoding -------------------------------------------------------------------------------

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        for start in range(0, len(text), MAX_ENCODE_CHARS):
            for piece in split_long_runs(text[start : start + MAX_ENCODE_CHARS]):
                ids.extend(self._model.encode_ordinary(piece))
        return ids

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:  # type: ignore[override]
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        if not allow_special:
            return self._encode_ordinary(text)
        # Split on special names first, so chunking can never cut through one.
        ids: list[int] = []
        for i, part in enumerate(self._special_regex.split(text)):
            if i % 2 == 1:
                ids.append(self._special_tokens[part])
            elif part:
                ids.extend(self._encode_ordinary(part))
        return ids

    def decode(self, ids: Iterable[int]) -> str:  # type: ignore[override]
        """Decodes ids (special ids become their names); invalid UTF-8 becomes U+FFFD."""
        id_list = [int(i) for i in ids]
        bad = [i for i in id_list if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self._model.decode(id_list, errors="replace")

    def __repr__(self) -> str:
        return f"KimiTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"
