"""kernels.sparse_mla = cudnn on the GPU: cuDNN frontend's sm90 DSA backward after our forward, against the fp32
reference gradients and our Triton backward, on fresh random inputs at K3's latent shape (576 / 512, top-2,048),
with document-local causal selections, keyless rows, a CUDA-graph replay and the op's routing."""

from __future__ import annotations

import pytest
import torch

from lowerings.kernels import cudnn_sparse_mla_bwd as csb
from conftest import pretend_selected
from test_triton_kernels import _k3_sparse_problem, ref_sparse_mla_grads, rel_err

pytestmark = pytest.mark.gpu

SCALE = 192**-0.5  # K3's MLA softmax scale (qk head dim 128 + 64)


@pytest.fixture(autouse=True)
def needs_cudnn():
    reason = csb.unavailable_reason()  # "no CUDA device" first, then the kernels' own reasons
    if reason is not None:
        pytest.skip(reason)


def forward(q, kv, idx):
    from lowerings.kernels.sparse_mla_fwd import sparse_mla_forward

    return sparse_mla_forward(q, kv, idx, SCALE, 512)


@pytest.mark.parametrize("T, H, k", [(2048, 96, 2048), (2048, 16, 2048), (1024, 64, 512), (1024, 128, 256)])
def test_cudnn_backward_matches_the_reference_and_triton(T, H, k):
    from lowerings.kernels.sparse_mla_bwd import sparse_mla_backward

    q, kv, idx, dout = _k3_sparse_problem(T, H, k, seed=H + k)
    idx[:3] = -1  # keyless rows (padding tokens): no gradient
    out, lse = forward(q, kv, idx)
    dq, dkv = csb.cudnn_sparse_mla_backward(dout, q, kv, idx, out, lse, SCALE, 512)
    torch.cuda.synchronize()
    _, _, rdq, rdkv = ref_sparse_mla_grads(q, kv, idx, SCALE, 512, dout, chunk=256, compute_dtype=torch.float32)
    assert dq.dtype == dkv.dtype == torch.bfloat16 and torch.isfinite(dq).all() and torch.isfinite(dkv).all()
    assert rel_err(dq, rdq) <= 1e-2, rel_err(dq, rdq)
    assert rel_err(dkv, rdkv) <= 1e-2, rel_err(dkv, rdkv)
    assert dq[:3].abs().max().item() == 0
    tdq, tdkv = sparse_mla_backward(dout, q, kv, idx, out, lse, SCALE, 512)
    assert rel_err(dq, tdq) <= 1e-2 and rel_err(dkv, tdkv) <= 1e-2


def test_cudnn_backward_replays_in_a_cuda_graph():
    """Captured once, replayed on new inputs and new selections: equal to an eager call on them."""
    T, H, k = 1024, 96, 1024
    q, kv, idx, dout = _k3_sparse_problem(T, H, k, seed=5)
    out, lse = forward(q, kv, idx)
    csb.cudnn_sparse_mla_backward(dout, q, kv, idx, out, lse, SCALE, 512)  # compiles outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        csb.cudnn_sparse_mla_backward(dout, q, kv, idx, out, lse, SCALE, 512)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dq, dkv = csb.cudnn_sparse_mla_backward(dout, q, kv, idx, out, lse, SCALE, 512)
    q2, kv2, idx2, dout2 = _k3_sparse_problem(T, H, k, docs=2, seed=6)
    out2, lse2 = forward(q2, kv2, idx2)
    for dst, src in ((q, q2), (kv, kv2), (idx, idx2), (dout, dout2), (out, out2), (lse, lse2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    want_dq, want_dkv = csb.cudnn_sparse_mla_backward(dout, q, kv, idx, out, lse, SCALE, 512)
    assert rel_err(dq, want_dq) <= 1e-3 and rel_err(dkv, want_dkv) <= 1e-3  # dkv sums with atomics


def test_the_op_routes_to_cudnn_and_falls_back_for_fp32(monkeypatch):
    from lowerings.ops.sparse_mla import sparse_mla

    pretend_selected(monkeypatch, "sparse_mla", "cudnn")
    T, H, k = 512, 16, 256
    q, kv, idx, dout = _k3_sparse_problem(T, H, k, seed=9)
    calls = []
    real = csb.cudnn_sparse_mla_backward
    monkeypatch.setattr(csb, "cudnn_sparse_mla_backward", lambda *a: calls.append(a[1].dtype) or real(*a))
    for dtype in (torch.bfloat16, torch.float32):  # fp32: the Triton backward
        qg, kvg = q.detach().to(dtype).requires_grad_(), kv.detach().to(dtype).requires_grad_()
        out, _ = sparse_mla(qg, kvg, idx, scale=SCALE, d_v=512)
        out.backward(dout.to(dtype))
        _, _, rdq, rdkv = ref_sparse_mla_grads(qg, kvg, idx, SCALE, 512, dout, compute_dtype=torch.float32)
        assert rel_err(qg.grad, rdq) <= 1e-2 and rel_err(kvg.grad, rdkv) <= 1e-2
    assert calls == [torch.bfloat16]
