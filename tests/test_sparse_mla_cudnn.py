"""kernels.sparse_mla = cudnn on CPU: its availability and call checks, and its glue (sink, keyless rows, plan
cache) against the reference gradients, with cuDNN's sm90 DSA backward replaced by a torch function that follows
its documented contract (the kernel itself: test_sparse_mla_cudnn_gpu.py)."""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch

from lowerings.kernels import cudnn_sparse_mla_bwd as csb
from lowerings.ops.registry import configure_backends
from lowerings.ops.sparse_mla import BACKENDS, sparse_mla_reference


class FakeSparseAttentionBackward:
    """cuDNN's plan API: keys-only natural-log lse mixed with a per-head sink (its preprocess reads lse = -inf as
    0), probabilities exp(s * scale - lse_total), entries outside [0, S) ignored, K = V (the value the first d_v
    columns of each key row), outputs written into caller buffers."""

    built: list[tuple] = []

    def __init__(self, sample_q, sample_kv, sample_out, sample_dout, sample_lse, sample_attn_sink, sample_topk_idxs,
                 softmax_scale):
        FakeSparseAttentionBackward.built.append((tuple(sample_q.shape), tuple(sample_topk_idxs.shape)))
        assert sample_attn_sink.shape == (sample_q.shape[1],) and sample_lse.dtype == torch.float32

    def check_support(self):
        return True

    def compile(self):
        pass

    def scratch_workspace_bytes(self):
        return 64

    def execute(self, q, kv, out, dout, lse, attn_sink, topk_idxs, dq, dkv, softmax_scale, workspace, d_sink):
        assert workspace.numel() >= 64 and workspace.dtype == torch.uint8
        S, d_v = kv.shape[0], out.shape[-1]
        valid = (topk_idxs >= 0) & (topk_idxs < S)
        rows = kv.double()[topk_idxs.long().clamp(0, S - 1)]  # [T, k, D]
        s = torch.einsum("thd,tkd->thk", q.double(), rows) * softmax_scale
        lse_kv = torch.where(torch.isneginf(lse), 0.0, lse).double()
        lse_total = torch.logaddexp(lse_kv, attn_sink.double()[None, :])
        p = torch.where(valid[:, None, :], torch.exp(s - lse_total[..., None]), 0.0)
        dp = torch.einsum("thv,tkv->thk", dout.double(), rows[..., :d_v])
        ds = p * (dp - (out.double() * dout.double()).sum(-1, keepdim=True))
        dq.copy_(torch.einsum("thk,tkd->thd", ds, rows) * softmax_scale)
        drows = torch.einsum("thk,thd->tkd", ds, q.double()) * softmax_scale
        drows[..., :d_v] += torch.einsum("thk,thv->tkv", p, dout.double())
        grad = torch.zeros(S, kv.shape[1], dtype=torch.float64)
        grad.index_add_(0, topk_idxs.long()[valid], drows[valid])
        dkv.copy_(grad)
        d_sink.zero_()
        return dq, dkv, d_sink


@pytest.fixture
def fake_cudnn(monkeypatch):
    dsa = types.ModuleType("cudnn.deepseek_sparse_attention")
    dsa.SparseAttentionBackward = FakeSparseAttentionBackward
    monkeypatch.setitem(sys.modules, "cudnn.deepseek_sparse_attention", dsa)
    monkeypatch.setattr(csb, "_PLANS", {})
    FakeSparseAttentionBackward.built.clear()


