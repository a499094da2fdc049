"""``training.pad_to_multiple_of``: how long a batch runs once its trailing padding is cut, and what is cut."""

import dataclasses

import pytest
import torch

from titan_kimi.data.trim import padded_length, real_length, trim_padding


@pytest.mark.parametrize("real, multiple, seq_len, expected", [
    (1152, 128, 4096, 1152), (1153, 128, 4096, 1280), (4000, 128, 4096, 4096), (4096, 128, 4096, 4096),
    (0, 64, 1024, 64), (300, 0, 1024, 1024), (5, 3, 7, 6), (7, 3, 7, 7), (70, 512, 80, 80),
])
def test_padded_length_rounds_up_to_the_multiple_and_stays_within_seq_len(real, multiple, seq_len, expected):
    assert padded_length(real, multiple, seq_len) == expected


@pytest.mark.parametrize("real, multiple, seq_len, message", [
    (10, -1, 64, r"training.pad_to_multiple_of = -1"), (65, 8, 64, r"real length 65: valid: 0..seq_len \(64\)"),
])
def test_padded_length_rejects_bad_values(real, multiple, seq_len, message):
    with pytest.raises(ValueError, match=message):
        padded_length(real, multiple, seq_len)


def test_trim_cuts_after_the_last_real_token_of_any_row_and_keeps_interior_padding_and_images():
    doc = torch.tensor([[1, 1, 0, 2, 2, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]])
    batch = {"input_ids": torch.arange(20).reshape(2, 10), "labels": torch.arange(20).reshape(2, 10) + 100,
             "doc_ids": doc, "pixel_values": torch.randn(2, 3, 14, 14), "grid_thws": torch.tensor([[1, 2, 2]])}
    assert real_length(doc) == 5
    cut = trim_padding(batch, 3)
    assert {k: tuple(v.shape) for k, v in cut.items() if k in ("input_ids", "labels", "doc_ids")} == {
        "input_ids": (2, 6), "labels": (2, 6), "doc_ids": (2, 6)}
    assert torch.equal(cut["doc_ids"], doc[:, :6]) and torch.equal(cut["labels"], batch["labels"][:, :6])
    assert cut["pixel_values"] is batch["pixel_values"] and cut["grid_thws"] is batch["grid_thws"]
    assert trim_padding(batch, 0) is batch  # off: the batch as it came
    assert trim_padding(batch, 8)["doc_ids"].shape == (2, 8)
    assert trim_padding(batch, 16) is batch  # rounded up past seq_len: whole rows


def test_pad_to_multiple_of_takes_pipelines_and_context_parallel_chunks():
    """Any multiple under pipeline parallelism (each length gets its stages); under context parallelism a multiple
    of the row's chunks (every trimmed length must split into them), else a clear error."""
    from titan_kimi.config import JobConfig
    from titan_kimi.models.kimi_k3 import model_args_for
    from titan_kimi.parallel.layout import resolve_layout

    def job(multiple=128, **parallelism):
        cfg = JobConfig()
        cfg.parallelism = dataclasses.replace(cfg.parallelism, **parallelism)
        cfg.training = dataclasses.replace(cfg.training, local_batch_size=4, seq_len=4096, pad_to_multiple_of=multiple)
        return cfg

    args = model_args_for("k3")
    assert resolve_layout(job(pipeline_parallel_degree=2), 16, args).pp == 2
    assert resolve_layout(job(context_parallel_degree=2), 16, args).cp == 2  # 128: 4 zigzag chunks of 32
    assert resolve_layout(job(4, context_parallel_degree=4, context_parallel_layout="contiguous"), 16, args).cp == 4
    with pytest.raises(ValueError, match=r"training.pad_to_multiple_of = 6: cannot cut rows into 4 equal chunks for "
                                         r"parallelism.context_parallel_degree = 2 with "
                                         r"parallelism.context_parallel_layout = \"zigzag\".*valid: 0, or a "
                                         r"multiple of 4"):
        resolve_layout(job(6, context_parallel_degree=2), 16, args)
    assert resolve_layout(job(), 16, args).pp == 1
