"""Nonpacked MedPix: rows -> chat tokens with the image placeholder -> expanded labels on the answer only;
the file formats (jsonl, parquet, datasets folders); the image collate; the bundled sample."""

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from titan_kimi.data.assets import SAMPLE_MEDPIX_PATH, TOKENIZER_DIR
from titan_kimi.data.batch import IGNORE_INDEX
from titan_kimi.data.chat import IMAGE_PLACEHOLDER, encode_chat
from titan_kimi.data.dataloader import build_dataloader
from titan_kimi.data.image_processor import ImageProcessor
from titan_kimi.data.medpix import MedPixDataset, collate_image_text, medpix_messages
from titan_kimi.data.tokenizer import KimiTokenizer
from titan_kimi.models.kimi_k3.multimodal_merge import merge_image_features

SIZES = [(57, 31), (84, 56), (30, 90)]
ROWS = [("What is shown?", "A fracture of the left radius."), ("Which modality?", "CT."),
        ("Any lesion?", "No lesion is visible.")]


@pytest.fixture(scope="module")
def tok():
    return KimiTokenizer(TOKENIZER_DIR)


def png_bytes(width, height, seed=0):
    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def write_jsonl_rows(folder):
    (folder / "img").mkdir()
    lines = []
    for i, ((w, h), (q, a)) in enumerate(zip(SIZES, ROWS)):
        (folder / "img" / f"{i}.png").write_bytes(png_bytes(w, h, i))
        lines.append(json.dumps({"image": f"img/{i}.png", "question": q, "answer": a}))
    path = folder / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_rows_become_labels_on_the_answer_only(tmp_path, tok):
    processor = ImageProcessor()
    seq_len = 160
    data = MedPixDataset(write_jsonl_rows(tmp_path), tok, seq_len, processor)
    placeholder = tok.special_tokens[IMAGE_PLACEHOLDER]
    for index, ((w, h), (q, a)) in enumerate(zip(SIZES, ROWS)):
        sample = data[index]
        n = processor.tokens_for_grid(processor.grid_for_size(w, h))
        ids, mask = encode_chat(tok, medpix_messages(q, a))
        assert ids.count(placeholder) == 1
        # Independent expansion: the placeholder becomes n image slots (never trained), then shift by one.
        expanded = []
        for token, trained in zip(ids, mask):
            expanded += [(None, False)] * n if token == placeholder else [(token, trained)]
        want = [tok_ if trained else IGNORE_INDEX for tok_, trained in expanded[1:]]
        want += [IGNORE_INDEX] * (seq_len - len(want))
        assert sample["labels"].tolist() == want
        assert sample["doc_ids"].tolist() == [1] * len(expanded) + [0] * (seq_len - len(expanded))
        assert sample["input_ids"][: len(ids)].tolist() == ids
        assert (sample["input_ids"][len(ids):] == tok.pad_id).all()
        trained = [t for t in sample["labels"].tolist() if t != IGNORE_INDEX]
        assert tok.decode(trained) == f"<|open|>response<|sep|>{a}<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
        assert sample["grid_thws"].tolist() == [list(processor.grid_for_size(w, h))]
        assert sample["pixel_values"].shape == (int(sample["grid_thws"].prod()), 3, 14, 14)


