"""kernels.sparse_mla = flash_mla on the GPU: DeepSeek FlashMLA's sm90 sparse prefill forward (through
lowerings/kernels/flash_mla_sparse.py) against the fp32 reference and our Triton forward, on fresh random bf16
inputs at K3's latent shape (576 / 512) with packed documents (document-local causal selections, ascending, -1
suffix) and keyless rows; the op's backward (our Triton backward on FlashMLA's out and lse) against the
reference gradients; a CUDA-graph replay. Skips without CUDA or without an importable flash_mla:

    bash scripts/tools/build_flash_mla.sh build .src/flash_mla_src.tar.xz /tmp/site
    PYTHONPATH=$PWD:/tmp/site python3 -m pytest -m gpu tests/test_sparse_mla_flash_mla_gpu.py
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

from lowerings.kernels import flash_mla_sparse as fm
from lowerings.ops.sparse_mla import sparse_mla_reference
from conftest import backend_selected
from test_triton_kernels import _k3_sparse_problem, assert_lse_close, ref_sparse_mla_grads, rel_err

pytestmark = pytest.mark.gpu

SCALE = 192**-0.5  # K3's MLA softmax scale (qk head dim 128 + 64)
DV = 512


@pytest.fixture(autouse=True)
def needs_flash_mla():
    reason = fm.unavailable_reason()  # "no CUDA device" first, then the kernels' own reasons
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def flash_mla_calls(monkeypatch) -> list:
    """Counts the calls that reach flash_mla.flash_mla_sparse_fwd (the glue looks it up on every call)."""
    module = importlib.import_module("flash_mla")
    real = module.flash_mla_sparse_fwd
    calls: list = []

    @functools.wraps(real)  # keeps its signature: the glue passes topk_length only where it is a parameter
    def counted(q, *args, **kwargs):
        calls.append(tuple(q.shape))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(module, "flash_mla_sparse_fwd", counted)
    return calls


def reference_fp32(q, kv, idx, chunk: int = 256):
    """sparse_mla_reference on the same (bf16) inputs in fp32, in token chunks (GPU memory)."""
    outs, lses = [], []
    for t0 in range(0, q.shape[0], chunk):
        o, lse = sparse_mla_reference(q[t0:t0 + chunk].float(), kv.float(), idx[t0:t0 + chunk], SCALE, DV)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def problem(T, H, k, docs=4, seed=0):
    q, kv, idx, dout = _k3_sparse_problem(T, H, k, docs=docs, seed=seed)
    idx[:3] = -1  # keyless rows (padding tokens)
    return q, kv, idx, dout


@pytest.mark.parametrize("T, H, k", [
    (2048, 96, 2048), (2048, 16, 2048),  # K3.1's heads / a 16-head shard; top-2,048
    (1024, 96, 256), (1536, 16, 700),  # top-k not a multiple of 128: -1 padded
    (1024, 128, 512), (1024, 64, 1000), (1024, 200, 384),  # one 128 / 64-head window; windows with a remainder
])
def test_flash_mla_forward_matches_the_reference_and_triton(T, H, k, flash_mla_calls):
    from lowerings.kernels.sparse_mla_fwd import sparse_mla_forward

    q, kv, idx, _ = problem(T, H, k, seed=H + k)
    out, lse = fm.flash_mla_sparse_forward(q, kv, idx, SCALE, DV)
    torch.cuda.synchronize()
    assert len(flash_mla_calls) == len(fm.head_windows(H))
    assert out.shape == (T, H, DV) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert lse.shape == (T, H) and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    ro, rl = reference_fp32(q, kv, idx)
    assert rel_err(out, ro) <= 1e-2, rel_err(out, ro)
    assert_lse_close(lse, rl, 1e-2)  # natural log; keyless rows -inf, only they
    assert (out[:3] == 0).all() and torch.isneginf(lse[:3]).all()
    tout, tlse = sparse_mla_forward(q, kv, idx, SCALE, DV)
    assert rel_err(out, tout) <= 1e-2, rel_err(out, tout)
    assert_lse_close(lse, tlse, 1e-2)


@pytest.fixture
def flash_mla_backend():
    with backend_selected("sparse_mla", "flash_mla"):
        yield


@pytest.mark.parametrize("T, H, k", [(2048, 96, 2048), (1024, 16, 512)])
def test_op_forward_and_backward_with_flash_mla(T, H, k, flash_mla_backend, flash_mla_calls):
    """ops.sparse_mla under kernels.sparse_mla = flash_mla: FlashMLA's forward, our Triton backward on its out and
    lse, against the reference gradients (fp32 on the same bf16 inputs)."""
    from lowerings.ops.sparse_mla import sparse_mla

    q, kv, idx, dout = problem(T, H, k, seed=7 + H)
    qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse = sparse_mla(qg, kvg, idx, scale=SCALE, d_v=DV)
    out.backward(dout)
    torch.cuda.synchronize()
    assert flash_mla_calls, "the op did not reach FlashMLA"
    ro, rl, rdq, rdkv = ref_sparse_mla_grads(q, kv, idx, SCALE, DV, dout, chunk=256, compute_dtype=torch.float32)
    assert rel_err(out, ro) <= 1e-2
    assert_lse_close(lse.detach(), rl, 1e-2)
    assert qg.grad.dtype == kvg.grad.dtype == torch.bfloat16
    assert rel_err(qg.grad, rdq) <= 1e-2, rel_err(qg.grad, rdq)
    assert rel_err(kvg.grad, rdkv) <= 1e-2, rel_err(kvg.grad, rdkv)
    assert qg.grad[:3].abs().max().item() == 0  # keyless rows get no gradient


def test_op_falls_back_to_triton_for_calls_flash_mla_cannot_take(flash_mla_backend, flash_mla_calls):
    from lowerings.ops.sparse_mla import sparse_mla

    q, kv, idx, _ = problem(512, 16, 256, seed=3)
    out, lse = sparse_mla(q.float(), kv.float(), idx, scale=SCALE, d_v=DV)  # fp32: not FlashMLA's
    assert not flash_mla_calls
    ro, rl = reference_fp32(q, kv, idx)
    assert rel_err(out, ro) <= 1e-3
    assert_lse_close(lse, rl, 1e-3)


def test_flash_mla_forward_replays_in_a_cuda_graph():
    """Captured once, replayed on new inputs and selections: equal to an eager call on them (reduce-overhead
    compile captures the op's forward in CUDA graphs)."""
    T, H, k = 1024, 96, 1024
    q, kv, idx, _ = problem(T, H, k, seed=5)
    fm.flash_mla_sparse_forward(q, kv, idx, SCALE, DV)  # warm: kernel attributes, the signature cache
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fm.flash_mla_sparse_forward(q, kv, idx, SCALE, DV)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = fm.flash_mla_sparse_forward(q, kv, idx, SCALE, DV)
    q2, kv2, idx2, _ = problem(T, H, k, docs=2, seed=6)
    for dst, src in ((q, q2), (kv, kv2), (idx, idx2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    want_out, want_lse = fm.flash_mla_sparse_forward(q, kv, idx, SCALE, DV)
    assert torch.equal(out, want_out)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    fin = torch.isfinite(want_lse)
    assert torch.equal(lse[fin], want_lse[fin])
