"""GPU: the FLA backend of the kda op against the reference, forward and backward, dense and varlen."""

import pytest
import torch

from lowerings.ops import kda
from lowerings.ops.registry import configure_backends

pytestmark = pytest.mark.gpu


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def k3_kda_inputs(B, T, H, K):
    """q, k, v, u (bf16 normal), beta, A_log, dt_bias of the K3 gate on the GPU; and the bf16 maker for more."""
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)
    return mk, [mk(B, T, H, K), mk(B, T, H, K), mk(B, T, H, K), mk(B, T, H, K), torch.rand(B, T, H, device="cuda"),
                torch.empty(H, device="cuda").uniform_(1, 16).log(), torch.randn(H * K, device="cuda") * 0.1]


def eager_and_compiled_kda(inputs, cu, cot):
    """{"eager" | "inductor": (o, input grads)} of the selected kda backend, eager and under a fullgraph compile,
    on ``inputs`` = q, k, v, u, beta, A_log, dt_bias (head dim from q) with the cotangent ``cot``."""
    K = inputs[0].shape[-1]

    def run(*xs):
        return kda(*xs[:5], scale=K**-0.5, A_log=xs[5], dt_bias=xs[6], lower_bound=-5.0, cu_seqlens=cu)[0]

    outs = {}
    for name, fn in (("eager", run), ("inductor", torch.compile(run, backend="inductor", fullgraph=True))):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        o = fn(*leaves)
        o.backward(cot)
        outs[name] = (o.detach(), [x.grad for x in leaves])
    return outs


@pytest.fixture
def backend():
    yield configure_backends
    configure_backends({"kda": "reference"})


@pytest.mark.parametrize("varlen", [False, True])
def test_fla_kda_matches_reference(backend, varlen):
    torch.manual_seed(0)
    B, T, H, K = (1, 1024, 8, 128) if varlen else (2, 512, 8, 128)
    dev = "cuda"
    _, inputs = k3_kda_inputs(B, T, H, K)
    cu = torch.tensor([0, 100, 101, 640, T], device=dev, dtype=torch.int32) if varlen else None
    cot = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    results = {}
    for name in ("reference", "fla"):
        backend({"kda": name})
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        o, _ = kda(*leaves[:5], scale=K**-0.5, A_log=leaves[5], dt_bias=leaves[6], lower_bound=-5.0, cu_seqlens=cu)
        o.backward(cot)
        results[name] = (o.detach(), [x.grad for x in leaves])
    (o_ref, g_ref), (o_fla, g_fla) = results["reference"], results["fla"]
    assert rel_err(o_fla, o_ref) < 1e-2
    for name, a, b in zip(["q", "k", "v", "u", "beta", "A_log", "dt_bias"], g_fla, g_ref):
        assert rel_err(a, b) < 2e-2, name


def test_fla_kda_under_inductor_matches_eager(backend):
    """Inductor checks every output of the opaque op against its fake (sizes and strides): the fla backend's
    residuals must be declared exactly. Compiled forward + backward equal eager."""
    torch.manual_seed(1)
    backend({"kda": "fla"})
    B, T, H, K = 1, 512, 4, 128
    dev = "cuda"
    mk, inputs = k3_kda_inputs(B, T, H, K)
    cu = torch.tensor([0, 200, T], device=dev, dtype=torch.int32)
    cot = mk(B, T, H, K)
    outs = eager_and_compiled_kda(inputs, cu, cot)
    assert rel_err(outs["inductor"][0], outs["eager"][0]) < 1e-2
    for a, b in zip(outs["inductor"][1], outs["eager"][1]):
        assert rel_err(a, b) < 1e-2


