"""kernels.indexer_topk = cudnn on CPU: its availability and call checks, and its glue (row chunks, causal
offsets, document masks, -inf picks, compaction) against the reference, with cuDNN's three kernels replaced by
torch functions that follow their documented contracts (the kernels themselves: test_indexer_topk_cudnn_gpu.py)."""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch

from lowerings.kernels import cudnn_indexer_topk as cik
from lowerings.ops.indexer_topk import BACKENDS, indexer_topk_reference
from lowerings.ops.registry import configure_backends


def fake_indexer_forward(q, k, w, ratio, sm_scale, q_causal_offsets):
    """Dense layout, one batch row: scores [1, n, keys], -inf past each query's causal position."""
    assert ratio == 1 and q.shape[0] == 1 and k.shape[2] == 1 and q_causal_offsets.dtype == torch.int32
    logits = torch.einsum("bthd,bsd->bths", q.float(), k[:, :, 0].float()) * sm_scale
    scores = torch.einsum("bth,bths->bts", w.float(), torch.relu(logits))
    pos = q_causal_offsets[0] + torch.arange(q.shape[1])
    scores = scores.masked_fill(torch.arange(k.shape[1])[None, :] > pos[:, None], float("-inf"))
    return {"scores": scores}


def fake_top_k(scores, seq_lens, top_k, next_n, return_val, tie_break, deterministic):
    """Radix top-k over each row's first seq_lens columns: ties to the larger column (tie_break 2), valid picks
    ascending (deterministic), -1 / -inf where a row has fewer than top_k columns. -inf columns are valid
    picks (they are inside the row)."""
    assert next_n == 1 and return_val and tie_break == 2 and deterministic
    n, cols = scores.shape
    inside = torch.arange(cols)[None, :] < seq_lens[:, None].long()
    keyed = torch.where(inside, scores, torch.full_like(scores, float("nan")))
    idx = torch.full((n, top_k), -1, dtype=torch.int32)
    val = torch.full((n, top_k), float("-inf"))
    for r in range(n):
        m = int(seq_lens[r])
        row = keyed[r, :m]
        order = sorted(range(m), key=lambda c: (float(row[c]), c), reverse=True)[:top_k]  # ties: larger c
        order.sort()
        idx[r, :len(order)] = torch.tensor(order, dtype=torch.int32)
        val[r, :len(order)] = row[order]
    return {"indices": idx, "values": val}


def fake_compactify(idx):
    out = torch.full_like(idx, -1)
    for r in range(idx.shape[0]):
        kept = idx[r][idx[r] >= 0]
        out[r, :kept.numel()] = kept
    return {"indices": out, "topk_length": (idx >= 0).sum(1).to(torch.int32)}


@pytest.fixture
def fake_cudnn(monkeypatch):
    dsa = types.ModuleType("cudnn.deepseek_sparse_attention")
    dsa.indexer_forward_wrapper = fake_indexer_forward
    dsa.indexer_top_k_wrapper = fake_top_k
    dsa.compactify_wrapper = fake_compactify
    monkeypatch.setitem(sys.modules, "cudnn.deepseek_sparse_attention", dsa)


def inputs(T, Tk, HI=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, HI, D, generator=g)
    k = torch.randn(Tk, D, generator=g)
    w = torch.randn(T, HI, generator=g)
    return q, k, w


@pytest.mark.parametrize("docs, cap_rows", [([23], None), ([5, 1, 9, 8], None), ([5, 1, 9, 8], 4), ([12, 11], 1)])
def test_glue_matches_the_reference(fake_cudnn, monkeypatch, docs, cap_rows):
    T = sum(docs)
    q, k, w = inputs(T, T)
    seg = torch.cat([torch.full((n,), sum(docs[:i]), dtype=torch.int32) for i, n in enumerate(docs)])
    if cap_rows is not None:  # chunks of cap_rows rows against all T keys
        monkeypatch.setattr(cik, "SCORE_BYTES_CAP", 4 * T * cap_rows)
    for topk in (3, 6, 40):
        got = cik.cudnn_indexer_topk(q, k, w, seg, topk, 0.4)
        assert torch.equal(got, indexer_topk_reference(q, k, w, seg, topk, 0.4)), (docs, cap_rows, topk)


def test_glue_with_an_offset_into_the_keys(fake_cudnn, monkeypatch):
    """A context-parallel run of queries: rows 9.. of a 20-token row, the first document ending at 12."""
    T, Tk, off = 7, 20, 9
    q, k, w = inputs(T, Tk, seed=3)
    seg = torch.tensor([0, 0, 0, 12, 12, 12, 12], dtype=torch.int32)
    want = indexer_topk_reference(q, k, w, seg, 5, 0.3, q_offset=off)
    assert torch.equal(cik.cudnn_indexer_topk(q, k, w, seg, 5, 0.3, q_offset=off), want)
    monkeypatch.setattr(cik, "SCORE_BYTES_CAP", 4 * (off + T) * 2)  # two-row chunks, each with its own offset
    assert torch.equal(cik.cudnn_indexer_topk(q, k, w, seg, 5, 0.3, q_offset=off), want)


def test_ties_go_to_the_most_recent_key(fake_cudnn):
    """ReLU zeros tie: a query whose logits are all negative scores 0 everywhere and keeps the latest keys."""
    T = 10
    q, k, w = inputs(T, T, seed=5)
    k = k.abs()
    q[6] = -1.0  # q.k < 0 for every (positive) key: row 6 scores 0 everywhere
    seg = torch.zeros(T, dtype=torch.int32)
    got = cik.cudnn_indexer_topk(q, k, w, seg, 3, 1.0)
    assert torch.equal(got, indexer_topk_reference(q, k, w, seg, 3, 1.0))
    assert got[6].tolist() == [4, 5, 6]


def call(HI=64, D=128, dtype=torch.bfloat16, T=8192, cuda=True):
    """Stand-ins with the attributes cudnn_takes reads (no GPU here)."""
    q = types.SimpleNamespace(is_cuda=cuda, dtype=dtype, shape=(T, HI, D))
    k = types.SimpleNamespace(dtype=dtype, shape=(T, D))
    w = types.SimpleNamespace(dtype=torch.float32)
    return q, k, w


@pytest.mark.parametrize("change, topk, reason", [
    (dict(dtype=torch.float32), 2048, "needs bf16 q and k, got torch.float32/torch.float32"),
    (dict(D=64), 2048, "needs head dim 128, got 64"),
    (dict(HI=8), 2048, r"needs \(16, 32, 64\) index heads, got 8"),
    (dict(), 4096, "top-k 4096 exceeds the radix kernel's 2048"),
    (dict(cuda=False), 2048, "needs CUDA tensors"),
])
def test_calls_the_kernels_cannot_take_say_why(change, topk, reason):
    assert re.fullmatch(reason, cik.cudnn_takes(*call(**change), topk))


def test_the_k31_shape_is_taken():
    assert cik.cudnn_takes(*call(), 2048) is None
    assert cik.cudnn_takes(*call(T=1000), 2048) is None  # a short row: top-k is cut to its 1,000 keys


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_selecting_it_without_a_gpu_fails_at_configuration():
    assert BACKENDS.checks["cudnn"]() == "no CUDA device"
    with pytest.raises(ValueError, match=r"kernels.indexer_topk = 'cudnn' is not available on this machine: "
                                         r"no CUDA device"):
        configure_backends({"indexer_topk": "cudnn"})
