"""Context parallelism (titan_kimi/parallel/context_parallel.py, lowerings/ops/kda_cp.py) against one process.

Tolerances: in fp32, outputs and gradients match one process on the whole sequences to 1e-5 relative for each
layer (observed <= 5e-6) and to 1e-4 for a whole training step (observed ~1e-5: summation order across
ranks, as for the other layouts in test_parallel.py). With the shipped recipe's bf16 mixed precision, losses
follow one process within 2% at each of 8 steps and 0.5% at step 1 (test_parallel.py's bounds and reasons).
"""

import re

import pytest
import torch

from lowerings.ops.sequence_shards import chunk_slots, local_positions, rank_chunks
from titan_kimi.models.kimi_k3 import KimiK3Model, model_args_for
from titan_kimi.parallel.context_parallel import ContextParallel
from tests.test_parallel import close

LAYOUTS = ("zigzag", "contiguous")


def test_layouts_cut_every_row_into_the_pieces_each_rank_holds():
    assert rank_chunks("zigzag", 0, 4) == (0, 7) and rank_chunks("zigzag", 3, 4) == (3, 4)
    assert local_positions("zigzag", 1, 2, 16).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert local_positions("contiguous", 1, 2, 16).tolist() == list(range(8, 16))
    for layout in LAYOUTS:
        everyone = torch.cat([local_positions(layout, r, 4, 64) for r in range(4)])
        assert sorted(everyone.tolist()) == list(range(64))  # the ranks tile the row
        slots = chunk_slots(layout, 4)  # chunk -> its slot in a rank-major gather of every rank's pieces
        pieces = torch.cat([local_positions(layout, r, 4, 64).view(-1, 64 // len(slots)) for r in range(4)])
        assert torch.equal(pieces[slots].reshape(-1), torch.arange(64))
    with pytest.raises(ValueError, match="cannot be cut into 8 equal chunks"):
        local_positions("zigzag", 0, 4, 20)
    with pytest.raises(ValueError, match="layout 'ring'; valid"):
        rank_chunks("ring", 0, 2)


@pytest.mark.parametrize("flavor", ["k31_debug", "k3_debug"])
def test_one_rank_zigzag_passes_state_and_halo_between_its_two_pieces(one_rank_group, flavor):
    """On one rank the zigzag layout holds chunks 0 and 1 of every row, in order, as two pieces: the short-conv
    halo, the KDA state, the MLA keys and the DSA top-k all cross from the first piece to the second through the
    context-parallel paths, and must give one process's outputs and gradients."""
    args = model_args_for(flavor)
    torch.manual_seed(0)
    model = KimiK3Model(args)
    model.init_weights()
    B, S = 2, 96
    tokens = torch.randint(1, args.vocab_size, (B, S))
    doc = torch.ones(B, S, dtype=torch.int32)
    for cut in (5, 47, 48, 60):  # one document crosses the pieces' boundary (47..48), one starts on it
        doc[0, cut:] += 1
    cot = torch.randn(B, S, args.dim)

    def run(context_parallel=None):
        model.zero_grad()
        hidden = model(tokens, doc_ids=doc, return_hidden=True, context_parallel=context_parallel)
        (hidden * cot).sum().backward()
        return hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref, ref_grads = run()
    for layout in LAYOUTS:
        out, grads = run(ContextParallel(one_rank_group, layout))
        assert float((out - ref).norm() / ref.norm()) < 1e-5, layout
        assert grads.keys() == ref_grads.keys()
        for name, g in ref_grads.items():
            assert float((grads[name] - g).norm() / g.norm().clamp(min=1e-30)) < 1e-4, (layout, name)


@pytest.mark.slow
def test_context_parallel_paths_compile_as_one_graph_per_block(one_rank_group):
    """The exchange's all-gathers (functional collectives), the halo, the state passing and the DSA's query runs
    trace into each block's graph (fullgraph=True), and the compiled model gives the eager one's results."""
    from titan_kimi.parallel.compile import apply_compile

    # one AttnRes block (KDA + dense at its start, KDA + MoE, DSA + MoE): each attention kind's CP path once, and
    # half the block variants to compile of the flavor's 8 layers
    args = model_args_for("k31_debug", n_layers=4)
    torch.manual_seed(0)
    model = KimiK3Model(args)
    model.init_weights()
    tokens = torch.randint(1, args.vocab_size, (2, 64))
    doc = torch.ones(2, 64, dtype=torch.int32)
    doc[0, 20:] += 1
    eager = model(tokens, doc_ids=doc, return_hidden=True)
    eager.sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    apply_compile(model, "default", fullgraph=True, experts_outside=False)
    out = model(tokens, doc_ids=doc, return_hidden=True, context_parallel=ContextParallel(one_rank_group, "zigzag"))
    out.sum().backward()
    assert float((out - eager).norm() / eager.norm()) < 1e-5
    for name, g in ref.items():
        assert float((model.get_parameter(name).grad - g).norm() / g.norm().clamp(min=1e-30)) < 1e-4, name


def test_whole_row_doc_ids_are_required(one_rank_group):
    cp = ContextParallel(one_rank_group, "zigzag")
    with pytest.raises(ValueError, match=r"doc_ids must cover the whole rows, \[2, 32\]"):
        cp.build_sequence(2, 32, torch.device("cpu"), torch.ones(2, 16, dtype=torch.int32))
    batch = {"input_ids": torch.arange(16).view(2, 8), "labels": torch.arange(16).view(2, 8),
             "doc_ids": torch.ones(2, 8, dtype=torch.int32)}
    local = cp.shard_batch(batch)
    assert local["doc_ids"].shape == (2, 8) and torch.equal(local["input_ids"], batch["input_ids"])


@pytest.mark.slow
def test_each_attention_kind_matches_one_process_over_2_and_4_ranks(parity_runs):
    """KDA (conv halo, documents crossing and starting on piece boundaries), dense MLA and the K3.1 DSA (top-32 of
    192 keys per row; about 30% / 70% of the chosen keys live on other ranks), both layouts (tests/cp_layer_worker.py,
    run in the launch of tests/parity_runs.py)."""
    out = parity_runs.output()
    rows = re.findall(r"CP (\w+) (\w+) world (\d) out (\S+) dx (\S+) grads (\S+) remote (\S+)", out)
    assert {(k, lay, w) for k, lay, w, *_ in rows} == {(k, lay, w) for k in ("kda", "mla", "dsa")
                                                       for lay in LAYOUTS for w in "24"}, out
    for kind, layout, world, o, dx, grads, remote in rows:
        assert max(float(o), float(dx), float(grads)) < 1e-5, (kind, layout, world, o, dx, grads)
        if kind == "dsa":
            assert float(remote) > 0.2, (layout, world, remote)  # keys selected on other ranks matter


@pytest.mark.slow
def test_training_step_under_cp_composed_with_fsdp_pp_ep_matches_one_process(parity_runs):
    """One step's gradients on 4 ranks (tests/parity_runs.py: one launch with test_parallel.py's layouts)."""
    names = ["cp2_dp2", "cp2_contiguous_dp2", "cp4", "cp2_pp2", "cp2_ep2_dp2", "cp2_pp2_ep2"]
    results = {name: (grad, loss) for name, (grad, loss, _) in parity_runs.parity(names).items()}
    assert set(results) == set(names), parity_runs.output()
    for name, (grad, loss) in results.items():
        assert float(grad) < 1e-4 and float(loss) < 1e-5, (name, grad, loss)


@pytest.mark.slow
def test_shipped_recipe_trains_under_cp_like_one_process(layout_runs):
    """As a user types it (mixed precision on, zigzag by default), 8 steps, global batch 8: the CP ranks share the
    FSDP mesh, so the reference of the same precision policy is FSDP over 2 ranks (tests/test_parallel.py).
    CP2, CP2 x EP2 and CP2 x PP2 (tests/layout_runs.py RUNS)."""
    for name in ("cp2", "cp2_ep2", "cp2_pp2"):
        close(layout_runs.losses(name), layout_runs.losses("fsdp2"))


@pytest.mark.slow
def test_checkpoint_saved_under_cp_resumes_at_one_process_and_in_the_other_layout(layout_runs):
    full = layout_runs.losses("saved_cp2")
    assert (layout_runs.folder("saved_cp2") / "checkpoint" / "step-2" / ".metadata").is_file()
    for name in ("cp2_to_single", "cp2_to_contiguous"):
        resumed = layout_runs.losses(name)
        assert len(resumed) == 2, resumed  # steps 3 and 4
        for a, b in zip(resumed, full[2:]):
            assert a == pytest.approx(b, rel=1e-4), (name, resumed, full)
