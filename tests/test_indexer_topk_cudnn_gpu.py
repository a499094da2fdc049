"""kernels.indexer_topk = cudnn on the GPU: cuDNN frontend's sm90 DSA indexer against the fp64 reference scores
and the Triton kernel, on fresh random inputs at K3.1's indexer shape (64 heads x 128, top-2,048)."""

from __future__ import annotations

import pytest
import torch

from lowerings.kernels import cudnn_indexer_topk as cik
from lowerings.kernels.indexer_topk import indexer_topk as triton_indexer_topk
from conftest import pretend_selected
from test_triton_kernels import assert_topk_valid

pytestmark = pytest.mark.gpu

HI, D, TOPK = 64, 128, 2048


@pytest.fixture(autouse=True)
def needs_cudnn():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    reason = cik.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def make(T: int, Tk: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, HI, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(Tk, D, device="cuda", generator=g).bfloat16()
    w = torch.randn(T, HI, device="cuda", generator=g) * HI**-0.5
    return q, k, w


def seg_starts(docs: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), sum(docs[:i]), dtype=torch.int32) for i, n in enumerate(docs)]).cuda()


def scores_fp64(q, k, w, seg, scale, q_offset=0):
    """[T, q_offset + T] fp64 masked scores of the queries at key positions q_offset .. q_offset + T - 1."""
    T, Tk = q.shape[0], q_offset + q.shape[0]
    logits = torch.einsum("thd,sd->ths", q.double(), k[:Tk].double()) * scale
    s = torch.einsum("th,ths->ts", w.double(), torch.relu(logits))
    pos = q_offset + torch.arange(T, device=q.device)
    cols = torch.arange(Tk, device=q.device)
    valid = (cols[None, :] <= pos[:, None]) & (cols[None, :] >= seg[:, None].long())
    return s.masked_fill(~valid, float("-inf"))


