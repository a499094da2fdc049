"""Indexer training in a DSA layer: the KL path's gradients against autograd through a dense float64 reference
(written here from the layer's weights), in both modes, with packed documents and padding; the recall metric;
the LM path left as it is."""

import math

import pytest
import torch

from titan_kimi.models.kimi_k3 import build_sequence_info, model_args_for
from titan_kimi.models.kimi_k3.mla import GatedMLA

from test_mla_dsa import reference_indexer_scores

TOPK = 8
# row 0: documents of 22 and 12 tokens, then 6 of padding; row 1: one document of 40
DOC_IDS = torch.tensor([[1] * 22 + [2] * 12 + [0] * 6, [3] * 40], dtype=torch.int32)


def make_layer(mode: str, seed: int = 0) -> GatedMLA:
    torch.manual_seed(seed)
    layer = GatedMLA(model_args_for("k31_debug", index_n_heads=4, index_head_dim=16, index_topk=TOPK,
                                    index_training=mode))
    layer.init_weights()
    with torch.no_grad():  # larger weights than the init: peaked attention, an indexer far from it
        for p in layer.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    return layer


def allowed_by_document(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B,S,S]: causal within each run of equal doc id (padding runs included, as the model's segments are)."""
    B, S = doc_ids.shape
    same = doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1)
    start = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        for t in range(1, S):
            start[b, t] = start[b, t - 1] if doc_ids[b, t] == doc_ids[b, t - 1] else t
    s = torch.arange(S)
    return same & (s.view(1, 1, S) <= s.view(1, S, 1)) & (s.view(1, 1, S) >= start.unsqueeze(2))


def main_probabilities(layer: GatedMLA, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """[H,S,S] float64 softmax of the unabsorbed MLA scores of one row over the allowed keys."""
    x = x.double()
    rms = lambda t, norm: norm.weight.double() * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + norm.eps)
    S, n, nope, rope = x.shape[0], layer.n_heads, layer.nope, layer.rope
    q = (rms(x @ layer.q_a_proj.weight.double().T, layer.q_a_layernorm) @ layer.q_b_proj.weight.double().T)
    q = q.view(S, n, nope + rope)
    kv_a = x @ layer.kv_a_proj_with_mqa.weight.double().T
    c_kv, k_r = kv_a[:, : layer.kv_lora_rank], kv_a[:, layer.kv_lora_rank:]
    k_nope = (rms(c_kv, layer.kv_a_layernorm) @ layer.kv_b_proj.weight.double().T).view(S, n, -1)[..., :nope]
    k = torch.cat([k_nope, k_r.unsqueeze(1).expand(S, n, rope)], dim=-1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(nope + rope)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)


def reference_kl_sum(layer: GatedMLA, x: torch.Tensor, keys: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """sum over real queries of KL(head-summed L1-normalised main probabilities || indexer softmax), over the keys
    ``keys [B,S,S]``, float64, differentiable in the indexer's weights (as float64 copies of them: see caller)."""
    total = torch.zeros((), dtype=torch.float64)
    for b in range(x.shape[0]):
        probs = main_probabilities(layer, x[b], keys[b]).sum(0)
        p = probs / probs.sum(-1, keepdim=True)
        scores = reference_indexer_scores(layer, x[b]).masked_fill(~keys[b], float("-inf"))
        log_q = torch.log_softmax(scores, dim=-1)
        kl = torch.where(keys[b] & (p > 0), p * (torch.log(p.clamp(min=1e-300)) - log_q), torch.zeros_like(p)).sum(-1)
        total = total + kl[real[b]].sum()
    return total


def indexer_grads(layer: GatedMLA) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in layer.indexer.named_parameters()}


def run_layer(layer: GatedMLA, x: torch.Tensor, seq) -> torch.Tensor:
    seq.indexer_loss_scale = torch.tensor(1.0)  # the gradient of the plain KL sum
    out = layer(x, seq)
    (out * 0).sum().backward()  # the layer's output carries the KL into the backward
    return out