def inputs(T, S, H, D, k, seed):
    """Fresh random fp32 inputs; ascending indices with a -1 suffix, row 0 keyless, row 1 with one key."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g)
    kv = torch.randn(S, D, generator=g)
    idx = torch.full((T, k), -1, dtype=torch.int32)
    for t in range(1, T):
        n = 1 if t == 1 else int(torch.randint(1, k + 1, (1,), generator=g))
        idx[t, :n] = torch.randperm(S, generator=g)[:n].sort().values.to(torch.int32)
    return q, kv, idx


@pytest.mark.parametrize("T, S, H, D, d_v, k", [(9, 13, 3, 24, 16, 5), (6, 6, 2, 20, 20, 6)])
def test_glue_matches_the_reference_gradients(fake_cudnn, T, S, H, D, d_v, k):
    q, kv, idx = inputs(T, S, H, D, k, seed=T)
    scale = 0.3
    out, lse = sparse_mla_reference(q, kv, idx, scale, d_v)
    assert torch.isneginf(lse[0]).all()  # the keyless row
    d_out = torch.randn(T, H, d_v, generator=torch.Generator().manual_seed(1))
    _, vjp = torch.func.vjp(lambda q_, kv_: sparse_mla_reference(q_, kv_, idx, scale, d_v)[0], q, kv)
    want_dq, want_dkv = vjp(d_out)
    dq, dkv = csb.cudnn_sparse_mla_backward(d_out, q, kv, idx, out, lse, scale, d_v)
    for got, want in ((dq, want_dq), (dkv, want_dkv)):
        assert (got - want).norm() / want.norm() < 1e-5
    assert dq[0].abs().max() == 0  # a row without keys gets no gradient


def test_plans_are_built_once_per_shape(fake_cudnn):
    q, kv, idx = inputs(7, 9, 2, 16, 4, seed=2)
    out, lse = sparse_mla_reference(q, kv, idx, 0.5, 8)
    d_out = torch.randn_like(out)
    for _ in range(3):
        csb.cudnn_sparse_mla_backward(d_out, q, kv, idx, out, lse, 0.5, 8)
    q2, kv2, idx2 = inputs(5, 9, 2, 16, 4, seed=3)
    out2, lse2 = sparse_mla_reference(q2, kv2, idx2, 0.5, 8)
    csb.cudnn_sparse_mla_backward(torch.randn_like(out2), q2, kv2, idx2, out2, lse2, 0.5, 8)
    assert FakeSparseAttentionBackward.built == [((7, 2, 16), (7, 4)), ((5, 2, 16), (5, 4))]


def call(H=96, D=576, d_v=512, dtype=torch.bfloat16, kv_dtype=None, k=2048, cuda=True):
    """Stand-ins with the attributes cudnn_takes reads (no GPU here)."""
    q = types.SimpleNamespace(is_cuda=cuda, dtype=dtype, shape=(8192, H, D))
    kv = types.SimpleNamespace(dtype=kv_dtype or dtype, shape=(8192, D))
    idx = types.SimpleNamespace(shape=(8192, k))
    return q, kv, idx, d_v


@pytest.mark.parametrize("change, reason", [
    (dict(dtype=torch.float32), "needs bf16 or fp16 q and kv of one dtype, got torch.float32/torch.float32"),
    (dict(kv_dtype=torch.float16), "needs bf16 or fp16 q and kv of one dtype, got torch.bfloat16/torch.float16"),
    (dict(D=192, d_v=128), r"needs \(head dim, value dim\) in \[\(512, 512\), \(576, 512\)\], got \(192, 128\)"),
    (dict(d_v=448), r"needs \(head dim, value dim\) in \[\(512, 512\), \(576, 512\)\], got \(576, 448\)"),
    (dict(H=1), "needs more than one query head, got 1"),
    (dict(k=0), "needs at least one top-k column"),
    (dict(cuda=False), "needs CUDA tensors"),
])
def test_calls_the_kernel_cannot_take_say_why(change, reason):
    assert re.fullmatch(reason, csb.cudnn_takes(*call(**change)))


def test_the_k3_shapes_are_taken():
    assert csb.cudnn_takes(*call()) is None  # K3's 96 heads
    assert csb.cudnn_takes(*call(H=16)) is None  # the small flavors' 16


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_selecting_it_without_a_gpu_fails_at_configuration():
    assert BACKENDS.checks["cudnn"]() == "no CUDA device"
    with pytest.raises(ValueError, match=r"kernels.sparse_mla = 'cudnn' is not available on this machine: "
                                         r"no CUDA device"):
        configure_backends({"sparse_mla": "cudnn"})
