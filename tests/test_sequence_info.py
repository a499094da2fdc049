"""cu_seqlens padding: a handful of shapes for any document count, and the model unchanged by it."""

import pytest
import torch

from titan_kimi.models.kimi_k3 import KimiK3Model, build_sequence_info, model_args_for
from titan_kimi.models.kimi_k3.sequence import segment_slots


def test_segment_slots_are_powers_of_two_from_64():
    assert [segment_slots(n) for n in (1, 63, 64, 65, 128, 129, 1000)] == [64, 64, 64, 128, 128, 256, 1024]
    with pytest.raises(ValueError, match="num_segments = 0"):
        segment_slots(0)


def test_cu_seqlens_is_padded_with_zero_length_segments():
    doc_ids = torch.tensor([[1] * 5 + [2] * 3 + [0] * 2, [1] * 10])
    padded = build_sequence_info(2, 10, torch.device("cpu"), doc_ids).cu_seqlens
    exact = build_sequence_info(2, 10, torch.device("cpu"), doc_ids, pad_segments=False).cu_seqlens
    assert exact.tolist() == [0, 5, 8, 10, 20]
    assert padded.shape == (65,) and padded[:5].tolist() == exact.tolist() and (padded[5:] == 20).all()


def test_model_is_the_same_with_and_without_segment_padding():
    torch.manual_seed(0)
    model = KimiK3Model(model_args_for("k31_debug", index_topk=8))
    model.init_weights()
    tokens = torch.randint(1, 2048, (2, 40))
    doc_ids = torch.tensor([[1] * 13 + [2] * 20 + [3] * 7, [1] * 30 + [0] * 10])
    padded = model(tokens, doc_ids=doc_ids)
    seq = build_sequence_info(2, 40, tokens.device, doc_ids, pad_segments=False)
    seq.dsa_dense = model.dsa_dense(seq, None)  # as the forward decides it for the padded sequence
    exact = model(tokens, seq=seq)
    assert torch.equal(padded, exact)
