"""The MoE's dispatch and combine rows (lowerings/ops/routed_combine.py): the custom ops and the Triton kernels
against the plain torch indexing the reference backend runs, on fresh random inputs, forward and backward;
under the CPU interpreter at small shapes and (@pytest.mark.gpu) at k31.toml's per-rank shape in bf16."""

import pytest
import torch

from lowerings.ops import routed_combine as rc
from lowerings.ops.registry import install_backends, resolved_backends

from test_triton_kernels import _interp_mods, ik  # noqa: F401 (fixtures)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def routing(T: int, k: int, experts: int, L: int, dtype=torch.float32, device="cpu", seed=0):
    """A stable argsort of random distinct-per-token expert choices, the expert-ordered rows and router weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    choices = torch.rand(T, experts, generator=g, device=device).topk(k, dim=-1).indices
    order = torch.argsort(choices.view(-1), stable=True)
    rows = torch.randn(T * k, L, generator=g, device=device).to(dtype)
    weights = torch.rand(T, k, generator=g, device=device)
    x = torch.randn(T, L, generator=g, device=device).to(dtype)
    return order, rows, weights, x


def reference_combine(rows, order, weights, dtype):
    """The model's combine as it was written before the op: unsort by scatter, fp32 weighted sum."""
    T, k = weights.shape
    unsorted = torch.empty_like(rows)
    unsorted[order] = rows
    return (weights.unsqueeze(-1) * unsorted.view(T, k, -1).float()).sum(1).to(dtype)


def test_routing_slots_invert_the_order():
    order, _, _, _ = routing(9, 3, 7, 4)
    slots = rc.routing_slots(order, 3)
    assert slots.shape == (9, 3)
    assert torch.equal(order[slots.view(-1)], torch.arange(27))


