import json
import sys
from pathlib import Path

import pytest
import torch

from titan_kimi.data.assets import SAMPLE_HELLASWAG_PATH, SAMPLE_TEXT_PATH, TOKENIZER_DIR
from titan_kimi.data.batch import IGNORE_INDEX
from titan_kimi.data.dataloader import build_dataloader
from titan_kimi.data.datasets import build_dataset
from titan_kimi.data.hellaswag import HellaSwagDataset
from titan_kimi.data.packed_text import PackedTextDataset
from titan_kimi.data.synthetic import SyntheticDataset
from titan_kimi.data.tokenizer import KimiTokenizer


@pytest.fixture(scope="module")
def tok() -> KimiTokenizer:
    return KimiTokenizer(TOKENIZER_DIR)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def assert_labels_are_shifted_inputs(sample: dict) -> None:
    """Where the next position holds a real token, a trained label is that token."""
    ids, labels, docs = sample["input_ids"], sample["labels"], sample["doc_ids"]
    inner = (labels[:-1] != IGNORE_INDEX) & (docs[1:] != 0)
    assert torch.equal(labels[:-1][inner], ids[1:][inner])


ITEMS = [
    {"ctx": "She opens the oven door.", "endings": ["It bakes.", "She takes out the bread.", "No.", "Yes."],
     "label": 1},
    {"ctx": "He ties his shoes", "endings": ["and runs.", "and sleeps."], "label": "0"},
]


# -- HellaSwag -----------------------------------------------------------------------------------

def test_hellaswag_formats_prompt_and_answer_with_answer_only_loss(tok, tmp_path):
    ds = HellaSwagDataset(write_jsonl(tmp_path / "h.jsonl", ITEMS), tok, seq_len=32)
    assert len(ds) == 2
    for item, ending in zip(ITEMS, ["She takes out the bread.", "and runs."]):
        sample = ds[ITEMS.index(item)]
        prompt_ids = tok.encode(item["ctx"])
        answer_ids = tok.encode(" " + ending) + [tok.eos_id]
        n = len(prompt_ids) + len(answer_ids) - 1
        assert sample["input_ids"][:n].tolist() == (prompt_ids + answer_ids)[:-1]
        trained = sample["labels"][sample["labels"] != IGNORE_INDEX].tolist()
        assert trained == answer_ids  # the answer tokens and the EOS, nothing of the prompt
        assert tok.decode(trained) == " " + ending + "[EOS]"
        # The first trained position is the last prompt token.
        assert sample["labels"][len(prompt_ids) - 2] == IGNORE_INDEX
        assert sample["labels"][len(prompt_ids) - 1] == answer_ids[0]
        assert_labels_are_shifted_inputs(sample)
        # Right padding: pad id, doc id 0, no loss.
        assert sample["doc_ids"][:n].tolist() == [1] * n and sample["doc_ids"][n:].tolist() == [0] * (32 - n)
        assert sample["input_ids"][n:].tolist() == [tok.pad_id] * (32 - n)
        assert sample["input_ids"].dtype == torch.int64 and sample["doc_ids"].dtype == torch.int32


def test_hellaswag_truncates_the_prompt_from_the_left(tok, tmp_path):
    item = {"ctx": "one two three four five six seven eight nine ten", "endings": ["stop."], "label": 0}
    answer_ids = tok.encode(" stop.") + [tok.eos_id]
    seq_len = len(answer_ids) + 2
    ds = HellaSwagDataset(write_jsonl(tmp_path / "h.jsonl", [item]), tok, seq_len=seq_len)
    assert ds.num_truncated == 1
    sample = ds[0]
    prompt_ids = tok.encode(item["ctx"])
    kept = prompt_ids[-3:]  # seq_len + 1 tokens in all: 3 prompt tokens remain, from the end
    assert sample["input_ids"].tolist() == (kept + answer_ids)[:-1]
    assert sample["labels"][sample["labels"] != IGNORE_INDEX].tolist() == answer_ids
    with pytest.raises(ValueError, match="row 1: the answer is .* more than seq_len = 2"):
        HellaSwagDataset(tmp_path / "h.jsonl", tok, seq_len=2)


@pytest.mark.parametrize("label", [4, -1, "", "x", None, True, "1.5"])
def test_hellaswag_bad_label_names_row_and_file(tok, tmp_path, label):
    path = write_jsonl(tmp_path / "bad.jsonl", [ITEMS[0], {**ITEMS[0], "label": label}])
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 2: label .* is not a valid index"):
        HellaSwagDataset(path, tok, seq_len=32)


