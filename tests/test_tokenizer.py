import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import regex
from torchtitan.components.tokenizer import BaseTokenizer

from titan_kimi.data.assets import SAMPLE_TEXT_PATH, TOKENIZER_DIR
from titan_kimi.data.tokenizer import KIMI_PAT_STR, KimiTokenizer, split_long_runs

REPO_ROOT = Path(__file__).resolve().parent.parent

# The public Kimi-K2 `tokenization_kimi.py` pat_str, joined with "|".
EXPECTED_PAT_STR = (
    r"""[\p{Han}]+"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+"""
    r"""|\s+(?!\S)"""
    r"""|\s+"""
)


@pytest.fixture(scope="module")
def tok() -> KimiTokenizer:
    return KimiTokenizer(TOKENIZER_DIR)


def test_regex_is_the_kimi_one():
    assert KIMI_PAT_STR == EXPECTED_PAT_STR
    assert KimiTokenizer.pat_str == EXPECTED_PAT_STR


def test_regex_splits_like_the_spec_says():
    # `regex` V1 reads `&&` as class intersection, as tiktoken's Rust engine does.
    pieces = regex.findall(KIMI_PAT_STR, "Hello world's 1234567 中文abc  \n\n  x!!\n HELLO'S", flags=regex.V1)
    assert pieces == [
        "Hello", " world's", " ", "123", "456", "7", " ", "中文", "abc", "  \n\n", " ", " x", "!!\n", " HELLO'S",
    ]


def test_our_tokenizer_sizes_and_specials(tok):
    assert isinstance(tok, BaseTokenizer)
    assert tok.vocab_size == tok.get_vocab_size() == 2048
    assert tok.num_base_tokens == 1792
    specials = tok.special_tokens
    assert len(specials) == 256 and sorted(specials.values()) == list(range(1792, 2048))
    for name in ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                 "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>", "<|open|>", "<|close|>",
                 "<|sep|>", "<|end_of_msg|>", "<|kimi_image_placeholder|>", "[PAD]"]:
        assert name in specials, name
    assert tok.bos_id == specials["[BOS]"] == 1792
    assert tok.eos_id == specials["[EOS]"] == 1793
    assert tok.pad_id == specials["[PAD]"]
    assert specials["<|reserved_token_1800|>"] == 1800  # unnamed ids get reserved names


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Hello, world! It's a fine day, isn't it?",
        "Café naïve résumé — “quotes” and emoji 🙂🚀",
        "你好，世界。中文和English混合text",
        "3.14159 1234567890 -42 1e10 2026-01-01",
        "tabs\tand\t\tspaces    and\n\n\nnewlines\r\n  \n trailing   ",
        "def f(x):\n    return x * 2\n",
        "\x00\x01 control bytes \uffff",
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.num_base_tokens for i in ids)
    assert tok.decode(ids) == text


def test_numbers_split_into_groups_of_at_most_three_digits(tok):
    pieces = [tok.decode([i]) for i in tok.encode("1234567")]
    assert "".join(pieces) == "1234567"
    ends = {sum(len(p) for p in pieces[: k + 1]) for k in range(len(pieces))}
    assert {3, 6, 7} <= ends  # BPE never merges across the pre-tokenizer's 3-digit groups


def test_bpe_compresses_the_training_text(tok):
    text = json.loads(SAMPLE_TEXT_PATH.read_text(encoding="utf-8").splitlines()[0])["text"]
    assert len(tok.encode(text)) < len(text.encode("utf-8")) / 2


def test_special_strings_are_plain_text_unless_allowed(tok):
    text = "a<|open|>b [EOS]"
    plain = tok.encode(text)
    assert all(i < tok.num_base_tokens for i in plain)
    assert tok.decode(plain) == text
    special = tok.encode(text, allow_special=True)
    assert special == tok.encode("a") + [tok.token_to_id("<|open|>")] + tok.encode("b ") + [tok.eos_id]
    assert tok.decode(special) == text


def test_token_to_id(tok):
    assert tok.token_to_id("<|sep|>") == tok.special_tokens["<|sep|>"]
    assert tok.token_to_id("a") == ord("a")  # single bytes hold ranks 0..255
    assert tok.decode([tok.token_to_id(" the")]) == " the"
    with pytest.raises(ValueError, match="neither a special token"):
        tok.token_to_id("<|no_such_token|>")


def test_decode_rejects_out_of_range_ids(tok):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([2048])


