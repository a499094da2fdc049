"""The debug models with kernels.causal_attention = flex against sdpa: the same loss and gradients, eager and
under a fullgraph compile of every block, with no graph breaks and no recompile when the document count of the
batch changes."""

import importlib.util
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from lowerings.kernels import flex_attention
from lowerings.ops import configure_backends
from lowerings.ops.registry import install_backends, resolved_backends
from titan_kimi.data import IGNORE_INDEX
from titan_kimi.data.causal_keys import longest_document
from titan_kimi.models.kimi_k3 import model_args_for
from titan_kimi.models.kimi_k3.model import KimiK3Model
from titan_kimi.training.loss import LinearCrossEntropyLoss

_spec = importlib.util.spec_from_file_location("check_graph_breaks", Path(__file__).parents[1] / "scripts/check/graph_breaks.py")
check_graph_breaks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_graph_breaks)

SEQ = 40


@pytest.fixture
def restore_backend():
    saved = resolved_backends()
    yield
    install_backends(saved)


def packed_batch(lengths: list[list[int]], seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    doc = torch.zeros(len(lengths), SEQ, dtype=torch.int32)
    for row, docs in enumerate(lengths):
        start = 0
        for i, n in enumerate(docs):
            doc[row, start:start + n] = i + 1
            start += n
    tokens = torch.randint(1, 2048, (len(lengths), SEQ), generator=g)
    labels = torch.where(doc > 0, torch.randint(0, 2048, tokens.shape, generator=g), IGNORE_INDEX)
    return tokens, doc, labels


def loss_and_grads(model, tokens, doc, labels, context_parallel=None):
    model.zero_grad(set_to_none=True)
    hidden = model(tokens, doc_ids=doc, return_hidden=True, max_causal_keys=longest_document(doc),
                   context_parallel=context_parallel)
    loss = LinearCrossEntropyLoss(64)(model.output, hidden, labels, float((labels != IGNORE_INDEX).sum()))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.allclose(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:  # relative L2 per tensor: elementwise bounds fail on near-zero entries (fp32 sums of many tokens)
        error = float((grads_a[name] - grads_b[name]).norm() / grads_b[name].norm().clamp_min(1e-30))
        assert error < 5e-5, (name, error)


# Rows of several documents (lengths 1 and odd among them), padding at the end of one, one of a single document.
BATCHES = [[[1, 7, 13, 19], [40]], [[5, 5, 5, 5, 5, 5, 5, 5], [11, 20]], [[3, 30, 7], [1, 1, 38]]]


# k31: index_topk above every document, so the DSA layers always take the dense shortcut (through this op).
@pytest.mark.parametrize("flavor, overrides", [("k3_debug", {}), ("k31_debug", {"index_topk": 64})])
def test_flex_model_matches_sdpa_eager_and_compiled(flavor, overrides, restore_backend, monkeypatch):
    torch.manual_seed(0)
    model = KimiK3Model(model_args_for(flavor, **overrides))
    model.init_weights()
    batches = [packed_batch(lengths, seed=i) for i, lengths in enumerate(BATCHES)]
    configure_backends({"causal_attention": "sdpa"})
    references = [loss_and_grads(model, *batch) for batch in batches]
    configure_backends({"causal_attention": "flex"})
    calls = []
    with monkeypatch.context() as patch:  # count the flex calls: one per MLA layer
        patch.setattr(flex_attention, "flex_document_causal",
                      lambda *a, _f=flex_attention.flex_document_causal: calls.append(1) or _f(*a))
        assert_same(loss_and_grads(model, *batches[0]), references[0])
    assert len(calls) == sum(not model.args.is_kda_layer(i) for i in range(model.args.n_layers)) > 0

    torch._dynamo.reset()
    counters.clear()
    for block in model.layers.values():
        block.compile(fullgraph=True, backend="aot_eager")  # fullgraph: a graph break would raise
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=256):
        assert_same(loss_and_grads(model, *batches[0]), references[0])
        graphs = counters["stats"]["unique_graphs"]
        for batch, reference in zip(batches[1:], references[1:]):  # other document counts: the same graphs
            assert_same(loss_and_grads(model, *batch), reference)
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])


def test_every_block_type_traces_without_graph_breaks_under_flex(restore_backend):
    # k3_debug's dense MLA block; K3.1's DSA blocks reach this op only by the dense shortcut, which the fullgraph
    # compile above covers (check_graph_breaks traces them on their sparse path).
    configure_backends({"causal_attention": "flex"})
    results = check_graph_breaks.check("k3_debug", seq_len=32, device="cpu", dtype=torch.float32)
    assert "mla+moe" in results
    assert all(breaks == 0 for breaks in results.values()), results


def test_flex_under_one_rank_context_parallelism_matches_one_process_sdpa(tmp_path, restore_backend):
    """CP hands the op global seg_start and q_positions (here one rank's two zigzag pieces): the placed mask."""
    import torch.distributed as dist

    from titan_kimi.parallel.context_parallel import ContextParallel

    torch.manual_seed(0)
    model = KimiK3Model(model_args_for("k3_debug"))
    model.init_weights()
    tokens, doc, labels = packed_batch([[5, 30, 5], [1, 39]])  # documents cross the pieces' boundary (20)
    configure_backends({"causal_attention": "sdpa"})
    reference = loss_and_grads(model, tokens, doc, labels)
    configure_backends({"causal_attention": "flex"})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        loss, grads = loss_and_grads(model, tokens, doc, labels, ContextParallel(dist.group.WORLD, "zigzag"))
    finally:
        dist.destroy_process_group()
    # CP sums in another order: sdpa under CP is 2e-5 (relative norm) off one process too, as test_context_parallel allows
    assert torch.allclose(loss, reference[0], rtol=1e-5)
    assert grads.keys() == reference[1].keys()
    for name, g in reference[1].items():
        assert float((grads[name] - g).norm() / g.norm().clamp(min=1e-30)) < 1e-4, name
