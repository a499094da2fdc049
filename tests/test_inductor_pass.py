"""The inductor mode's SiTU-GLU rewrite and the Inductor-visible triton_op variants.

On CPU the pass rewrites the formula into the opaque ``titan_kimi::situ_glu`` op (reference backend); the
triton_op path needs CUDA (under TRITON_INTERPRET=1 ``wrap_triton`` cannot trace), so its compiled tests are
marked ``gpu``; its eager forward/backward run here in the interpreter.
"""

from collections import Counter

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from lowerings.inductor.modes import compile_options, lowering_scope
from lowerings.inductor.passes import COUNTER, TitanKimiJointPass
from lowerings.ops.attn_res_mix import attn_res_mix_reference, attn_res_mix_triton_op
from lowerings.ops.registry import install_backends, resolved_backends
from lowerings.ops.situ_glu import situ_glu_reference, situ_glu_triton_op
from titan_kimi.models.kimi_k3.mlp import SituMLP


class OpCensus(CustomGraphPass):
    """A post-grad hook recording, per compiled graph (forward, then backward), the ops it calls."""

    def __init__(self) -> None:
        self.graphs: list[Counter] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs.append(Counter(str(n.target) for n in graph.nodes if n.op == "call_function"))

    def uuid(self) -> str:
        return "titan_kimi-test-op-census"


def compile_inductor_mode(module: torch.nn.Module, census: OpCensus):
    options = compile_options("inductor")
    options["options"] = {**options["options"], "post_grad_custom_post_pass": census}
    return torch.compile(module, fullgraph=True, **options)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def no_fx_cache():
    # An FX-graph or AOT-autograd cache hit would skip the passes under test (and the census); lower for real.
    # The kernels' binaries may still come from Inductor's on-disk cache: they are keyed by their source, which
    # the lowering writes after the passes. (config.patch, not monkeypatch: pytest 9.2's monkeypatch deletes
    # config-module attributes on undo.)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def mlp(dtype=torch.float32) -> SituMLP:
    torch.manual_seed(0)
    module = SituMLP(dim=16, hidden=24, beta=4.0, beta_lin=25.0, init_std=0.2)
    module.init_weights()
    return module.to(dtype)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_formula_is_rewritten_into_the_fused_op_forward_and_backward(no_fx_cache, autocast):
    module, census = mlp(), OpCensus()
    compiled = compile_inductor_mode(module, census)
    ctx = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)  # noqa: E731
    torch.manual_seed(1)
    for _ in range(2):  # fresh random inputs; the second call reuses the compiled graphs
        x = (torch.randn(3, 5, 16) * 3).requires_grad_()
        with ctx():
            ref = module(x)
        ref_grads = torch.autograd.grad(ref.float().sum(), [x, module.gate_up_proj.weight])
        with lowering_scope("inductor"), ctx():
            out = compiled(x)
        grads = torch.autograd.grad(out.float().sum(), [x, module.gate_up_proj.weight])
        tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out, ref, **tol)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, **tol)
    forward, backward = census.graphs
    assert forward["titan_kimi.situ_glu.default"] == 1 and forward["aten.tanh.default"] == 0
    assert backward["titan_kimi.situ_glu_backward.default"] == 1 and backward["aten.tanh.default"] == 0
    assert counters[COUNTER]["situ_glu_rewrites"] == 1