def selection_mask(layer: GatedMLA, x: torch.Tensor, seq) -> torch.Tensor:
    with torch.no_grad():
        idx = layer.indexer(x, layer._queries(x)[1], seq)  # flat [B*S, k]
    B, S = x.shape[:2]
    rows = torch.zeros(B * S, B * S + 1, dtype=torch.bool).scatter_(1, torch.where(idx >= 0, idx.long(), B * S), True)
    flat = rows[:, : B * S].view(B, S, B, S)
    return torch.stack([flat[b, :, b] for b in range(B)])


@pytest.mark.parametrize("mode", ["warmup", "sparse"])
def test_kl_gradient_matches_a_dense_float64_reference_with_packed_documents(mode):
    """Warm-up: every causal key of the document; sparse: the selected keys (documents longer than top-k)."""
    layer = make_layer(mode)
    x = torch.randn(2, 40, 128)
    seq = build_sequence_info(2, 40, x.device, DOC_IDS)
    run_layer(layer, x, seq)
    got = indexer_grads(layer)
    keys = allowed_by_document(DOC_IDS) if mode == "warmup" else selection_mask(layer, x, seq)
    assert mode == "warmup" or (keys.sum(-1) == TOPK).any() and (keys.sum(-1) < TOPK).any()
    real = DOC_IDS != 0
    # the reference reads the indexer's weights in float64 through reference_indexer_scores
    layer.zero_grad(set_to_none=True)
    originals = {n: p.data.clone() for n, p in layer.indexer.named_parameters()}
    for p in layer.indexer.parameters():
        p.data = p.data.double()
    reference_kl_sum(layer, x, keys, real).backward()
    for name, p in layer.indexer.named_parameters():
        want = p.grad
        err = float((got[name].double() - want).norm() / want.norm())
        assert err < 1e-5, (mode, name, err)
        p.data = originals[name]


def test_sparse_mode_keeps_the_frozen_layer_output_and_its_gradients_and_warmup_attends_densely():
    """The KL adds nothing to the LM path: the attention output and the main weights' gradients of a layer whose
    indexer trains are those of the frozen layer (sparse) and of dense attention (warm-up)."""
    x = torch.randn(2, 40, 128)
    results = {}
    for mode, dense in (("frozen", False), ("sparse", False), ("warmup", True), ("frozen", True)):
        layer = make_layer(mode, seed=3)
        seq = build_sequence_info(2, 40, x.device, DOC_IDS)
        seq.dsa_dense = dense and mode == "frozen"  # the frozen layer attends densely only when told to
        out = layer(x, seq)
        (out.square().sum()).backward()
        main = {n: p.grad for n, p in layer.named_parameters() if not n.startswith("indexer.")}
        results[(mode, dense)] = out.detach(), main
    for trained, frozen in ((("sparse", False), ("frozen", False)), (("warmup", True), ("frozen", True))):
        (out_a, grads_a), (out_b, grads_b) = results[trained], results[frozen]
        assert torch.allclose(out_a, out_b, rtol=1e-6, atol=1e-7), trained
        assert all(g is not None for g in grads_a.values())
        for name in grads_b:
            assert torch.allclose(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-8), (trained, name)


@pytest.mark.parametrize("mode", ["warmup", "sparse"])
def test_recall_is_the_main_attention_mass_inside_the_top_k_over_queries_with_more_keys(mode):
    layer = make_layer(mode, seed=5)
    x = torch.randn(2, 40, 128)
    seq = build_sequence_info(2, 40, x.device, DOC_IDS)
    seq.indexer_metrics = True
    run_layer(layer, x, seq)
    kl_sum, queries, mass_sum, counted = layer.indexer.distillation_stats.tolist()
    selected, every = selection_mask(layer, x, seq), allowed_by_document(DOC_IDS)
    masses, count = [], 0
    for b in range(2):
        probs = main_probabilities(layer, x[b], every[b])  # dense attention, [H, S, S]
        keep = (every[b].sum(-1) > TOPK) & (DOC_IDS[b] != 0)
        masses.append((probs * selected[b]).sum(-1).mean(0)[keep])
        count += int(keep.sum())
    assert counted == count == (22 - TOPK) + (12 - TOPK) + (40 - TOPK)  # queries past their documents' first top-k
    assert queries == int((DOC_IDS != 0).sum())
    assert mass_sum == pytest.approx(float(torch.cat(masses).sum()), rel=1e-5)
    assert kl_sum > 0 and 0 < mass_sum / counted < 1


