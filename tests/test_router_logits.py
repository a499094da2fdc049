"""The MoE router's fp32 logits (lowerings/ops/router_logits.py): the custom ops (their CPU bodies: the GPU's column
slices and gradient halves, summed in IEEE fp32) against the reference formula ``x.float() @ weight.float().t()`` and an fp64 truth, on
fresh random bf16 inputs, forward and backward; which backend runs where; and (@pytest.mark.gpu) the tensor-core
GEMMs at k31.toml's shape and the whole LatentMoE in bf16."""

import importlib

import pytest
import torch

from lowerings import ops
from lowerings.ops.registry import install_backends, resolved_backends

from test_routed_combine import moe_results_per_backend, rel_err

rl = importlib.import_module("lowerings.ops.router_logits")  # the module: lowerings.ops.router_logits is the wrapper


def inputs(T: int, D: int, E: int, device="cpu", seed=0):
    """bf16 ``x [T, D]``, ``weight [E, D]`` and an fp32 cotangent ``[T, E]``, drawn from a seeded generator."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, D, generator=g, device=device).bfloat16()
    w = (torch.randn(E, D, generator=g, device=device) * D ** -0.5).bfloat16()
    return x, w, torch.randn(T, E, generator=g, device=device)


def reference_grads(x, w, cot):
    """The formula's output and gradients (dx, dw rounded to bf16 by the casts' backward)."""
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = rl.router_logits_reference(xr, wr)
    out.backward(cot)
    return out, xr.grad, wr.grad


def truth(x, w, cot):
    """fp64 output, dx and dw."""
    x64, w64, g64 = x.double(), w.double(), cot.double()
    return x64 @ w64.t(), g64 @ w64, g64.t() @ x64


def test_custom_op_matches_the_formula_forward_and_backward():
    x, w, cot = inputs(37, 2600, 24)  # the forward's chunks: a whole group of 8, then 2 and a 40-column leftover
    ref, ref_dx, ref_dw = reference_grads(x, w, cot)
    xo, wo = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = rl.router_logits_op(xo, wo)
    assert out.dtype == torch.float32 and rel_err(out, ref) < 1e-6
    out.backward(cot)
    assert xo.grad.dtype == torch.bfloat16 and wo.grad.dtype == torch.bfloat16
    assert rel_err(xo.grad, ref_dx) < 1e-2 and rel_err(wo.grad, ref_dw) < 1e-2
    # the fp32 gradients before the bf16 rounding: the split's own error
    dx, dw = rl.split_backward(cot, x, w)
    _, true_dx, true_dw = truth(x, w, cot)
    assert dx.dtype == dw.dtype == torch.float32
    assert rel_err(dx, true_dx) < 1e-5 and rel_err(dw, true_dw) < 1e-5


@pytest.mark.parametrize("dim", [5, 24, 100, 72])
def test_forward_sums_the_column_chunks_in_fp32(monkeypatch, dim):
    """The forward's chunked reduction (here 8-column chunks, 3 to a batched GEMM): whole groups, a part group, a
    leftover narrower than a chunk, all add up to the product."""
    monkeypatch.setattr(rl, "CHUNK", 8)
    monkeypatch.setattr(rl, "GROUP", 3)
    x, w, _ = inputs(11, dim, 7, seed=dim)
    out = rl.router_logits_op(x, w)
    assert out.shape == (11, 7) and out.dtype == torch.float32
    assert rel_err(out, truth(x, w, torch.zeros(11, 7))[0]) < 1e-6


def test_the_two_halves_keep_what_one_bf16_cast_loses():
    x, w, cot = inputs(64, 128, 32, seed=1)
    _, true_dx, true_dw = truth(x, w, cot)
    dx, dw = rl.split_backward(cot, x, w)
    one = cot.bfloat16().double()  # the gradient a single bf16 half would carry
    one_dx, one_dw = one @ w.double(), one.t() @ x.double()
    assert 50 * rel_err(dx, true_dx) < rel_err(one_dx, true_dx)
    assert 50 * rel_err(dw, true_dw) < rel_err(one_dw, true_dw)
    halves = rl.split_bf16(cot)
    assert halves.dtype == torch.bfloat16 and halves.shape == (64, 64)
    assert rel_err(halves[:, :32].double() + halves[:, 32:].double(), cot) < 2 ** -16


def test_backward_op_computes_only_the_gradients_asked_for():
    x, w, cot = inputs(9, 16, 8)
    _, ref_dx, ref_dw = reference_grads(x, w, cot)
    dx, dw = rl.router_logits_backward_op(cot, x, w, False, True)
    assert dx.numel() == 0 and rel_err(dw, ref_dw) < 1e-2
    dx, dw = rl.router_logits_backward_op(cot, x, w, True, False)
    assert dw.numel() == 0 and rel_err(dx, ref_dx) < 1e-2
    wf = w.clone().requires_grad_()  # a frozen x: only the weight's gradient
    rl.router_logits_op(x, wf).backward(cot)
    assert rel_err(wf.grad, ref_dw) < 1e-2


def test_custom_ops_pass_opcheck():
    x, w, cot = inputs(6, 16, 5)
    torch.library.opcheck(torch.ops.titan_kimi.router_logits.default, (x.requires_grad_(), w.requires_grad_()))
    for grad_x, grad_weight in ((True, True), (False, True), (True, False)):
        torch.library.opcheck(torch.ops.titan_kimi.router_logits_backward.default,
                              (cot, x.detach(), w.detach(), grad_x, grad_weight))


def test_wrapper_rejects_mismatched_shapes():
    x, w, _ = inputs(4, 16, 5)
    with pytest.raises(ValueError, match=r"x \[T, D\] and weight \[E, D\], got x \(4, 16\) and weight \(5, 15\)"):
        ops.router_logits(x, w[:, :15])
    with pytest.raises(ValueError, match=r"got x \(2, 2, 16\)"):
        ops.router_logits(x.view(2, 2, 16), w)


def test_tensor_core_runs_the_op_only_for_bf16_cuda_tensors(monkeypatch):
    """With router_logits = tensor_core, CPU tensors run the formula (bit for bit); the op runs for bf16 x and
    weight on a (stand-in) CUDA tensor, and the formula again when either is not bf16."""
    x, w, _ = inputs(8, 32, 6)
    calls = []
    monkeypatch.setattr(rl, "router_logits_op", lambda *a: calls.append("op") or rl.router_logits_reference(*a))
    saved = resolved_backends()
    try:
        install_backends(saved.replaced({"router_logits": "tensor_core"}))
        assert torch.equal(ops.router_logits(x, w), x.float() @ w.float().t()) and calls == []
        monkeypatch.setattr(rl, "on_cuda", lambda t: True)
        ops.router_logits(x, w)
        assert calls == ["op"]
        ops.router_logits(x, w.float())
        ops.router_logits(x.float(), w)
        assert calls == ["op"]
        install_backends(saved.replaced({"router_logits": "reference"}))
        ops.router_logits(x, w)
        assert calls == ["op"]
    finally:
        install_backends(saved)


def router_outputs(router, x):
    """The router's weights and indices, and the gradients of x and the gate for one cotangent on the weights."""
    xi = x.clone().requires_grad_()
    router.zero_grad(set_to_none=True)
    weights, indices = router(xi)
    weights.backward(torch.linspace(-1, 1, weights.numel()).view_as(weights))
    return weights, indices, xi.grad, router.gate.weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_is_unchanged_on_cpu(monkeypatch, dtype):
    """The model's Router through the op wrapper against the inline formula it had: bit for bit on CPU, under
    either backend (CPU tensors run the formula)."""
    from titan_kimi.models.kimi_k3 import model_args_for
    from titan_kimi.models.kimi_k3.moe import Router

    torch.manual_seed(0)
    router = Router(model_args_for("k3_debug"))
    router.init_weights()
    router.to(dtype)
    x = torch.randn(19, router.gate.in_features).to(dtype)
    saved = resolved_backends()
    try:
        results = []
        for backend in ("reference", "tensor_core"):
            install_backends(saved.replaced({"router_logits": backend}))
            results.append(router_outputs(router, x))
    finally:
        install_backends(saved)
    monkeypatch.setattr(ops, "router_logits", lambda x, w: x.float() @ w.float().t())  # the inline formula
    inline = router_outputs(router, x)
    for ours in results:
        assert all(torch.equal(a, b) for a, b in zip(ours, inline))