def ref_select(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The op's selection from masked scores [rows, keys]: ties to the most recent key, ascending, -1 suffix."""
    C = scores.shape[1]
    kk = min(topk, C)
    vals, order = torch.sort(scores.flip(-1), dim=1, descending=True, stable=True)
    vals, sel = vals[:, :kk], C - 1 - order[:, :kk]
    sel = torch.where(torch.isneginf(vals), C, sel).sort(dim=1).values
    return torch.where(sel == C, -1, sel).to(torch.int32)


def check(got: torch.Tensor, scores: torch.Tensor, min_equal: float = 0.99) -> float:
    """Well formed and a true top-k up to near-ties; the fraction of rows equal to the reference's selection."""
    assert_topk_valid(got, scores.float(), TOPK, tol=1e-3)
    want = ref_select(scores, TOPK)
    equal = (got == want).all(1).float().mean().item()
    assert equal >= min_equal, f"only {equal:.4f} of the rows equal the fp64 reference's selection"
    return equal


@pytest.mark.parametrize("docs", [[4096], [1000, 1000, 1000, 1096], [1, 300, 2500, 1295]],
                         ids=["one_doc", "docs_1000", "short_and_long"])
def test_cudnn_matches_the_reference_and_triton(docs):
    T = sum(docs)
    q, k, w = make(T, T, seed=len(docs))
    seg, scale = seg_starts(docs), D**-0.5
    got = cik.cudnn_indexer_topk(q, k, w, seg, TOPK, scale)
    check(got, scores_fp64(q, k, w, seg, scale))
    ours = triton_indexer_topk(q, k, w, seg, TOPK, scale)
    assert (got == ours).all(1).float().mean().item() >= 0.99


def padded_cu_seqlens(docs: list[int], slots: int = 64) -> torch.Tensor:
    """The model's cu_seqlens: document starts, then T repeated up to ``slots`` + 1 entries."""
    starts = [sum(docs[:i]) for i in range(len(docs))]
    return torch.tensor(starts + [sum(docs)] * (slots + 1 - len(starts)), dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("docs", [[4096], [1000, 1000, 1000, 1096], [1, 300, 2500, 1295]],
                         ids=["one_doc", "docs_1000", "short_and_long"])
def test_the_document_layout_matches_the_reference_and_the_dense_one(docs):
    """THD over the model's padded cu_seqlens with max_seqlen = the row length (what the model passes)."""
    T = sum(docs)
    q, k, w = make(T, T, seed=20 + len(docs))
    seg, scale = seg_starts(docs), D**-0.5
    got = cik.cudnn_indexer_topk(q, k, w, seg, TOPK, scale, cu_seqlens=padded_cu_seqlens(docs), max_seqlen=T)
    check(got, scores_fp64(q, k, w, seg, scale))
    dense = cik.cudnn_indexer_topk(q, k, w, seg, TOPK, scale)
    assert (got == dense).all(1).float().mean().item() >= 0.99


def test_the_document_layout_replays_in_a_cuda_graph_on_another_layout():
    """Captured on one document layout, replayed on another with the same cu_seqlens shape: equal to eager."""
    T = 4096
    q, k, w = make(T, T, seed=31)
    docs = [T]
    seg, cu = seg_starts(docs), padded_cu_seqlens(docs)
    scale = D**-0.5
    run = lambda: cik.cudnn_indexer_topk(q, k, w, seg, TOPK, scale, cu_seqlens=cu, max_seqlen=T)  # noqa: E731
    run()  # compiles the kernels outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    q2, k2, w2 = make(T, T, seed=32)
    docs2 = [700, 3000, 396]
    q.copy_(q2), k.copy_(k2), w.copy_(w2), seg.copy_(seg_starts(docs2)), cu.copy_(padded_cu_seqlens(docs2))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run())
    check(out, scores_fp64(q, k, w, seg, scale))


def test_cudnn_with_an_offset_and_row_chunks(monkeypatch):
    """A context-parallel run (queries 2,048.. of a 4,096-key row) in one chunk and in four."""
    T, off = 2048, 2048
    q, k, w = make(T, off + T, seed=7)
    seg = seg_starts([1500, 2596])[off:]
    scale = D**-0.5
    scores = scores_fp64(q, k, w, seg, scale, q_offset=off)
    whole = cik.cudnn_indexer_topk(q, k, w, seg, TOPK, scale, q_offset=off)
    check(whole, scores)
    monkeypatch.setattr(cik, "SCORE_BYTES_CAP", 4 * (off + T) * 512)
    assert torch.equal(cik.cudnn_indexer_topk(q, k, w, seg, TOPK, scale, q_offset=off), whole)


def test_cudnn_replays_in_a_cuda_graph_on_another_layout():
    """Captured once, replayed with new inputs and another document layout: equal to an eager call."""
    T = 4096
    q, k, w = make(T, T, seed=11)
    seg = seg_starts([T])
    scale = D**-0.5
    cik.cudnn_indexer_topk(q, k, w, seg, TOPK, scale)  # compiles the kernels outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cik.cudnn_indexer_topk(q, k, w, seg, TOPK, scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cik.cudnn_indexer_topk(q, k, w, seg, TOPK, scale)
    q2, k2, w2 = make(T, T, seed=12)
    seg2 = seg_starts([700, 3000, 396])
    q.copy_(q2), k.copy_(k2), w.copy_(w2), seg.copy_(seg2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, cik.cudnn_indexer_topk(q, k, w, seg, TOPK, scale))
    check(out, scores_fp64(q, k, w, seg, scale))


def test_the_op_routes_to_cudnn_and_falls_back_for_fp32(monkeypatch):
    from lowerings.ops.indexer_topk import indexer_topk

    pretend_selected(monkeypatch, "indexer_topk", "cudnn")
    T = 2048
    q, k, w = make(T, T, seed=13)
    seg = seg_starts([T])
    calls = []
    real = cik.cudnn_indexer_topk
    monkeypatch.setattr(cik, "cudnn_indexer_topk", lambda *a: calls.append(a[0].dtype) or real(*a))
    got = indexer_topk(q, k, w, seg, topk=TOPK, scale=D**-0.5)
    assert calls == [torch.bfloat16]
    fp32 = indexer_topk(q.float(), k.float(), w, seg, topk=TOPK, scale=D**-0.5)  # Triton's
    assert calls == [torch.bfloat16]
    assert (got == fp32).all(1).float().mean().item() >= 0.99