@pytest.mark.parametrize("mode", ["warmup", "sparse"])
def test_dsa_block_with_a_training_indexer_compiles_fullgraph_and_matches_eager(mode):
    """Zero graph breaks (recall measured too), and the compiled block's output and indexer gradients are
    eager's."""
    from lowerings.inductor.graph_breaks import count_graph_breaks
    from titan_kimi.models.kimi_k3.block import KimiK3Block

    torch.manual_seed(0)
    args = model_args_for("k31_debug", index_training=mode)
    block = KimiK3Block(3, args)  # DSA + MoE, the first layer of the second AttnRes block
    block.init_weights()
    hidden = torch.randn(2, 40, args.dim, requires_grad=True)
    bank = torch.randn(80, 1, args.dim)
    seq = build_sequence_info(2, 40, hidden.device, DOC_IDS)
    seq.indexer_metrics = True
    assert count_graph_breaks(block, hidden, bank, seq).breaks == 0
    results = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        block.zero_grad(set_to_none=True)
        block.attention.indexer.distillation_stats.zero_()
        out, _ = fn(hidden, bank, seq)
        out.sum().backward()
        grads = {n: p.grad.clone() for n, p in block.attention.indexer.named_parameters()}
        results.append((out.detach(), grads, block.attention.indexer.distillation_stats.clone()))
    (out, grads, stats), (out_c, grads_c, stats_c) = results
    assert torch.allclose(out_c, out, rtol=1e-5, atol=1e-6)
    assert torch.allclose(stats_c, stats, rtol=1e-5)
    for name in grads:
        assert torch.allclose(grads_c[name], grads[name], rtol=1e-4, atol=1e-8), name


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["warmup", "sparse"])
def test_triton_backend_gives_the_reference_indexer_gradients_in_a_bf16_layer_on_gpu(mode):
    """k31_small's DSA layer shape (16 heads, 64 x 128 indexer heads) at 4,096 tokens in two documents, top-2,048:
    the layer's indexer gradients and KL counters with kernels.indexer_distillation = triton against reference."""
    from conftest import backend_selected

    torch.manual_seed(0)
    args = model_args_for("k31_small", index_training=mode)
    with torch.device("cuda"):
        layer = GatedMLA(args)
        layer.init_weights()
    layer.to(torch.bfloat16)
    x = torch.randn(1, 4096, args.dim, device="cuda", dtype=torch.bfloat16)
    doc_ids = torch.tensor([[1] * 1500 + [2] * 2596], device="cuda")
    results = {}
    for backend in ("reference", "triton"):
        layer.zero_grad(set_to_none=True)
        layer.indexer.distillation_stats.zero_()
        seq = build_sequence_info(1, 4096, x.device, doc_ids)
        seq.indexer_metrics = True
        with backend_selected("indexer_distillation", backend):
            run_layer(layer, x, seq)
        results[backend] = indexer_grads(layer), layer.indexer.distillation_stats.clone()
    (grads, stats), (grads_t, stats_t) = results["reference"], results["triton"]
    assert torch.allclose(stats_t, stats, rtol=2e-2), (stats_t, stats)
    for name in grads:
        err = float((grads_t[name].float() - grads[name].float()).norm() / grads[name].float().norm())
        assert err < 3e-2, (mode, name, err)