def test_hellaswag_parquet_matches_jsonl(tok, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{**item, "label": str(item["label"])} for item in ITEMS]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "h.parquet")
    from_parquet = HellaSwagDataset(tmp_path / "h.parquet", tok, seq_len=32)
    from_jsonl = HellaSwagDataset(write_jsonl(tmp_path / "h.jsonl", ITEMS), tok, seq_len=32)
    for i in range(2):
        for key in ("input_ids", "labels", "doc_ids"):
            assert torch.equal(from_parquet[i][key], from_jsonl[i][key])


def test_parquet_without_pyarrow_says_to_install_it(tok, tmp_path, monkeypatch):
    (tmp_path / "h.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match="needs pyarrow.*pip install pyarrow"):
        HellaSwagDataset(tmp_path / "h.parquet", tok, seq_len=32)


def test_bad_files(tok, tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl: row 2 is not valid JSON"):
        PackedTextDataset(tmp_path / "broken.jsonl", tok, seq_len=4)
    (tmp_path / "data.csv").write_text("text\n")
    with pytest.raises(ValueError, match=r"suffix '\.csv'; valid suffixes"):
        PackedTextDataset(tmp_path / "data.csv", tok, seq_len=4)
    write_jsonl(tmp_path / "notext.jsonl", [{"text": "fine"}, {"body": "x"}])
    with pytest.raises(ValueError, match=r"notext\.jsonl: row 2 has no string 'text'"):
        PackedTextDataset(tmp_path / "notext.jsonl", tok, seq_len=4)
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl: row 3 is not UTF-8 text \(byte b'\\xe9' at column 14\)"):
        PackedTextDataset(tmp_path / "latin1.jsonl", tok, seq_len=4)
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "a byte-order mark is fine"}\n')
    assert PackedTextDataset(tmp_path / "bom.jsonl", tok, seq_len=4).num_documents == 1
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"bad\.parquet: not a readable parquet file \(.*magic bytes"):
        HellaSwagDataset(tmp_path / "bad.parquet", tok, seq_len=32)


# -- packed text ---------------------------------------------------------------------------------

DOCS = [
    "The cat sat on the mat.",
    "Dogs bark.",
    "A much longer third document that will be cut across rows for sure.",
    "End.",
]


def test_packed_rows_cover_the_stream_with_eos_and_doc_resets(tok, tmp_path):
    seq_len = 8
    ds = PackedTextDataset(write_jsonl(tmp_path / "t.jsonl", [{"text": d} for d in DOCS]), tok, seq_len=seq_len)
    stream = [t for d in DOCS for t in tok.encode(d) + [tok.eos_id]]
    assert len(ds) == (len(stream) - 1) // seq_len
    eos = tok.eos_id
    for r in range(len(ds)):
        s = ds[r]
        ids, labels, docs = s["input_ids"].tolist(), s["labels"].tolist(), s["doc_ids"].tolist()
        assert ids == stream[r * seq_len : (r + 1) * seq_len]
        assert docs[0] == 1
        for t in range(seq_len):
            if ids[t] == eos:
                assert labels[t] == IGNORE_INDEX  # no loss across a document boundary
                if t + 1 < seq_len:
                    assert docs[t + 1] == docs[t] + 1  # the next document starts right after EOS
            else:
                assert labels[t] == stream[r * seq_len + t + 1]  # shifted target, also past the row end
                if t + 1 < seq_len:
                    assert docs[t + 1] == docs[t]
        assert_labels_are_shifted_inputs(s)
    # The long third document spans rows; in the row it continues into it starts as document 1.
    third_start = sum(len(tok.encode(d)) + 1 for d in DOCS[:2])
    continued_row = third_start // seq_len + 1
    assert ds[continued_row]["doc_ids"][0] == 1 and ds[continued_row]["input_ids"][0] != eos


def test_packed_text_too_short(tok, tmp_path):
    with pytest.raises(ValueError, match="fewer than seq_len \\+ 1 = 1001"):
        PackedTextDataset(write_jsonl(tmp_path / "t.jsonl", [{"text": "tiny"}]), tok, seq_len=1000)


def test_shipped_sample_corpora_load(tok):
    packed = PackedTextDataset(SAMPLE_TEXT_PATH, tok, seq_len=128)
    assert packed.num_documents == 700 and len(packed) > 300
    docs = packed[5]["doc_ids"]
    assert docs[0] == 1 and bool((docs[1:] - docs[:-1] >= 0).all())
    hella = HellaSwagDataset(SAMPLE_HELLASWAG_PATH, tok, seq_len=128)
    assert len(hella) == 200 and hella.num_truncated == 0