def test_rewrite_holds_with_a_dynamic_token_dim(no_fx_cache):
    # Packed token counts vary; the pattern re-traces each match at its symbolic shape.
    module, census = mlp(), OpCensus()
    compiled = compile_inductor_mode(module, census)
    for rows in (5, 9):
        x = torch.randn(rows, 16, requires_grad=True)
        torch._dynamo.mark_dynamic(x, 0)
        with lowering_scope("inductor"):
            out = compiled(x)
        (grad,) = torch.autograd.grad(out.sum(), x)
        ref = module(x)
        (ref_grad,) = torch.autograd.grad(ref.sum(), x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert counters[COUNTER]["situ_glu_rewrites"] == 1  # one compile serves both sizes
    forward, backward = census.graphs
    assert forward["titan_kimi.situ_glu.default"] == 1 and backward["titan_kimi.situ_glu_backward.default"] == 1


def test_inference_graph_is_rewritten(no_fx_cache):
    module, census = mlp(), OpCensus()
    compiled = compile_inductor_mode(module, census)
    x = torch.randn(4, 16)
    with torch.no_grad(), lowering_scope("inductor"):
        out = compiled(x)
    torch.testing.assert_close(out, module(x), rtol=1e-5, atol=1e-6)
    (graph,) = census.graphs
    assert graph["titan_kimi.situ_glu.default"] == 1 and graph["aten.sigmoid.default"] == 0


def dynamo_targets(fn, *args) -> Counter:
    """Ops in the graph Dynamo captures for ``fn`` (no Inductor)."""
    seen: Counter = Counter()

    def backend(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return seen


def test_only_the_inductor_mode_emits_the_formula():
    module, x = mlp(), torch.randn(2, 16)
    with lowering_scope("inductor"):
        inductor_graph = dynamo_targets(module, x)
        eager_out = module(x)  # eager code keeps the fused op even inside the scope
    torch._dynamo.reset()
    with lowering_scope("default"):
        default_graph = dynamo_targets(module, x)
    assert any("tanh" in t for t in inductor_graph) and any("sigmoid" in t for t in inductor_graph)
    assert not any("situ_glu" in t for t in inductor_graph)
    assert any("titan_kimi.situ_glu" in t for t in default_graph) and not any("tanh" in t for t in default_graph)
    assert "titan_kimi" not in str(compile_options("default"))  # no pass outside the inductor mode
    torch.testing.assert_close(eager_out, module(x))


def test_a_flag_change_recompiles_instead_of_reusing_the_graph():
    # Dynamo guards on the lowering flags: each setting gets its own graph, and both are reused afterwards.
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(any("titan_kimi.situ_glu" in str(n.target) for n in gm.graph.nodes))
        return gm.forward

    compiled = torch.compile(mlp(), backend=backend, fullgraph=True)
    x = torch.randn(3, 16)
    for mode in ("inductor", "default", "inductor", "default"):
        with lowering_scope(mode):
            compiled(x)
    assert graphs == [False, True]  # formula graph, then fused-op graph; no third compile


def test_patterns_registered_under_inference_mode_still_cover_training():
    def entries(p: TitanKimiJointPass) -> int:
        return sum(len(v) for v in p.patterns().patterns.values())

    with torch.inference_mode():  # e.g. an eval compile first
        first = TitanKimiJointPass()
        first_count = entries(first)
    assert first_count == entries(TitanKimiJointPass()) == 6  # 3 dtypes x (training, inference)


def test_pass_uuid_is_stable_and_keys_the_replacement():
    a, b = TitanKimiJointPass(triton_ops=True), TitanKimiJointPass(triton_ops=True)
    key = a.uuid()
    assert key == b.uuid()
    assert key != TitanKimiJointPass(triton_ops=False).uuid()
    saved = resolved_backends()
    try:
        install_backends(saved.replaced({"situ_glu": "triton"}))  # the replacement op differs, so must the key
        assert a.uuid() != key
    finally:
        install_backends(saved)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_triton_op_variants_match_the_references_eagerly():
    # Eager triton_op calls launch the kernels directly (Triton's interpreter on CPU).
    torch.manual_seed(2)
    x = (torch.randn(6, 2 * 40, device=DEVICE) * 4).requires_grad_()
    y = situ_glu_triton_op(x, 4.0, 25.0)
    dy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, dy)
    ref = situ_glu_reference(x, 4.0, 25.0)
    (gref,) = torch.autograd.grad(ref, x, dy)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, gref, rtol=1e-5, atol=1e-5)

    inputs = [torch.randn(shape, device=DEVICE).requires_grad_() for shape in ((5, 3, 48), (5, 48), (48,), (48,))]
    out = attn_res_mix_triton_op(*inputs, 1e-6)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dout)
    ref = attn_res_mix_reference(*inputs, 1e-6)
    ref_grads = torch.autograd.grad(ref, inputs, dout)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


@pytest.fixture
def triton_backends():
    saved = resolved_backends()
    install_backends(saved.replaced({"situ_glu": "triton", "attn_res_mix": "triton"}))
    yield
    install_backends(saved)


def user_kernel_launches(graph: Counter) -> int:
    return sum(n for target, n in graph.items() if "triton_kernel_wrapper" in target)


@pytest.mark.gpu
def test_gpu_triton_ops_pass_opcheck():
    # Fake (meta) behaviour and autograd registration of the triton_op variants; needs real kernels to trace.
    x = torch.randn(4, 5, 32, device="cuda", requires_grad=True)
    torch.library.opcheck(torch.ops.titan_kimi.situ_glu_triton.default, (x, 4.0, 25.0))
    args = [torch.randn(s, device="cuda", requires_grad=True) for s in ((6, 2, 64), (6, 64), (64,), (64,))]
    torch.library.opcheck(torch.ops.titan_kimi.attn_res_mix_triton.default, (*args, 1e-5))


@pytest.mark.gpu
def test_gpu_inductor_mode_rewrites_into_the_triton_op(no_fx_cache, triton_backends):
    module, census = mlp().cuda(), OpCensus()
    compiled = compile_inductor_mode(module, census)
    x = (torch.randn(64, 16, device="cuda") * 3).requires_grad_()
    ref = module(x)
    ref_grads = torch.autograd.grad(ref.sum(), [x, module.gate_up_proj.weight])
    with lowering_scope("inductor"):
        out = compiled(x)
    grads = torch.autograd.grad(out.sum(), [x, module.gate_up_proj.weight])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)
    forward, backward = census.graphs
    assert user_kernel_launches(forward) == 1 and forward["aten.tanh.default"] == 0
    assert user_kernel_launches(backward) == 1 and backward["aten.tanh.default"] == 0
    assert counters[COUNTER]["situ_glu_rewrites"] == 1


@pytest.mark.gpu
def test_gpu_attn_res_mix_triton_op_under_inductor(no_fx_cache, triton_backends):
    from lowerings.ops.attn_res_mix import attn_res_mix

    census = OpCensus()
    torch.manual_seed(3)
    inputs = [torch.randn(256, 4, 512, device="cuda", dtype=torch.bfloat16).requires_grad_(),
              torch.randn(256, 512, device="cuda", dtype=torch.bfloat16).requires_grad_(),
              torch.randn(512, device="cuda").requires_grad_(), torch.randn(512, device="cuda").requires_grad_()]
    options = compile_options("inductor")
    options["options"] = {**options["options"], "post_grad_custom_post_pass": census}
    compiled = torch.compile(lambda *a: attn_res_mix(*a, 1e-6) * 2, fullgraph=True, **options)
    with lowering_scope("inductor"):
        out = compiled(*inputs)
    grads = torch.autograd.grad(out.float().sum(), inputs)
    ref = attn_res_mix_reference(*inputs, 1e-6) * 2
    ref_grads = torch.autograd.grad(ref.float().sum(), inputs)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), r.float(), rtol=3e-2, atol=3e-2)
    forward, backward = census.graphs
    assert user_kernel_launches(forward) >= 1 and user_kernel_launches(backward) >= 1
    assert not any("titan_kimi.attn_res_mix" in t for g in census.graphs for t in g)  # visible, not opaque