def test_collated_batch_expands_in_the_model_to_the_positions_the_labels_describe(tmp_path, tok):
    """Data and model agree: expanding the batch's placeholders puts every token where its label says."""
    data = MedPixDataset(write_jsonl_rows(tmp_path), tok, 160, ImageProcessor())
    batch = collate_image_text([data[i] for i in range(3)])
    assert batch["input_ids"].shape == (3, 160) and batch["grid_thws"].shape == (3, 3)
    assert batch["pixel_values"].shape[0] == int(batch["grid_thws"].prod(1).sum())  # images of different sizes
    counts = (batch["grid_thws"][:, 1] // 2) * (batch["grid_thws"][:, 2] // 2)
    ids = batch["input_ids"]
    token_embeds = ids.unsqueeze(-1).double()  # "embed" each token as its own id
    merged = merge_image_features(ids, token_embeds, torch.full((int(counts.sum()), 1), -1.0), counts,
                                  tok.special_tokens[IMAGE_PLACEHOLDER], seq_len=160)
    seen = merged.inputs_embeds[..., 0].long()
    labels, docs = batch["labels"], batch["doc_ids"]
    trained = labels[:, :-1] != IGNORE_INDEX
    assert trained.any()
    assert torch.equal(seen[:, 1:][trained], labels[:, :-1][trained])  # label t is the token at t + 1
    assert torch.equal(merged.image_mask, seen == -1)
    assert not (labels[merged.image_mask.roll(-1, 1) & merged.image_mask] != IGNORE_INDEX).any()
    assert (seen[docs == 0] == tok.pad_id).all() and (seen[docs == 1] != tok.pad_id).all()  # doc ids mark padding


def test_long_rows_are_cut_at_the_end_and_rows_without_room_rejected(tmp_path, tok):
    path = write_jsonl_rows(tmp_path)
    data = MedPixDataset(path, tok, 50, ImageProcessor())  # rows 1 and 3 expand to 58 and 53 positions
    assert data.num_truncated == 2
    for i in range(len(data)):
        assert (data[i]["doc_ids"] == 1).sum() == (50 if i != 1 else 47)
    with pytest.raises(ValueError, match=r"rows\.jsonl: row 1: the prompt takes"):
        MedPixDataset(path, tok, 30, ImageProcessor())


def test_bad_rows_are_rejected_naming_the_row(tmp_path, tok):
    (tmp_path / "bad.png").write_bytes(b"not a png at all")
    (tmp_path / "ok.png").write_bytes(png_bytes(40, 40))
    rows = [{"image": "ok.png", "question": "q", "answer": "a"}, {"image": "bad.png", "question": "q", "answer": "a"}]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 2: unreadable image"):
        MedPixDataset(path, tok, 128, ImageProcessor())
    path.write_text(json.dumps({"image": "ok.png", "question": "q", "answer": 3}) + "\n")
    with pytest.raises(ValueError, match=r"row 1: 'answer' must be a string"):
        MedPixDataset(path, tok, 128, ImageProcessor())
    path.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"row 1: no image"):
        MedPixDataset(path, tok, 128, ImageProcessor())
    path.write_text(json.dumps({"image": "ok.png", "question": "q", "answer": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"row 1: too many pixels"):
        MedPixDataset(path, tok, 128, ImageProcessor(max_input_pixels=1000))


def _table():
    pa = pytest.importorskip("pyarrow")
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    return pa, pa.table({
        "image_id": pa.array([{"bytes": png_bytes(w, h, i), "path": None} for i, (w, h) in enumerate(SIZES)],
                             type=image_type),
        "question": [q for q, _ in ROWS], "answer": [a for _, a in ROWS], "mode": ["x"] * 3,
    })


def assert_same_samples(a, b):
    assert len(a) == len(b)
    for i in range(len(a)):
        sa, sb = a[i], b[i]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_parquet_and_saved_datasets_folders_read_like_jsonl(tmp_path, tok):
    pa, table = _table()
    import pyarrow.parquet as pq

    reference = MedPixDataset(write_jsonl_rows(tmp_path), tok, 160, ImageProcessor())
    pq.write_table(table, tmp_path / "train.parquet")
    assert_same_samples(MedPixDataset(tmp_path / "train.parquet", tok, 160, ImageProcessor()), reference)
    snapshot = tmp_path / "snapshot" / "data"
    snapshot.mkdir(parents=True)
    pq.write_table(table.slice(0, 2), snapshot / "train-00000-of-00002.parquet")
    pq.write_table(table.slice(2), snapshot / "train-00001-of-00002.parquet")
    assert_same_samples(MedPixDataset(tmp_path / "snapshot", tok, 160, ImageProcessor()), reference)
    # The save_to_disk layout: Arrow stream files listed by state.json; a DatasetDict adds dataset_dict.json.
    saved = tmp_path / "saved" / "train"
    saved.mkdir(parents=True)
    with pa.OSFile(str(saved / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (tmp_path / "saved" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    assert_same_samples(MedPixDataset(saved, tok, 160, ImageProcessor()), reference)
    assert_same_samples(MedPixDataset(tmp_path / "saved", tok, 160, ImageProcessor()), reference)


def test_a_folder_written_by_datasets_itself(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    rows = {"image_id": [{"bytes": png_bytes(w, h, i), "path": None} for i, (w, h) in enumerate(SIZES)],
            "question": [q for q, _ in ROWS], "answer": [a for _, a in ROWS]}
    ds = datasets.Dataset.from_dict(rows).cast_column("image_id", datasets.Image())
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "hf"))
    reference = MedPixDataset(write_jsonl_rows(tmp_path), tok, 160, ImageProcessor())
    assert_same_samples(MedPixDataset(tmp_path / "hf", tok, 160, ImageProcessor()), reference)


def test_parquet_with_a_wrong_schema_is_rejected(tmp_path, tok):
    pa, table = _table()
    import pyarrow.parquet as pq

    pq.write_table(table.drop(["answer"]), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match=r"lack \['answer'\]"):
        MedPixDataset(tmp_path / "x.parquet", tok, 160, ImageProcessor())
    _, table = _table()
    corrupt = table.set_column(0, "image_id", pa.array([{"bytes": b"junk", "path": None}] * 3, type=table.schema[0].type))
    pq.write_table(corrupt, tmp_path / "y.parquet")
    with pytest.raises(ValueError, match=r"y\.parquet: row 1: unreadable image"):
        MedPixDataset(tmp_path / "y.parquet", tok, 160, ImageProcessor())


def test_bundled_sample_through_the_dataloader(tok):
    loader = build_dataloader("medpix", None, tok, seq_len=96, local_batch_size=4, dp_rank=1, dp_world_size=2,
                              seed=0, shuffle=True, image_processor=ImageProcessor(max_pixels=112 * 112))
    assert len(loader.dataset) == 96 and SAMPLE_MEDPIX_PATH.is_file()
    batch = next(iter(loader))
    assert batch["input_ids"].shape == (4, 96) and batch["grid_thws"].shape == (4, 3)
    assert (batch["grid_thws"][:, 1:] * 14 <= 112).all() and (batch["grid_thws"][:, 1:] % 2 == 0).all()
    assert batch["pixel_values"].shape == (int(batch["grid_thws"].prod(1).sum()), 3, 14, 14)
    assert ((batch["labels"] != IGNORE_INDEX).sum(1) > 5).all()
