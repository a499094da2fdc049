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
from lowerings.ops.indexer_topk import BACKENDS, INDEXER_TOPK_KERNELS, forward_kernel, indexer_topk_reference
from lowerings.ops.registry import configure_backends


def fake_indexer_forward(q, k, w, ratio, sm_scale, q_causal_offsets=None, cu_seqlens_q=None, cu_seqlens_k=None,
                         max_seqlen_q=None, max_seqlen_k=None):
    """Dense layout, one batch row: scores [1, n, keys], -inf past each query's causal position. With cu_seqlens
    (THD): scores [T, max_seqlen_k] of each query against its own document's keys, -inf past its position."""
    assert ratio == 1
    if cu_seqlens_q is not None:
        return fake_thd_forward(q, k, w, sm_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    assert q.shape[0] == 1 and k.shape[2] == 1 and q_causal_offsets.dtype == torch.int32
    logits = torch.einsum("bthd,bsd->bths", q.float(), k[:, :, 0].float()) * sm_scale
    scores = torch.einsum("bth,bths->bts", w.float(), torch.relu(logits))
    pos = q_causal_offsets[0] + torch.arange(q.shape[1])
    scores = scores.masked_fill(torch.arange(k.shape[1])[None, :] > pos[:, None], float("-inf"))
    return {"scores": scores}


def fake_thd_forward(q, k, w, sm_scale, cu_q, cu_k, max_q, max_k):
    assert torch.equal(cu_q, cu_k) and max_q == max_k and cu_q.dtype == torch.int32 and k.shape[1] == 1
    T = q.shape[0]
    scores = torch.full((T, max_k), float("-inf"))
    for a, b in zip(cu_q.tolist(), cu_q[1:].tolist()):
        assert b - a <= max_k, "max_seqlen below a document's length"
        logits = torch.einsum("thd,sd->ths", q[a:b].float(), k[a:b, 0].float()) * sm_scale
        doc = torch.einsum("th,ths->ts", w[a:b].float(), torch.relu(logits))
        causal = torch.arange(b - a)[None, :] <= torch.arange(b - a)[:, None]
        scores[a:b, :b - a] = doc.masked_fill(~causal, float("-inf"))
    return {"scores": scores}


def fake_local_to_global(local, seqlen_k, cu_seqlens_q, cu_seqlens_k):
    """Row r's document: the last d with cu_seqlens_q[d] <= r (zero-length tail documents never hold a row)."""
    doc = torch.searchsorted(cu_seqlens_q[:-1].contiguous(), torch.arange(local.shape[0], dtype=torch.int32),
                             right=True) - 1
    start = cu_seqlens_k[doc].unsqueeze(1)
    return {"indices": torch.where(local >= 0, local + start, -1).to(torch.int32)}


def fake_top_k(scores, seq_lens, top_k, next_n, return_val, tie_break, deterministic):
    """Radix top-k over each row's first seq_lens columns: ties to the larger column (tie_break 2), valid picks
    ascending (deterministic), -1 / -inf where a row has fewer than top_k columns. -inf columns are valid
    picks (they are inside the row)."""
    assert next_n == 1 and tie_break == 2 and deterministic
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
    return {"indices": idx, "values": val if return_val else None}


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
    dsa.local_to_global_wrapper = fake_local_to_global
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


def padded_cu_seqlens(docs, slots):
    """The model's cu_seqlens: document starts, then T repeated (zero-length documents) up to ``slots`` + 1."""
    starts = [sum(docs[:i]) for i in range(len(docs))]
    return torch.tensor(starts + [sum(docs)] * (slots + 1 - len(starts)), dtype=torch.int32)


@pytest.mark.parametrize("docs, slots, bound", [([23], 1, 23), ([5, 1, 9, 8], 8, 23), ([5, 1, 9, 8], 4, 9),
                                                ([12, 11], 64, 16)])
def test_the_document_layout_matches_the_reference(fake_cudnn, docs, slots, bound):
    """THD over the model's padded cu_seqlens with max_seqlen any bound on the longest document."""
    T = sum(docs)
    q, k, w = inputs(T, T, seed=7)
    seg = torch.cat([torch.full((n,), sum(docs[:i]), dtype=torch.int32) for i, n in enumerate(docs)])
    cu = padded_cu_seqlens(docs, slots)
    for topk in (3, 6, 40):
        got = cik.cudnn_indexer_topk(q, k, w, seg, topk, 0.4, cu_seqlens=cu, max_seqlen=bound)
        assert torch.equal(got, indexer_topk_reference(q, k, w, seg, topk, 0.4)), (docs, slots, bound, topk)


def test_the_document_layout_is_skipped_where_it_cannot_run(fake_cudnn, monkeypatch):
    """Scores over the cap or a context-parallel offset take the dense layout, with the same result."""
    docs = [5, 1, 9, 8]
    T = sum(docs)
    q, k, w = inputs(T, T, seed=9)
    seg = torch.cat([torch.full((n,), sum(docs[:i]), dtype=torch.int32) for i, n in enumerate(docs)])
    cu = padded_cu_seqlens(docs, 8)
    dense, documents = cik._dense, cik._documents
    used = []
    monkeypatch.setattr(cik, "_dense", lambda *a: used.append("dense") or dense(*a))
    monkeypatch.setattr(cik, "_documents", lambda *a: used.append("documents") or documents(*a))
    want = indexer_topk_reference(q, k, w, seg, 4, 0.4)
    assert torch.equal(cik.cudnn_indexer_topk(q, k, w, seg, 4, 0.4, cu_seqlens=cu, max_seqlen=T), want)
    monkeypatch.setattr(cik, "SCORE_BYTES_CAP", 4 * T * T - 1)
    assert torch.equal(cik.cudnn_indexer_topk(q, k, w, seg, 4, 0.4, cu_seqlens=cu, max_seqlen=T), want)
    assert torch.equal(cik.cudnn_indexer_topk(q, k, w, seg, 4, 0.4), want)
    assert used == ["documents", "dense", "dense"]


def test_the_op_rejects_documents_without_a_bound():
    from lowerings.ops.indexer_topk import indexer_topk

    q, k, w = inputs(11, 11)
    seg = torch.tensor([0] * 5 + [5] * 6, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens \[N\+1 >= 2\] with max_seqlen >= 1; got cu_seqlens "
                                         r"\(5,\), max_seqlen 0"):
        indexer_topk(q, k, w, seg, topk=4, scale=0.5, cu_seqlens=padded_cu_seqlens([5, 6], 4), max_seqlen=0)
    # the other backends ignore the documents: the same result with or without them
    want = indexer_topk(q, k, w, seg, topk=4, scale=0.5)
    got = indexer_topk(q, k, w, seg, topk=4, scale=0.5, cu_seqlens=padded_cu_seqlens([5, 6], 4), max_seqlen=11)
    assert torch.equal(got, want)


def test_the_indexer_passes_its_documents(monkeypatch):
    """The model's indexer hands the padded cu_seqlens and the row length to the op (one document per row: none)."""
    from titan_kimi.models.kimi_k3 import indexer as indexer_module
    from titan_kimi.models.kimi_k3.flavors import model_args_for
    from titan_kimi.models.kimi_k3.sequence import build_sequence_info

    args = model_args_for("k31_debug")
    layer = indexer_module.Indexer(args)
    seen = []
    real = indexer_module.ops.indexer_topk
    monkeypatch.setattr(indexer_module.ops, "indexer_topk",
                        lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    B, S = 2, 12
    x = torch.randn(B, S, args.dim)
    q_latent = torch.randn(B, S, args.q_lora_rank)
    doc_ids = torch.tensor([[1] * 5 + [2] * 7, [3] * 12])
    seq = build_sequence_info(B, S, x.device, doc_ids)
    layer(x, q_latent, seq)
    layer(x, q_latent, build_sequence_info(B, S, x.device))
    assert torch.equal(seen[0]["cu_seqlens"], seq.cu_seqlens) and seen[0]["max_seqlen"] == S
    assert seen[1]["cu_seqlens"] is None and seen[1]["max_seqlen"] == 0


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
])
def test_calls_the_kernels_cannot_take_say_why(change, topk, reason):
    assert re.fullmatch(reason, cik.cudnn_takes(*call(**change), topk))