def test_long_inputs_are_split_and_round_trip(tok):
    assert list(split_long_runs("aaaa  bbbbbb", max_run=3)) == ["aaa", "a  bbb", "bbb"]
    assert "".join(split_long_runs("x" * 10 + " " * 7, max_run=4)) == "x" * 10 + " " * 7
    text = "a" * 30_000 + " " * 30_000 + "word " * 90_000  # > 25k runs and > 400k characters
    assert tok.decode(tok.encode(text)) == text


# -- loading errors ------------------------------------------------------------------------------

def _copy_tokenizer(tmp_path: Path) -> Path:
    target = tmp_path / "tok"
    shutil.copytree(TOKENIZER_DIR, target)
    return target


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(ValueError, match="tokenizer directory not found.*nope"):
        KimiTokenizer(tmp_path / "nope")
    d = _copy_tokenizer(tmp_path)
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        KimiTokenizer(d)
    (d / "tiktoken.model").unlink()
    with pytest.raises(ValueError, match="tiktoken.model"):
        KimiTokenizer(d)


def test_malformed_line(tmp_path):
    d = _copy_tokenizer(tmp_path)
    with open(d / "tiktoken.model", "a") as f:
        f.write("not-a-valid-line\n")
    with pytest.raises(ValueError, match=r"tiktoken.model:1793: malformed line"):
        KimiTokenizer(d)


def test_bad_base64(tmp_path):
    d = _copy_tokenizer(tmp_path)
    with open(d / "tiktoken.model", "a") as f:
        f.write("@@@@ 1792\n")
    with pytest.raises(ValueError, match="malformed line"):
        KimiTokenizer(d)


def test_duplicate_rank(tmp_path):
    d = _copy_tokenizer(tmp_path)
    with open(d / "tiktoken.model", "a") as f:
        f.write("enp6eg== 5\n")  # b"zzzz" with an already used rank
    with pytest.raises(ValueError, match=r"tiktoken.model:1793: duplicate rank 5"):
        KimiTokenizer(d)


def test_rank_gap(tmp_path):
    d = _copy_tokenizer(tmp_path)
    with open(d / "tiktoken.model", "a") as f:
        f.write("enp6eg== 1900\n")
    with pytest.raises(ValueError, match="rank 1792 is missing"):
        KimiTokenizer(d)


def _edit_config(d: Path, **changes) -> None:
    path = d / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def test_pad_falls_back_to_eos_and_defaults_apply(tmp_path):
    d = _copy_tokenizer(tmp_path)
    _edit_config(d, pad_token=None, bos_token=None, eos_token={"content": "[EOS]"})
    tok = KimiTokenizer(d)
    assert tok.pad_id == tok.eos_id == tok.special_tokens["[EOS]"]
    assert tok.bos_id == tok.special_tokens["[BOS]"]


def test_config_errors(tmp_path):
    d = _copy_tokenizer(tmp_path)
    _edit_config(d, eos_token="<|not_special|>")
    with pytest.raises(ValueError, match="eos_token '<\\|not_special\\|>' is not one of the special tokens"):
        KimiTokenizer(d)
    _edit_config(d, eos_token="[EOS]", added_tokens_decoder={"5": {"content": "[X]"}})
    with pytest.raises(ValueError, match=r"added token id 5 is outside the reserved range \[1792, 2048\)"):
        KimiTokenizer(d)


def test_no_added_tokens_gives_reserved_names(tmp_path):
    d = _copy_tokenizer(tmp_path)
    _edit_config(d, added_tokens_decoder={"1793": {"content": "[EOS]"}}, bos_token="<|reserved_token_1792|>",
                 pad_token=None)
    tok = KimiTokenizer(d)
    assert tok.bos_id == 1792 and tok.eos_id == tok.pad_id == 1793
    assert tok.special_tokens["<|reserved_token_2047|>"] == 2047


# -- the shipped tokenizer is what the build script produces --------------------------------------

def test_build_script_reproduces_the_shipped_tokenizer(tmp_path):
    spec = importlib.util.spec_from_file_location("build_tokenizer", REPO_ROOT / "scripts" / "tools" / "build_tokenizer.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    vocab = build.train_bpe(build.count_pieces(build.training_texts(build.DATA_DIR)), build.BASE_VOCAB_SIZE)
    build.write_tokenizer(tmp_path, vocab)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (TOKENIZER_DIR / name).read_bytes(), name