def test_fla_kda_replays_in_a_cuda_graph_across_document_layouts(backend):
    """FLA's graph mode: cu_seqlens padded with zero-length tails to one shape, the op's forward and backward
    captured once in a CUDA graph and replayed for other document layouts (new cu_seqlens values in the same
    buffer) equal eager calls on those layouts, and eager equals the reference. No host sync inside capture
    (a sync would fail the capture)."""
    torch.manual_seed(2)
    backend({"kda": "fla"})
    B, T, H, K = 1, 2048, 4, 128
    dev = "cuda"
    mk, inputs = k3_kda_inputs(B, T, H, K)
    cot = mk(B, T, H, K)
    layouts = [[0, 100, 101, 640, T], [0, 2000, T], [0, 64, 128, 129, 1000, 1500, 1501, T]]
    slots = 16

    def padded(bounds):
        return torch.tensor(bounds + [T] * (slots + 1 - len(bounds)), device=dev, dtype=torch.int32)

    cu_buf = padded(layouts[0])
    leaves = [x.detach().clone().requires_grad_() for x in inputs]

    def step():
        for x in leaves:
            x.grad = None
        o = kda(*leaves[:5], scale=K**-0.5, A_log=leaves[5], dt_bias=leaves[6], lower_bound=-5.0,
                cu_seqlens=cu_buf)[0]
        o.backward(cot)
        return o

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside capture: Triton compiles / tunes here
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for x in leaves:
        x.grad = None
    with torch.cuda.graph(graph):
        o_graph = step()
    for bounds in layouts[1:] + layouts[:1]:
        cu_buf.copy_(padded(bounds))
        graph.replay()
        replayed = (o_graph.clone(), [x.grad.clone() for x in leaves])
        for name in ("fla", "reference"):
            backend({"kda": name})
            fresh = [x.detach().clone().requires_grad_() for x in inputs]
            o = kda(*fresh[:5], scale=K**-0.5, A_log=fresh[5], dt_bias=fresh[6], lower_bound=-5.0,
                    cu_seqlens=padded(bounds) if name == "fla" else torch.tensor(bounds, device=dev,
                                                                                  dtype=torch.int32))[0]
            o.backward(cot)
            bound = 1e-5 if name == "fla" else 2e-2  # same kernels: the replay equals an eager call
            assert rel_err(replayed[0], o) < (1e-5 if name == "fla" else 1e-2), (bounds, name)
            names = ["q", "k", "v", "u", "beta", "A_log", "dt_bias"]
            for label, a, b in zip(names, replayed[1], [x.grad for x in fresh]):
                assert rel_err(a, b) < bound, (bounds, name, label)
        backend({"kda": "fla"})


def test_fla_kda_inside_reduce_overhead_graphs_matches_eager(backend):
    """The untagged op inside cudagraph trees (compile.mode = reduce-overhead): two compiled layers of
    projections around the op, three steps on three document layouts in one padded cu_seqlens shape. Every
    step's parameter gradients equal eager's; before FLA's graph buffers became fresh tensors per call
    (lowerings/kernels/fla_graph_buffers.py) the first backward failed with tensors left in the graph pool."""
    from lowerings.inductor.modes import compile_options

    torch.manual_seed(3)
    backend({"kda": "fla"})
    T, H, K, D = 2048, 4, 128, 256

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(D, 4 * H * K, bias=False)
            self.beta = torch.nn.Linear(D, H, bias=False)
            self.out = torch.nn.Linear(H * K, D, bias=False)
            self.A_log = torch.nn.Parameter(torch.empty(H).uniform_(1, 16).log())
            self.dt_bias = torch.nn.Parameter(torch.randn(H * K) * 0.1)

        def forward(self, x, cu):
            q, k, v, u = self.proj(x).view(1, T, 4, H, K).unbind(2)
            o = kda(q, k, v, u, torch.sigmoid(self.beta(x)).float(), scale=K**-0.5, A_log=self.A_log,
                    dt_bias=self.dt_bias, lower_bound=-5.0, cu_seqlens=cu)[0]
            return x + self.out(o.reshape(1, T, H * K))

    layers = [Layer().cuda().bfloat16() for _ in range(2)]
    for layer in layers:  # the gate's parameters stay fp32, as the model keeps them
        layer.A_log.data, layer.dt_bias.data = layer.A_log.data.float(), layer.dt_bias.data.float()
    compiled = [torch.compile(layer, **compile_options("reduce-overhead")) for layer in layers]
    params = [p for layer in layers for p in layer.parameters()]
    layouts = [[0, 100, 640, T], [0, 2000, T], [0, 64, 129, 1000, 1501, T]]
    for bounds in layouts:
        cu = torch.tensor(bounds + [T] * (17 - len(bounds)), device="cuda", dtype=torch.int32)
        x0 = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16)
        grads = []
        for stack in (layers, compiled):
            x = x0
            for layer in stack:
                x = layer(x, cu)
            x.float().square().mean().backward()
            grads.append(torch.cat([p.grad.float().flatten() for p in params]))
            for p in params:
                p.grad = None
        assert rel_err(grads[1], grads[0]) < 2e-2, bounds