def test_the_k31_shape_is_taken():
    assert cik.cudnn_takes(*call(), 2048) is None
    assert cik.cudnn_takes(*call(T=1000), 2048) is None  # a short row: top-k is cut to its 1,000 keys


def test_forward_kernel_routing():
    """The op's rule table: cudnn's refusals run the Triton kernel, CPU tensors the reference."""
    assert forward_kernel("cudnn", *call(), 2048) == "cudnn"
    assert forward_kernel("cudnn", *call(dtype=torch.float32), 2048) == "triton"
    assert forward_kernel("cudnn", *call(HI=8), 2048) == "triton"
    assert forward_kernel("cudnn", *call(), 4096) == "triton"
    assert forward_kernel("triton", *call(dtype=torch.float32), 2048) == "triton"
    assert forward_kernel("cudnn", *call(cuda=False), 2048) == forward_kernel("triton", *call(cuda=False), 2048) \
        == forward_kernel("reference", *call(), 2048) == "reference"
    assert forward_kernel("cudnn", *call(cuda=False), 2048, cuda=True) == "cudnn"  # the GPU decision, asked on CPU
    assert set(INDEXER_TOPK_KERNELS) == set(BACKENDS.checks)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_selecting_it_without_a_gpu_fails_at_configuration():
    assert BACKENDS.checks["cudnn"]() == "no CUDA device"
    with pytest.raises(ValueError, match=r"kernels.indexer_topk = 'cudnn' is not available on this machine: "
                                         r"no CUDA device"):
        configure_backends({"indexer_topk": "cudnn"})