def test_custom_ops_match_the_indexing_formulas_forward_and_backward():
    torch.manual_seed(0)
    T, k, L = 11, 4, 24
    order, rows, weights, x = routing(T, k, 9, L)  # the sum is fp32 by definition: fp32 inputs, fp32 tolerance
    slots = rc.routing_slots(order, k)
    cot = torch.randn(T, L)

    rows_a, w_a = rows.clone().requires_grad_(), weights.clone().requires_grad_()
    rows_b, w_b = rows.clone().requires_grad_(), weights.clone().requires_grad_()
    ours = rc.routed_gather_sum_op(rows_a, slots, w_a, torch.float32)
    ref = reference_combine(rows_b, order, w_b, torch.float32)
    assert rel_err(ours, ref) < 1e-6
    ours.backward(cot)
    ref.backward(cot)
    assert rel_err(rows_a.grad, rows_b.grad) < 1e-6 and rel_err(w_a.grad, w_b.grad) < 1e-6

    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    d_ours = rc.routed_dispatch_op(xa, order, slots, k)
    d_ref = xb[order // k]
    assert torch.equal(d_ours, d_ref)
    cot_rows = torch.randn(T * k, L)
    d_ours.backward(cot_rows)
    d_ref.backward(cot_rows)
    assert rel_err(xa.grad, xb.grad) < 1e-6


def test_custom_ops_pass_opcheck():
    T, k, L = 6, 3, 8
    order, rows, weights, x = routing(T, k, 5, L)
    slots = rc.routing_slots(order, k)
    torch.library.opcheck(torch.ops.titan_kimi.routed_gather_sum.default,
                          (rows.requires_grad_(), slots, weights.requires_grad_(), torch.float32))
    torch.library.opcheck(torch.ops.titan_kimi.routed_gather_sum.default, (rows, slots, None, torch.bfloat16))
    torch.library.opcheck(torch.ops.titan_kimi.routed_dispatch.default, (x.requires_grad_(), order, slots, k))


def test_wrappers_reject_mismatched_shapes():
    order, rows, weights, x = routing(5, 2, 4, 8)
    with pytest.raises(ValueError, match="T \\* k"):
        rc.dispatch_rows(x, rc.route_rows(order[:-2], 2))
    with pytest.raises(ValueError, match="T \\* k"):
        rc.combine_rows(rows[:-2], rc.route_rows(order, 2), weights, torch.float32)


def assert_kernels_match(kernels, rows, order, weights, formula, dtype, tol, *, ref_dtype=torch.float64,
                         weights_tol: float | None = None) -> torch.Tensor:
    """``kernels``' gather-sum (the interpreted or the GPU module), forward and backward, against ``formula`` in
    ``ref_dtype`` on a fresh cotangent; returns the slots."""
    T, k = weights.shape
    slots = rc.routing_slots(order, k)
    rows_r, w_r = rows.to(ref_dtype).requires_grad_(), weights.to(ref_dtype).requires_grad_()
    ref = formula(rows_r, order, w_r, ref_dtype)
    cot = torch.randn(T, rows.shape[1], device=rows.device).to(dtype)
    ref.backward(cot.to(ref_dtype))
    out = kernels.gather_sum(rows, slots, weights, dtype)
    d_rows, d_w = kernels.gather_sum_backward(cot, rows, slots, weights)
    assert out.dtype == dtype and d_rows.dtype == dtype and d_rows.shape == rows.shape and d_w.dtype == torch.float32
    assert rel_err(out, ref) < tol and rel_err(d_rows, rows_r.grad) < tol
    assert rel_err(d_w, w_r.grad) < (max(tol, 1e-5) if weights_tol is None else weights_tol)
    return slots


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_interpreted_kernels_match_the_reference(ik, dtype, tol):
    T, k, L = 13, 4, 150  # L not a multiple of the column block
    order, rows, weights, x = routing(T, k, 10, L, dtype=dtype, seed=3)
    slots = assert_kernels_match(ik.routed_combine, rows, order, weights, reference_combine, dtype, tol)

    # unweighted, into another dtype: the dispatch's gradient (each token's rows summed)
    summed = ik.routed_combine.gather_sum(rows, slots, None, torch.float32)
    assert rel_err(summed, rows.double()[slots].sum(1)) < 1e-6


def test_interpreted_kernels_reject_bad_shapes(ik):
    order, rows, weights, _ = routing(4, 2, 5, 8)
    slots = rc.routing_slots(order, 2)
    with pytest.raises(ValueError, match="every one of the"):
        ik.routed_combine.gather_sum(torch.cat([rows, rows[:1]]), slots, weights, torch.float32)
    with pytest.raises(ValueError, match="weights must be"):
        ik.routed_combine.gather_sum(rows, slots, weights[:, :1], torch.float32)
    with pytest.raises(ValueError, match="grad must be"):
        ik.routed_combine.gather_sum_backward(torch.randn(3, 8), rows, slots, weights)


def present_routing(T: int, k: int, nodes: int, L: int, dtype=torch.float32, seed=0):
    """A relay's view (the hierarchical dispatch): each row's ``k`` choices, those not on this node absent (-1,
    weight 0), sorted after the present ones; the present choices' expert-ordered rows."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.rand(T, 4 * nodes, generator=g).topk(k, dim=-1).indices
    here = experts < 4  # the first node's 4 experts
    key = torch.where(here, experts, 4).view(-1)
    order = torch.argsort(key, stable=True)
    present = int(here.sum())
    weights = torch.where(here, torch.rand(T, k, generator=g), 0.0)
    rows = torch.randn(present, L, generator=g).to(dtype)
    return order, present, rows, weights


def present_formula(rows, order, weights, dtype):
    """Each row's present choices' outputs, weighted and summed in fp32 (the absent ones count nothing)."""
    T, k = weights.shape
    unsorted = rows.new_zeros(T * k, rows.shape[1]).index_copy(0, order[:rows.shape[0]], rows)
    return (weights.unsqueeze(-1) * unsorted.view(T, k, -1).float()).sum(1).to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_interpreted_kernels_skip_absent_choices(ik, dtype, tol):
    """Slots past the rows (choices absent from a relay's node) read nothing, count zero and take no gradient."""
    T, k, L = 9, 4, 70
    order, present, rows, weights = present_routing(T, k, 3, L, dtype=dtype, seed=4)
    assert 0 < present < T * k
    assert_kernels_match(ik.routed_combine, rows, order, weights, present_formula, dtype, tol)


def test_present_ops_match_their_formulas_forward_and_backward():
    """dispatch_present, combine_present and sum_present (the reference paths, and the custom op that the triton
    backend runs, on CPU) against the explicit formulas, fp32, forward and backward."""
    T, k, L = 8, 4, 12
    order, present, rows, weights = present_routing(T, k, 3, L, seed=6)
    routing = rc.RowRouting(order, k, None)
    x = torch.randn(T, L, requires_grad=True)
    sent = rc.dispatch_present(x, routing, present)
    assert torch.equal(sent, x[order[:present] // k])
    with pytest.raises(ValueError, match="present rows"):
        rc.dispatch_present(x, routing, T * k + 1)

    cot = torch.randn(T, L)
    w_a, w_b = weights.clone().requires_grad_(), weights.clone().requires_grad_()
    r_a, r_b, r_c = (rows.clone().requires_grad_() for _ in range(3))
    ref = present_formula(r_a, order, w_a, torch.float32)
    ours = rc.combine_present(r_b, routing, w_b, torch.float32)
    op = rc.routed_gather_sum_op(r_c, rc.routing_slots(order, k), weights, torch.float32)
    assert rel_err(ours, ref) < 1e-6 and rel_err(op, ref) < 1e-6
    for t in (ref, ours, op):
        t.backward(cot)
    assert rel_err(r_b.grad, r_a.grad) < 1e-6 and rel_err(w_b.grad, w_a.grad) < 1e-6
    assert rel_err(r_c.grad, r_a.grad) < 1e-6

    # a token's (token, node) pairs: 5 tokens on 3 nodes, pairs listed node by node
    hit = torch.tensor([[1, 0, 1], [0, 0, 1], [1, 1, 1], [0, 1, 0], [1, 0, 0]], dtype=torch.bool)
    pair_node, pair_token = torch.nonzero(hit.t(), as_tuple=True)
    listed = hit.t().reshape(-1)
    slots = torch.where(listed, torch.cumsum(listed, 0) - 1, pair_token.numel()).view(3, 5).t().contiguous()
    pairs = torch.randn(pair_token.numel(), L)
    expected = torch.zeros(5, L).index_add(0, pair_token, pairs)
    assert rel_err(rc.sum_present(pairs, pair_token, slots, torch.float32), expected) < 1e-6
    assert rel_err(rc.routed_gather_sum_op(pairs, slots, None, torch.float32), expected) < 1e-6


# ------------------------------------------------------------------------------------------------ GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_gpu_kernels_skip_absent_choices_at_a_relays_shape():
    """A relay of k31's hierarchical dispatch at EP128 (16 nodes of 8): ~11,900 (token, node) rows x top-16
    choices, those of its node present (~18,400), latent 3,584, bf16, against the fp32 formula."""
    from lowerings.kernels import routed_combine as kernels

    torch.manual_seed(7)
    P, k, L = 11900, 16, 3584
    experts = torch.rand(P, 896, device="cuda").topk(k, dim=-1).indices
    here = torch.rand(P, k, device="cuda") < 0.097  # ~1.55 of a row's 16 choices on the relay's node
    key = torch.where(here, experts % 56, 56).view(-1)  # its 56 experts, the absent choices last
    order = torch.argsort(key, stable=True)
    present = int(here.sum())
    weights = torch.where(here, torch.rand(P, k, device="cuda"), 0.0)
    rows = torch.randn(present, L, device="cuda", dtype=torch.bfloat16)
    assert_kernels_match(kernels, rows, order, weights, present_formula, torch.bfloat16, 1e-2,
                         ref_dtype=torch.float32, weights_tol=1e-4)


@pytest.mark.gpu
@gpu
def test_gpu_kernels_at_the_k31_rank_shape():
    """4,096 tokens x top-16 rows of the 3,584-wide latent (k31.toml's microbatch on one EP rank's view), bf16."""
    T, k, L = 4096, 16, 3584
    order, rows, weights, x = routing(T, k, 896, L, dtype=torch.bfloat16, device="cuda", seed=5)
    from lowerings.kernels import routed_combine as kernels

    slots = assert_kernels_match(kernels, rows, order, weights, reference_combine, torch.bfloat16, 1e-2,
                                 ref_dtype=torch.float32, weights_tol=1e-4)
    assert rel_err(kernels.gather_sum(rows, slots, None, torch.float32), rows.float()[slots].sum(1)) < 1e-5


@pytest.mark.gpu
@gpu
def test_gpu_latent_moe_triton_backend_matches_reference_backend():
    """The whole LatentMoE on CUDA in bf16 with routed_combine = triton against = reference: output and every
    gradient."""
    from titan_kimi.models.kimi_k3 import model_args_for
    from titan_kimi.models.kimi_k3.moe import LatentMoE

    torch.manual_seed(0)
    moe = LatentMoE(model_args_for("k3_debug", num_experts=16)).cuda()
    moe.init_weights()
    moe = moe.to(torch.bfloat16)
    moe.router.float()
    x = torch.randn(2, 96, moe.router.gate.in_features, device="cuda", dtype=torch.bfloat16)
    results = moe_results_per_backend(moe, x)
    for ours, ref in zip(results["triton"], results["reference"]):
        assert rel_err(ours, ref) < 1e-2


def test_triton_backend_runs_the_ops_in_eager_and_the_plain_indexing_inside_compiled_regions(monkeypatch):
    """With routed_combine = triton on a (stand-in) CUDA tensor, eager code calls the custom ops, while a compiled
    region traces the plain indexing, which Inductor fuses with its neighbours."""
    order, rows, weights, x = routing(7, 3, 6, 16)
    saved = resolved_backends()
    monkeypatch.setattr(rc, "on_cuda", lambda t: True)
    calls = []
    monkeypatch.setattr(rc, "routed_gather_sum_op", lambda *a: calls.append("op") or rc.gather_sum_reference(*a))
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    try:
        install_backends(saved.replaced({"routed_combine": "triton"}))
        eager = rc.combine_rows(rows, rc.route_rows(order, 3), weights, torch.float32)
        assert calls == ["op"]
        compiled = torch.compile(lambda r, w: rc.combine_rows(r, rc.route_rows(order, 3), w, torch.float32),
                                 backend=capture, fullgraph=True)(rows, weights)
    finally:
        install_backends(saved)
    assert calls == ["op"] and len(graphs) == 1 and "routed_gather_sum" not in graphs[0]
    assert rel_err(compiled, eager) < 1e-6


def test_latent_moe_through_the_custom_ops_matches_the_indexing(monkeypatch):
    """The model's MoE with the triton backend's custom ops (their CPU bodies, on a stand-in CUDA tensor) against
    the plain indexing: output and every gradient, fp32 (the slots computed once for both)."""
    from titan_kimi.models.kimi_k3 import model_args_for
    from titan_kimi.models.kimi_k3.moe import LatentMoE

    torch.manual_seed(0)
    moe = LatentMoE(model_args_for("k3_debug"))
    moe.init_weights()
    x = torch.randn(2, 9, moe.router.gate.in_features)
    monkeypatch.setattr(rc, "on_cuda", lambda t: True)
    results = moe_results_per_backend(moe, x)
    for ours, ref in zip(results["triton"], results["reference"]):
        assert rel_err(ours, ref) < 1e-6


def test_hierarchical_dispatch_through_the_custom_ops_matches_the_indexing(monkeypatch, one_rank_group):
    """The hierarchical dispatch (one rank standing for both levels, padding tokens among the rows) with the
    triton backend's custom ops (their CPU bodies: the relay's present rows, its weighted sums with absent choices,
    each token's sum over its nodes) against the reference's indexing and fp32 index_add: output and every
    gradient, fp32."""
    from test_overlapped_exchange import dispatch_by_node_on_one_rank

    from titan_kimi.models.kimi_k3 import model_args_for
    from titan_kimi.models.kimi_k3.moe import LatentMoE

    torch.manual_seed(2)
    moe = LatentMoE(model_args_for("k3_debug"))
    moe.init_weights()
    dispatch_by_node_on_one_rank(moe, "cpu")
    x = torch.randn(2, 9, moe.router.gate.in_features)
    monkeypatch.setattr(rc, "on_cuda", lambda t: True)
    results = moe_results_per_backend(moe, x)
    for ours, ref in zip(results["triton"], results["reference"]):
        assert rel_err(ours, ref) < 1e-6


def moe_results_per_backend(moe, x: torch.Tensor, op: str = "routed_combine",
                            backends: tuple[str, ...] = ("reference", "triton")) -> dict[str, list[torch.Tensor]]:
    """``op``'s backend -> the MoE's output, input gradient and every parameter gradient for one cotangent."""
    cot = torch.randn_like(x)
    saved = resolved_backends()
    results = {}
    try:
        for backend in backends:
            install_backends(saved.replaced({op: backend}))
            xi = x.clone().requires_grad_()
            moe.zero_grad(set_to_none=True)
            out = moe(xi)
            out.backward(cot)
            results[backend] = [out, xi.grad] + [p.grad for p in moe.parameters() if p.requires_grad]
    finally:
        install_backends(saved)
    return results
