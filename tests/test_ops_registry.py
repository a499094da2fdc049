"""Every op passes torch.library.opcheck; backend selection fails early with the reason."""

import pytest
import torch

from lowerings import ops
from lowerings.catalog import BACKEND_OPS
from lowerings.ops.registry import configure_backends, selected_backend


def _floats(*tensors):
    return [t.requires_grad_() if t.is_floating_point() else t for t in tensors]


def test_opcheck_every_op():
    torch.manual_seed(0)
    T, H, D = 12, 3, 10
    seg = torch.tensor([0] * 5 + [5] * 7, dtype=torch.int32)
    idx = ops.indexer_topk(torch.randn(T, 2, 6), torch.randn(T, 6), torch.randn(T, 2), seg, topk=4, scale=0.5)
    idx[2] = -1  # an empty row
    cases = [
        (torch.ops.titan_kimi.indexer_topk.default, (torch.randn(T, 2, 6), torch.randn(T, 6), torch.randn(T, 2), seg, 4, 0.5)),
        (torch.ops.titan_kimi.indexer_topk.default,  # a run of queries at an offset into the keys (CP)
         (torch.randn(5, 2, 6), torch.randn(T, 6), torch.randn(5, 2), seg[7:], 4, 0.5, 7)),
        (torch.ops.titan_kimi.sparse_mla.default, (*_floats(torch.randn(T, H, D), torch.randn(T, D)), idx, 0.3, 8)),
        (torch.ops.titan_kimi.situ_glu.default, (*_floats(torch.randn(4, 5, 16)), 4.0, 25.0)),
        (torch.ops.titan_kimi.attn_res_mix.default,
         (*_floats(torch.randn(6, 2, 8), torch.randn(6, 8), torch.randn(8), torch.randn(8)), 1e-5)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("op, name, reason", [
    ("kda", "cudnn", "no CUDA device"),
    ("sparse_mla", "flash_mla", "no CUDA device"),
    ("sparse_mla", "cudnn", "no CUDA device"),
    ("indexer_topk", "cudnn", "no CUDA device"),
    ("sparse_mla", "triton", "no CUDA device"),
    ("kda", "fla", "no CUDA device|not installed"),
])
def test_unavailable_backend_fails_at_configuration_with_the_reason(op, name, reason):
    if torch.cuda.is_available() and reason.startswith("no CUDA"):
        pytest.skip("CUDA is available here")
    before = selected_backend(op)
    with pytest.raises(ValueError, match=reason):
        configure_backends({op: name, "situ_glu": "reference"})
    assert selected_backend(op) == before and selected_backend("situ_glu") == "reference"


def test_unknown_backend_and_auto():
    with pytest.raises(ValueError, match=r"valid: \['auto', 'reference'"):
        configure_backends({"situ_glu": "cutlass"})
    resolved = configure_backends({"situ_glu": "auto", "attn_res_mix": "auto"})
    expected = "triton" if torch.cuda.is_available() else "reference"
    assert resolved == {"situ_glu": expected, "attn_res_mix": expected}
    configure_backends({"situ_glu": "reference", "attn_res_mix": "reference"})


def test_ops_the_model_never_calls_skip_their_availability_checks(monkeypatch):
    """auto for an unused op takes the reference without running any check; a named backend is still checked."""
    from lowerings.ops.sparse_mla import BACKENDS as SPARSE

    calls = []
    monkeypatch.setitem(SPARSE.checks, "cudnn", lambda: calls.append("cudnn") or "would import a large runtime")
    before = selected_backend("sparse_mla")
    try:
        assert configure_backends({"sparse_mla": "auto"}, unused={"sparse_mla"}) == {"sparse_mla": "reference"}
        assert calls == [] and selected_backend("sparse_mla") == "reference"
        with pytest.raises(ValueError, match="would import a large runtime"):
            configure_backends({"sparse_mla": "cudnn"}, unused={"sparse_mla"})
    finally:
        configure_backends({"sparse_mla": before})


def test_the_text_model_does_not_use_the_indexer_ops():
    from titan_kimi.models.kimi_k3.flavors import model_args_for
    from titan_kimi.training.setup.kernels import unused_ops

    assert unused_ops(model_args_for("k3_small")) == {"indexer_topk", "sparse_mla", "indexer_distillation"}
    assert unused_ops(model_args_for("k31_small")) == {"indexer_distillation"}
    assert unused_ops(model_args_for("k31_small", index_training="sparse")) == set()


def test_the_resolved_choice_is_replaced_whole_never_edited():
    from lowerings.ops.registry import install_backends, resolved_backends

    saved = resolved_backends()
    try:
        configure_backends({"situ_glu": "reference"})
        first = resolved_backends()
        with pytest.raises(TypeError):
            first.choices["situ_glu"] = "triton"  # a read-only mapping
        configure_backends({"attn_res_mix": "reference"})
        assert resolved_backends() is not first and first.choices["situ_glu"] == "reference"
        assert set(first.choices) == set(BACKEND_OPS)  # every catalog op, unnamed ones on their reference
        with pytest.raises(ValueError, match=r"situ_glu = 'cutlass' is not a backend .*valid: \['reference', 'triton'\]"):
            first.replaced({"situ_glu": "cutlass"})
    finally:
        install_backends(saved)


def test_a_compiled_graph_guards_on_the_resolved_choice():
    """Ops read the choice in traced code (attn_res_mix, situ_glu under compile): no graph break, and a new choice
    compiles again instead of reusing the graph traced under the old one."""
    import torch._dynamo.testing

    from lowerings.ops.registry import install_backends, resolved_backends

    def step(x):
        return x + 1 if selected_backend("situ_glu") == "triton" else x - 1

    saved = resolved_backends()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    try:
        install_backends(saved.replaced({"situ_glu": "reference"}))
        assert compiled(torch.zeros(2)).tolist() == [-1.0, -1.0]
        install_backends(saved.replaced({"situ_glu": "triton"}))
        assert compiled(torch.zeros(2)).tolist() == [1.0, 1.0]
        assert counter.frame_count == 2
    finally:
        install_backends(saved)
        torch._dynamo.reset()


def test_planning_resolves_auto_as_a_machine_with_every_backend_would():
    from lowerings.ops.registry import planned_backends

    planned = planned_backends({op: "auto" for op in BACKEND_OPS} | {"situ_glu": "reference"})
    assert planned.choices["kda"] == "fla" and planned.choices["sparse_mla"] == "cudnn"
    assert planned.choices["causal_attention"] == "varlen" and planned.choices["situ_glu"] == "reference"
    with pytest.raises(ValueError, match=r"kernels.kda = 'flash' is not a backend of kda; valid: \['auto'"):
        planned_backends({"kda": "flash"})