def test_under_autocast_the_logits_are_fp32_sums_of_the_compute_dtype_operands():
    """Autocast (one device's fp32 master weights with bf16 compute) would run the formula's matmul in bf16 and
    return bf16 logits. The op casts both operands to autocast's dtype, as FSDP's param_dtype hands the weight
    over, and sums in fp32: the logits an FSDP mixed-precision run computes."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(29, 96, generator=g, requires_grad=True)
    w = (torch.randn(12, 96, generator=g) * 96 ** -0.5).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = ops.router_logits(x, w)
        plain = x.float() @ w.float().t()
    assert plain.dtype == torch.bfloat16  # what autocast makes of the formula
    assert ours.dtype == torch.float32
    as_fsdp = x.detach().bfloat16().float() @ w.detach().bfloat16().float().t()
    truth64 = x.detach().bfloat16().double() @ w.detach().bfloat16().double().t()
    assert torch.equal(ours, as_fsdp)
    assert rel_err(ours, truth64) < 1e-6 < rel_err(plain, truth64)
    ours.sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.float32  # the master weight's gradient in its own dtype


def test_router_with_a_lora_gate_through_the_op(monkeypatch):
    """A LoRA-adapted gate (its merged weight, base frozen) in bf16 through the op (its CPU body): the routing
    weights and the factors' and input's gradients match the formula's."""
    from titan_kimi.lora import add_adapter
    from titan_kimi.models.kimi_k3 import model_args_for
    from titan_kimi.models.kimi_k3.moe import Router

    torch.manual_seed(0)
    router = Router(model_args_for("k3_debug"))
    router.init_weights()
    add_adapter(router.gate, 4, 8.0, 0.0)
    with torch.no_grad():
        router.gate.lora_A.weight.normal_(0, 0.05)
        router.gate.lora_B.weight.normal_(0, 0.05)
    router.to(torch.bfloat16)
    router.gate.weight.requires_grad_(False)
    x = torch.randn(13, router.gate.in_features).bfloat16()
    monkeypatch.setattr(rl, "on_cuda", lambda t: True)
    saved = resolved_backends()
    results = {}
    try:
        for backend in ("reference", "tensor_core"):
            install_backends(saved.replaced({"router_logits": backend}))
            xi = x.clone().requires_grad_()
            router.zero_grad(set_to_none=True)
            weights, indices = router(xi)
            weights.backward(torch.linspace(-1, 1, weights.numel()).view_as(weights))
            results[backend] = [weights, indices, xi.grad, router.gate.lora_A.weight.grad,
                                router.gate.lora_B.weight.grad]
    finally:
        install_backends(saved)
    ours, ref = results["tensor_core"], results["reference"]
    assert torch.equal(ours[1], ref[1]) and router.gate.weight.grad is None
    for a, b in zip(ours[:1] + ours[2:], ref[:1] + ref[2:]):
        assert rel_err(a, b) < 1e-2


