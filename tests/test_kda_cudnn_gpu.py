"""GPU: the cudnn backend of the kda op (cuDNN frontend 1.32's Hopper engine) against the reference and against
fla, forward and every input gradient, dense and varlen (zero-length tail segments included); compiled against
eager; and a captured CUDA graph replayed on another document layout (no host read of cu_seqlens)."""

import importlib.util

import pytest
import torch

from lowerings.ops import kda
from lowerings.ops.kda import BACKENDS
from lowerings.ops.registry import configure_backends

from test_kda_gpu import eager_and_compiled_kda, rel_err

pytestmark = pytest.mark.gpu

K = 128
NAMES = ["q", "k", "v", "u", "beta", "A_log", "dt_bias"]


@pytest.fixture
def backend(monkeypatch):
    from lowerings.kernels import cudnn_kda

    monkeypatch.setattr(cudnn_kda, "NUMERICS_VALIDATED", True)  # what these tests decide
    reason = BACKENDS.checks["cudnn"]()
    if reason is not None:
        pytest.skip(f"kernels.kda = cudnn is unavailable: {reason}")
    yield configure_backends
    configure_backends({"kda": "reference"})


def make_inputs(B, T, H, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=gen).bfloat16()
    return [mk(B, T, H, K), mk(B, T, H, K), mk(B, T, H, K), mk(B, T, H, K),
            torch.rand(B, T, H, device="cuda", generator=gen),
            torch.empty(H, device="cuda").uniform_(1, 16, generator=gen).log(),
            torch.randn(H * K, device="cuda", generator=gen) * 0.1]


def run(inputs, cu, cot):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o, _ = kda(*leaves[:5], scale=K**-0.5, A_log=leaves[5], dt_bias=leaves[6], lower_bound=-5.0, cu_seqlens=cu)
    o.backward(cot)
    return o.detach(), [x.grad for x in leaves]


LAYOUTS = {  # name: (B, T, cu_seqlens or None)
    "dense": (1, 1024, None),
    "dense_partial_chunk": (1, 1000, None),
    "dense_batch2": (2, 512, None),
    "varlen": (1, 1024, [0, 100, 101, 640, 1024]),
    "varlen_zero_tail": (1, 1024, [0, 100, 300, 1024, 1024, 1024]),
    "one_doc_padded": (1, 1024, [0] + [1024] * 64),  # the trainer's bucketed cu_seqlens for one document
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cudnn_kda_matches_reference_and_fla(backend, layout):
    B, T, cu = LAYOUTS[layout]
    H = 8
    inputs = make_inputs(B, T, H, seed=0)
    cu = torch.tensor(cu, device="cuda", dtype=torch.int32) if cu is not None else None
    cot = torch.randn(B, T, H, K, device="cuda").bfloat16()
    names = ["reference", "cudnn"] + (["fla"] if importlib.util.find_spec("fla") else [])
    results = {}
    for name in names:
        backend({"kda": name})
        results[name] = run(inputs, cu, cot)
    o_ref, g_ref = results["reference"]
    o_cudnn, g_cudnn = results["cudnn"]
    assert torch.isfinite(o_cudnn).all() and all(torch.isfinite(g).all() for g in g_cudnn)
    for name, a, b in zip(NAMES, g_cudnn, g_ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
    # every error first, fla's against the reference next to cudnn's, so one failing run says all of it
    errors = {f"{backend_name} {name}": f"{rel_err(a, b):.2e}" for backend_name in names[1:]
              for name, a, b in zip(["o", *NAMES], [results[backend_name][0], *results[backend_name][1]],
                                    [o_ref, *g_ref])}
    assert rel_err(o_cudnn, o_ref) < 1e-2, errors
    assert all(rel_err(a, b) < 2e-2 for a, b in zip(g_cudnn, g_ref)), errors
    if "fla" in results:
        o_fla, g_fla = results["fla"]
        assert rel_err(o_cudnn, o_fla) < 1e-2, errors
        assert all(rel_err(a, b) < 2e-2 for a, b in zip(g_cudnn, g_fla)), errors


def test_cudnn_kda_under_inductor_matches_eager(backend):
    """The op's fake (no residuals for cudnn) agrees with the real outputs; compiled fwd + bwd equal eager."""
    torch.manual_seed(1)
    backend({"kda": "cudnn"})
    B, T, H = 1, 512, 4
    inputs = make_inputs(B, T, H, seed=1)
    cu = torch.tensor([0, 200, T, T], device="cuda", dtype=torch.int32)
    cot = torch.randn(B, T, H, K, device="cuda").bfloat16()
    outs = eager_and_compiled_kda(inputs, cu, cot)
    assert rel_err(outs["inductor"][0], outs["eager"][0]) < 1e-2
    for name, a, b in zip(NAMES, outs["inductor"][1], outs["eager"][1]):
        assert rel_err(a, b) < 1e-2, name


def test_cudnn_kda_replays_in_a_cuda_graph_on_another_layout(backend):
    """Captured once, replayed after new boundaries are copied into the same cu_seqlens buffer: equals eager at
    the new layout. A host read of cu_seqlens (or a layout cached on the host) would fail the capture or replay
    the captured layout."""
    from lowerings.kernels.cudnn_kda import cudnn_kda_backward, cudnn_kda_forward

    backend({"kda": "cudnn"})
    B, T, H = 1, 1024, 4
    q, k, v, u, beta, A_log, dt_bias = make_inputs(B, T, H, seed=2)
    cu = torch.tensor([0, 100, 300, T, T, T], device="cuda", dtype=torch.int32)
    d_o = torch.randn(B, T, H, K, device="cuda").bfloat16()
    args = lambda: (q, k, v, u, beta, A_log, dt_bias, -5.0, K**-0.5, cu, None, False, True)

    def step():
        o, final, residuals = cudnn_kda_forward(*args())
        return o, cudnn_kda_backward(d_o, final, *args(), residuals)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: NVRTC compiles, graphs build, FLA's gate/l2norm kernels autotune
            o_before, _ = step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static, grads_static = step()
    cu.copy_(torch.tensor([0, 500, 620, 900, T, T], device="cuda", dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    o_eager, grads_eager = step()
    assert rel_err(o_eager, o_before) > 1e-2  # the layouts differ enough to tell apart (about 6e-2 here)
    assert rel_err(o_static, o_eager) < 1e-3  # bitwise unless a kernel reduces in a varying order
    for name, a, b in zip(NAMES, grads_static, grads_eager):
        assert rel_err(a, b) < 1e-3, name
