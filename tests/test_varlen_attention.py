"""kernels.causal_attention = varlen on CPU: refused without CUDA, auto's choice with it; the adapter's layout
(rows flattened, v padded to the q/k width, output sliced back) against the masked SDPA reference, with a
per-segment CPU stand-in for FlashAttention's kernel; the calls it cannot take run as sdpa on CPU and as flex
where flex runs; the op traces (meta tensors, a fullgraph compile) with its backward."""

from types import MappingProxyType

import pytest
import torch
import torch.nn.functional as F

import lowerings.ops.attention as attention
from lowerings.kernels import varlen_attention
from lowerings.kernels.varlen_attention import padded_head_dim, varlen_document_causal, varlen_takes
from lowerings.ops import causal_attention, configure_backends, document_causal_mask, op_backends
from titan_kimi.models.kimi_k3.sequence import build_sequence_info
from conftest import pretend_selected


def per_segment_causal(q, k, v, cu_seqlens, max_len, scale):
    """What FlashAttention's varlen kernel computes, one segment at a time (zero-length ones skipped)."""
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds, bounds[1:]):
        if b > a:
            qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))  # [H, n, D]
            out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)
    return out


def masked_reference(q, k, v, seg_start, scale):
    mask = document_causal_mask(seg_start)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale).transpose(1, 2)


def packed(batch=2, seq=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    doc_ids = torch.cumsum(torch.rand(batch, seq, generator=g) < 0.08, dim=1)
    return build_sequence_info(batch, seq, torch.device("cpu"), doc_ids)  # cu_seqlens padded to 64 slots


def test_needs_cuda_and_is_autos_first_choice_there(monkeypatch):
    with pytest.raises(ValueError, match=r"kernels.causal_attention = 'varlen'.*(CUDA|cuda)"):
        configure_backends({"causal_attention": "varlen"})
    backends = op_backends("causal_attention")
    chosen, skipped = backends.resolve_auto()
    assert chosen == "sdpa" and set(skipped) == {"varlen", "flex"}  # CPU: the reference, each skip named
    monkeypatch.setitem(backends.checks, "varlen", lambda: None)  # as on a CUDA machine
    assert backends.resolve_auto() == ("varlen", {})


def test_head_dims_and_what_it_cannot_take():
    assert padded_head_dim(192, 128) == 192 and padded_head_dim(100, 64) == 104 and padded_head_dim(64, 128) == 128
    bf16 = lambda *s: torch.empty(*s, dtype=torch.bfloat16)
    q, v = bf16(1, 8, 2, 192), bf16(1, 8, 2, 128)
    assert "bf16 or fp16" in varlen_takes(q.float(), q.float(), v.float())
    assert "as many keys as queries" in varlen_takes(q, bf16(1, 16, 2, 192), bf16(1, 16, 2, 128))
    assert "exceed FlashAttention's 256" in varlen_takes(bf16(1, 8, 2, 320), bf16(1, 8, 2, 320), v)
    assert varlen_takes(q, q, v) is None  # the device is the op's rule (OFF_CUDA)


def test_forward_kernel_routing():
    """The op's rule table: each backend's kernel, sdpa off CUDA for varlen, then varlen's refusals to flex and
    flex's to sdpa (plain causal rows take sdpa's is_causal kernel under every backend)."""
    seq = packed()
    bf16 = torch.randn(2, 96, 2, 64, dtype=torch.bfloat16)
    docs = dict(seg_start=seq.seg_start, cu_seqlens=seq.cu_seqlens)
    kernel = lambda backend, q=bf16, **kw: attention.forward_kernel(backend, q, q, q, **kw)
    assert kernel("varlen", **docs, cuda=True) == "varlen"
    assert kernel("varlen", **docs) == "sdpa"  # CPU tensors
    assert kernel("varlen", q=bf16.float(), **docs, cuda=True) == "flex"  # fp32: flex on CUDA
    assert kernel("varlen", seg_start=seq.seg_start, cuda=True) == "flex"  # no cu_seqlens
    placed = dict(docs, q_positions=torch.arange(96).expand(2, 96))
    assert kernel("varlen", **placed, cuda=True) == "flex"  # context parallelism's placed queries
    assert kernel("varlen", cuda=True) == kernel("flex", cuda=True) == kernel("sdpa") == "sdpa"  # plain causal
    assert kernel("flex", **docs) == kernel("flex", **docs, cuda=True) == "flex"  # flex runs anywhere
    assert kernel("sdpa", **docs, cuda=True) == "sdpa"
    assert set(attention.CAUSAL_ATTENTION_KERNELS) == set(op_backends("causal_attention").checks)


@pytest.mark.parametrize("dv", [128, 192])
def test_adapter_layout_matches_the_masked_reference(monkeypatch, dv):
    monkeypatch.setattr(varlen_attention, "flash_varlen_causal", per_segment_causal)
    seq = packed()
    assert int(seq.cu_seqlens[-2]) == int(seq.cu_seqlens[-1])  # zero-length tail segments are in the test
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 96, 3, 192, generator=g) for _ in range(2))
    v = torch.randn(2, 96, 3, dv, generator=g)
    got = varlen_document_causal(q, k, v, scale=0.07, cu_seqlens=seq.cu_seqlens)
    want = masked_reference(q, k, v, seq.seg_start, 0.07)
    assert got.shape == want.shape == (2, 96, 3, dv)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_calls_it_cannot_take_run_as_sdpa(monkeypatch):
    pretend_selected(monkeypatch, "causal_attention", "varlen")
    seq = packed()
    q = torch.randn(2, 96, 2, 64)
    got = causal_attention(q, q, q, scale=0.1, seg_start=seq.seg_start, cu_seqlens=seq.cu_seqlens)  # CPU, fp32
    assert torch.allclose(got, masked_reference(q, q, q, seq.seg_start, 0.1), atol=1e-6)