def test_the_bundled_samples_have_disjoint_validation_splits(tok):
    for name, field in (("packed_text", "text"), ("hellaswag", "ctx")):
        train, val = (build_dataset(name, None, tok, seq_len=128, split=split) for split in ("train", "validation"))
        assert train.path != val.path and val.path.name.endswith("_validation.jsonl")
        seen = {json.loads(line)[field] for line in train.path.read_text(encoding="utf-8").splitlines()}
        held_out = [json.loads(line)[field] for line in val.path.read_text(encoding="utf-8").splitlines()]
        assert held_out and not seen.intersection(held_out)


# -- synthetic -----------------------------------------------------------------------------------

def test_synthetic_is_deterministic_periodic_and_bounded():
    a = SyntheticDataset(1000, 64, seed=3, eos_id=999)
    b = SyntheticDataset(1000, 64, seed=3, eos_id=999)
    c = SyntheticDataset(1000, 64, seed=4, eos_id=999)
    assert torch.equal(a[7]["input_ids"], b[7]["input_ids"])
    assert not torch.equal(a[7]["input_ids"], c[7]["input_ids"])
    for i in range(20):
        s = a[i]
        ids, docs = s["input_ids"], s["doc_ids"]
        assert int(ids.min()) >= 0 and int(ids.max()) < 1000
        assert_labels_are_shifted_inputs(s)
        for d in docs.unique().tolist():
            body = ids[docs == d]
            body = body[body != 999].tolist()
            period = next(p for p in range(1, 13) if all(body[k] == body[k + p] for k in range(len(body) - p)))
            assert period <= 12  # learnable: each document repeats one short pattern
        # Documents after the first begin right after an EOS.
        starts = (docs[1:] != docs[:-1]).nonzero().flatten() + 1
        assert all(int(ids[t - 1]) == 999 for t in starts)


# -- dataloader ----------------------------------------------------------------------------------

LOADER_CASES = [
    ("packed_text", dict(seq_len=32, local_batch_size=4)),
    ("hellaswag", dict(seq_len=64, local_batch_size=4)),
    ("synthetic", dict(seq_len=32, local_batch_size=2)),
]