def test_compiled_op_matches_eager(monkeypatch):
    """Under torch.compile(fullgraph=True) the wrapper keeps the op (not the formula Inductor would lower to an
    sgemm) and the compiled forward and backward match eager."""
    x, w, cot = inputs(16, 48, 12, seed=2)
    monkeypatch.setattr(rl, "on_cuda", lambda t: True)
    saved = resolved_backends()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    def run(fn):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xi, wi)
        out.backward(cot)
        return out, xi.grad, wi.grad

    try:
        install_backends(saved.replaced({"router_logits": "tensor_core"}))
        eager = run(ops.router_logits)
        torch._dynamo.reset()
        torch.compile(ops.router_logits, backend=capture, fullgraph=True)(x, w)
        compiled = run(torch.compile(ops.router_logits, backend="aot_eager", fullgraph=True))
        direct = run(torch.compile(rl.router_logits_op, backend="aot_eager", fullgraph=True))
    finally:
        install_backends(saved)
        torch._dynamo.reset()
    assert len(graphs) == 1 and "titan_kimi.router_logits" in graphs[0]
    for ours in (compiled, direct):
        assert all(torch.equal(a, b) for a, b in zip(ours, eager))


# ------------------------------------------------------------------------------------------------ GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_gpu_tensor_core_gemms_at_the_k31_shape():
    """k31.toml's router: 4,096 tokens x 7,168 against 896 experts, bf16. The forward (chunked tensor-core sums) is
    as close to the fp64 truth as the fp32 sgemm; the gradients match the reference's and are no further from the
    truth."""
    x, w, cot = inputs(4096, 7168, 896, device="cuda", seed=3)
    saved = resolved_backends()
    try:
        install_backends(saved.replaced({"router_logits": "reference"}))
        ref = reference_grads(x, w, cot)
        install_backends(saved.replaced({"router_logits": "tensor_core"}))
        xo, wo = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = ops.router_logits(xo, wo)
        out.backward(cot)
    finally:
        install_backends(saved)
    true = truth(x, w, cot)
    assert out.dtype == torch.float32 and rel_err(out, true[0]) <= 2 * rel_err(ref[0], true[0])
    for ours, theirs, exact in ((xo.grad, ref[1], true[1]), (wo.grad, ref[2], true[2])):
        assert ours.dtype == torch.bfloat16
        assert rel_err(ours, theirs) < 1e-2 and rel_err(ours, exact) <= rel_err(theirs, exact) + 1e-3
    dx, dw = rl.split_backward(cot, x, w)  # before the rounding: the halves and the tensor cores' accumulation
    assert rel_err(dx, true[1]) < 1e-5 and rel_err(dw, true[2]) < 1e-5


@pytest.mark.gpu
@gpu
def test_gpu_latent_moe_tensor_core_backend_matches_reference_backend():
    """The whole LatentMoE on CUDA in bf16 (the router too) with router_logits = tensor_core against = reference:
    output and every gradient."""
    from titan_kimi.models.kimi_k3 import model_args_for
    from titan_kimi.models.kimi_k3.moe import LatentMoE

    torch.manual_seed(0)
    moe = LatentMoE(model_args_for("k3_debug", num_experts=16)).cuda()
    moe.init_weights()
    moe = moe.to(torch.bfloat16)
    x = torch.randn(2, 96, moe.router.gate.in_features, device="cuda", dtype=torch.bfloat16)
    results = moe_results_per_backend(moe, x, op="router_logits", backends=("reference", "tensor_core"))
    for ours, ref in zip(results["tensor_core"], results["reference"]):
        assert rel_err(ours, ref) < 1e-2