def test_placed_queries_go_to_flex_where_flex_runs(monkeypatch):
    """Context parallelism's rectangular calls (queries placed among more keys): varlen hands them to flex on
    CUDA (stood in for here by flex's CPU reference), which gives the masked reference's values."""
    from lowerings.kernels import flex_attention

    pretend_selected(monkeypatch, "causal_attention", "varlen")
    monkeypatch.setattr(attention, "OFF_CUDA", MappingProxyType({}))  # CPU tensors routed as CUDA ones
    calls = []
    real = flex_attention.flex_causal_attention
    monkeypatch.setattr(flex_attention, "flex_causal_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    seq = packed(batch=1, seq=96)
    q = torch.randn(1, 48, 2, 64)  # the second half of the row's queries
    k, v = torch.randn(1, 96, 2, 64), torch.randn(1, 96, 2, 64)
    positions = torch.arange(48, 96).unsqueeze(0)
    seg = seq.seg_start[:, 48:]
    got = causal_attention(q, k, v, scale=0.1, seg_start=seg, q_positions=positions, cu_seqlens=seq.cu_seqlens)
    mask = document_causal_mask(seg, positions, 96)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                          scale=0.1).transpose(1, 2)
    assert calls == [1] and torch.allclose(got, want, atol=1e-5)


def test_traces_with_its_backward_in_a_fullgraph_compile():
    """aten._flash_attention_forward has meta kernels and an autograd formula: on meta tensors the adapter
    compiles as one graph and differentiates (the GPU test runs it for real)."""
    fn = torch.compile(lambda q, k, v, cu: varlen_document_causal(q, k, v, scale=0.1, cu_seqlens=cu),
                       backend="aot_eager", fullgraph=True)
    q, k = (torch.empty(2, 256, 4, 192, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.empty(2, 256, 4, 128, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out = fn(q, k, v, torch.zeros(65, dtype=torch.int32, device="meta"))
    out.sum().backward()
    assert out.shape == (2, 256, 4, 128) and q.grad.shape == q.shape and v.grad.shape == v.shape