def take(loader, n: int) -> list[dict]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def batches_equal(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


@pytest.mark.parametrize("name,kwargs", LOADER_CASES)
def test_resume_equals_uninterrupted(tok, name, kwargs):
    def make():
        return build_dataloader(name, None, tok, dp_rank=1, dp_world_size=2, seed=7, shuffle=True, **kwargs)

    loader = make()
    # Run past the end of the first epoch (hellaswag: 200 items / 2 ranks / 4 = 25 batches).
    total = min(len(loader) + 5, 40)
    uninterrupted = take(make(), total)
    first = take(loader, 13)
    state = json.loads(json.dumps(loader.state_dict()))  # plain, serialisable values
    resumed = make()
    resumed.load_state_dict(state)
    assert batches_equal(first + take(resumed, total - 13), uninterrupted)
    batch = uninterrupted[0]
    shape = (kwargs["local_batch_size"], kwargs["seq_len"])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["doc_ids"].shape == shape
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64 and batch["doc_ids"].dtype == torch.int32


@pytest.mark.parametrize("name,kwargs", LOADER_CASES[:2])
def test_two_ranks_see_disjoint_shards(tok, name, kwargs):
    loaders = [build_dataloader(name, None, tok, dp_rank=r, dp_world_size=2, seed=1, shuffle=True, **kwargs)
               for r in range(2)]
    shards = [set(ld.rank_indices(0).tolist()) for ld in loaders]
    assert not shards[0] & shards[1]
    assert len(shards[0]) == len(shards[1]) == len(loaders[0].dataset) // 2
    # The batches hold exactly the samples of the rank's shard, in shard order.
    first = next(iter(loaders[1]))
    first_indices = loaders[1].rank_indices(0)[: kwargs["local_batch_size"]]
    expected = [loaders[1].dataset[int(i)]["input_ids"] for i in first_indices]
    assert torch.equal(first["input_ids"], torch.stack(expected))


def test_epochs_wrap_deterministically_and_reshuffle(tok):
    def make(**kw):
        return build_dataloader("hellaswag", None, tok, seq_len=64, local_batch_size=10, dp_rank=0,
                                dp_world_size=1, seed=5, **kw)

    loader = make(shuffle=True)
    n = len(loader)  # 20 batches per epoch
    two_epochs = take(loader, 2 * n)
    assert batches_equal(two_epochs, take(make(shuffle=True), 2 * n))
    assert loader.rank_indices(0).tolist() != loader.rank_indices(1).tolist()  # a new order each epoch
    assert sorted(loader.rank_indices(1).tolist()) == list(range(200))  # each epoch visits every item once
    ordered = make(shuffle=False)
    assert ordered.rank_indices(0).tolist() == list(range(200)) == ordered.rank_indices(3).tolist()


def test_finite_loader_stops_at_the_epoch_end(tok):
    loader = build_dataloader("hellaswag", None, tok, seq_len=64, local_batch_size=50, dp_rank=0, dp_world_size=2,
                              seed=0, shuffle=False, infinite=False)
    assert len(list(loader)) == 2  # 200 items / 2 ranks / 50
    assert loader.state_dict()["epoch"] == 0
    assert len(list(loader)) == 2 and loader.state_dict()["epoch"] == 1  # the next iter() is the next epoch


def test_loader_errors(tok, tmp_path):
    common = dict(seq_len=32, local_batch_size=2, dp_rank=0, dp_world_size=1, seed=0, shuffle=False)
    valid = r"\['packed_text', 'hellaswag', 'synthetic', 'medpix'\]"
    with pytest.raises(ValueError, match=rf"unknown dataset 'c4'; valid choices: {valid}"):
        build_dataloader("c4", None, tok, **common)
    with pytest.raises(ValueError, match="dataset path .*missing.jsonl.* for 'packed_text' is not a file"):
        build_dataloader("packed_text", tmp_path / "missing.jsonl", tok, **common)
    with pytest.raises(ValueError, match="'synthetic' takes no path"):
        build_dataloader("synthetic", SAMPLE_TEXT_PATH, tok, **common)
    with pytest.raises(ValueError, match="needs vocab_size or a tokenizer"):
        build_dataloader("synthetic", None, None, **common)
    with pytest.raises(ValueError, match="dp_rank 2 is not in \\[0, 2\\)"):
        build_dataloader("synthetic", None, tok, **{**common, "dp_rank": 2, "dp_world_size": 2})
    with pytest.raises(ValueError, match="fewer than dp_world_size \\* local_batch_size = 400"):
        build_dataloader("hellaswag", None, tok, **{**common, "local_batch_size": 400})
    loader = build_dataloader("synthetic", None, None, vocab_size=50, **common)
    state = loader.state_dict()
    other = build_dataloader("synthetic", None, None, vocab_size=50, **{**common, "seed": 1})
    with pytest.raises(ValueError, match="saved with seed=0 but this loader has seed=1"):
        other.load_state_dict(state)
    next(iter(loader))  # 2 samples consumed: a split into batches of 4 does not end there
    wider = build_dataloader("synthetic", None, None, vocab_size=50, **{**common, "local_batch_size": 4})
    with pytest.raises(ValueError, match="2 samples of epoch 0 were consumed .* batches of 1 x 4 = 4 do not end"):
        wider.load_state_dict(loader.state_dict())


def test_state_resumes_under_another_data_parallel_split(tok):
    """Two ranks of 2 sequences and one rank of 4 read the same samples per step; a state saved by one split
    continues in the other with the samples that would have come next."""
    def make(rank, world, batch):
        return build_dataloader("hellaswag", None, tok, seq_len=64, local_batch_size=batch, dp_rank=rank,
                                dp_world_size=world, seed=3, shuffle=True)

    rows = lambda batch: {tuple(r.tolist()) for r in batch["input_ids"]}
    pair = [make(r, 2, 2) for r in range(2)]
    iters = [iter(ld) for ld in pair]
    for _ in range(3):
        [next(it) for it in iters]
    single = make(0, 1, 4)
    single.load_state_dict(pair[0].state_dict())
    assert rows(next(iter(single))) == rows(next(iters[0])) | rows(next(iters[1]))
    old = {**single.state_dict(), "version": 1, "batch_in_epoch": 4, "dp_world_size": 1, "local_batch_size": 4}
    del old["samples_in_epoch"]
    again = make(1, 2, 2)
    again.load_state_dict(old)  # a version-1 state (batches of its own split) converts to samples
    assert again.state_dict()["samples_in_epoch"] == 16


def test_resume_saved_exactly_at_an_epoch_end(tok):
    def make():
        return build_dataloader("hellaswag", None, tok, seq_len=64, local_batch_size=8, dp_rank=0, dp_world_size=1,
                                seed=2, shuffle=True)

    loader = make()
    n = len(loader)
    uninterrupted = take(make(), n + 3)
    take(loader, n)
    assert loader.state_dict()["samples_in_epoch"] == n * 8
    resumed = make()
    resumed.load_state_dict(loader.state_dict())
    assert batches_equal(take(resumed, 3), uninterrupted[n:])
