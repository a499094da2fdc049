"""The indexer-distillation ops against a dense float64 autograd truth written here, with packed documents."""

import pytest
import torch

from lowerings import ops
from lowerings.ops.indexer_kl import (attention_lse_op, dense_kl_op, scores_at_op, sparse_mla_distilled_op,
                                     sparse_target_op)
from lowerings.ops.indexer_kl_reference import row_kl, row_kl_score_grad
from lowerings.ops.indexer_topk import indexer_topk_reference

H, D, HI, DI = 3, 24, 4, 8
SCALE, INDEX_SCALE = D**-0.5, DI**-0.5


def packed_seg_start(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), sum(lengths[:i]), dtype=torch.int32) for i, n in enumerate(lengths)])


def document_mask(seg_start: torch.Tensor) -> torch.Tensor:
    t = torch.arange(seg_start.shape[0]).unsqueeze(1)
    s = torch.arange(seg_start.shape[0]).unsqueeze(0)
    return (s <= t) & (s >= seg_start.long().unsqueeze(1))


def inputs(T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape, std=1.0: (torch.randn(*shape, generator=g) * std)
    # peaked main attention (large logits), an indexer far from it
    return dict(iq=rand(T, HI, DI), ik=rand(T, DI), iw=rand(T, HI).abs() * HI**-0.5,
                q=rand(T, H, D, std=2.0), kv=rand(T, D))


def truth(t: dict, allowed: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Per-query KL in float64 over the ``allowed [T,T]`` keys (main probabilities per head over the same keys,
    summed over heads and L1-normalised), and its gradients in iq, ik, iw by autograd."""
    iq, ik, iw = (t[k].double().requires_grad_() for k in ("iq", "ik", "iw"))
    logits = torch.einsum("thd,sd->hts", t["q"].double(), t["kv"].double()) * SCALE
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).sum(0)
    p = probs / probs.sum(-1, keepdim=True)
    scores = torch.einsum("th,ths->ts", iw, torch.relu(torch.einsum("thd,sd->ths", iq, ik) * INDEX_SCALE))
    log_q = torch.log_softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    kl = torch.where(allowed & (p > 0), p * (torch.log(p.clamp(min=1e-300)) - log_q), torch.zeros_like(p)).sum(-1)
    weights = torch.linspace(0.5, 1.5, kl.shape[0], dtype=torch.float64)  # a non-uniform upstream gradient
    grads = torch.autograd.grad((kl * weights).sum(), (iq, ik, iw))
    return kl.detach(), grads


def run(fn, t: dict) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    leaves = {k: v.clone().requires_grad_(k in ("iq", "ik", "iw")) for k, v in t.items()}
    kl = fn(leaves)
    weights = torch.linspace(0.5, 1.5, kl.shape[0])
    (kl * weights).sum().backward()
    return kl.detach(), tuple(leaves[k].grad for k in ("iq", "ik", "iw"))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def assert_close(got, want, bound: float = 1e-5):
    (kl, grads), (kl_ref, grads_ref) = got, want
    assert rel(kl, kl_ref) < bound, rel(kl, kl_ref)
    for name, g, r in zip(("iq", "ik", "iw"), grads, grads_ref):
        assert rel(g, r) < bound, (name, rel(g, r))


def test_dense_kl_over_every_causal_key_matches_the_float64_truth_with_packed_documents(monkeypatch):
    """Warm-up form; a small chunk size makes the reference split rows and key windows."""
    monkeypatch.setattr("lowerings.ops.indexer_kl_reference.CHUNK_BYTES", 2048)
    seg = packed_seg_start([7, 12, 1, 10])
    t = inputs(seg.shape[0], seed=0)
    mask = document_mask(seg)
    lse = ops.attention_lse(t["q"], t["kv"], seg, scale=SCALE)
    logits = torch.einsum("thd,sd->ths", t["q"].double(), t["kv"].double()) * SCALE
    assert rel(lse, torch.logsumexp(logits.masked_fill(~mask.unsqueeze(1), float("-inf")), -1)) < 1e-6
    got = run(lambda v: ops.dense_indexer_kl(v["iq"], v["ik"], v["iw"], v["q"], v["kv"], lse, seg,
                                             index_scale=INDEX_SCALE, scale=SCALE), t)
    assert_close(got, truth(t, mask))


def test_sparse_kl_over_the_selected_keys_matches_the_float64_truth_with_packed_documents():
    """Sparse-stage form: the selection is the indexer's own top-k (documents longer than k), the LSE the sparse
    attention's over the same keys, -1 slots in short documents."""
    seg = packed_seg_start([9, 14, 3])
    T, k = seg.shape[0], 5
    t = inputs(T, seed=1)
    idx = indexer_topk_reference(t["iq"], t["ik"], t["iw"], seg, k, INDEX_SCALE)
    assert (idx < 0).any() and (idx >= 0).sum(-1).max() == k
    allowed = torch.zeros(T, T + 1, dtype=torch.bool).scatter_(1, torch.where(idx >= 0, idx.long(), T), True)[:, :T]
    latent = torch.cat([t["kv"], torch.zeros(T, 0)], dim=-1)
    _, lse = ops.sparse_mla(t["q"], latent, idx, scale=SCALE, d_v=D)
    got = run(lambda v: ops.sparse_indexer_kl(v["iq"], v["ik"], v["iw"], v["q"], v["kv"], lse, idx,
                                              index_scale=INDEX_SCALE, scale=SCALE), t)
    assert_close(got, truth(t, allowed))


def _selection(T: int, k: int, t: dict, seg: torch.Tensor):
    idx = indexer_topk_reference(t["iq"], t["ik"], t["iw"], seg, k, INDEX_SCALE)
    allowed = torch.zeros(T, T + 1, dtype=torch.bool).scatter_(1, torch.where(idx >= 0, idx.long(), T), True)[:, :T]
    return idx, allowed


def test_sparse_attention_carrying_the_kl_gradient_matches_the_float64_truth_and_sparse_mla():
    """``sparse_mla_distilled``: out, lse and the q / kv gradients are sparse_mla's; the indexer's gradients are
    those of sum_t weight_t KL_t (the float64 truth, non-uniform weights), with no KL term in the loss."""
    seg = packed_seg_start([9, 14, 3])
    T, k = seg.shape[0], 5
    t = inputs(T, seed=5)
    idx, allowed = _selection(T, k, t, seg)
    assert (idx < 0).any() and (idx >= 0).sum(-1).max() == k
    dout = torch.randn(T, H, D, generator=torch.Generator().manual_seed(6))
    weights = torch.linspace(0.5, 1.5, T)
    leaves = {n: v.clone().requires_grad_() for n, v in t.items()}
    scores = ops.indexer_scores_at(leaves["iq"], leaves["ik"], leaves["iw"], idx, index_scale=INDEX_SCALE)
    out, lse = ops.sparse_mla_distilled(leaves["q"], leaves["kv"], idx, scores, weights, scale=SCALE, d_v=D)
    (out * dout).sum().backward()
    plain = {n: t[n].clone().requires_grad_() for n in ("q", "kv")}
    out_ref, lse_ref = ops.sparse_mla(plain["q"], plain["kv"], idx, scale=SCALE, d_v=D)
    (out_ref * dout).sum().backward()
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)
    for n in ("q", "kv"):
        assert rel(leaves[n].grad, plain[n].grad) < 1e-6, n
    kl_ref, grads_ref = truth(t, allowed)
    for name, r in zip(("iq", "ik", "iw"), grads_ref):
        assert rel(leaves[name].grad, r) < 1e-5, name
    kl = ops.sparse_kl_from_scores(t["q"], t["kv"], lse, idx, scores, scale=SCALE)
    assert rel(kl, kl_ref) < 1e-5


def test_closed_form_score_gradient_is_the_row_kl_autograd_with_empty_rows_and_zero_mass():
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(6, 9, generator=g, dtype=torch.float64)
    valid = torch.rand(6, 9, generator=g) < 0.7
    valid[1] = False  # no valid column
    p = torch.rand(6, 9, generator=g, dtype=torch.float64) * valid
    p[2] = 0.0  # no target mass
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-300)
    s = scores.masked_fill(~valid, float("-inf")).requires_grad_()
    row_kl(p, s, valid).sum().backward()
    want = torch.nan_to_num(s.grad, nan=0.0)
    got = row_kl_score_grad(p, s.detach(), valid)
    assert torch.isfinite(got).all() and (got[1] == 0).all() and (got[2] == 0).all()
    assert rel(got, want) < 1e-12


def test_selected_mass_is_the_head_mean_of_the_probability_inside_the_subset():
    seg = packed_seg_start([16])
    t = inputs(16, seed=2)
    idx = indexer_topk_reference(t["iq"], t["ik"], t["iw"], seg, 4, INDEX_SCALE)
    _, lse_sel = ops.sparse_mla(t["q"], t["kv"], idx, scale=SCALE, d_v=D)
    lse_all = ops.attention_lse(t["q"], t["kv"], seg, scale=SCALE)
    probs = torch.softmax((torch.einsum("thd,sd->hts", t["q"], t["kv"]) * SCALE).masked_fill(
        ~document_mask(seg), float("-inf")), -1)
    inside = torch.zeros(16, 17, dtype=torch.bool).scatter_(1, torch.where(idx >= 0, idx.long(), 16), True)[:, :16]
    expected = (probs * inside).sum(-1).mean(0)
    assert rel(ops.selected_mass(lse_sel, lse_all), expected) < 1e-5


# sparse_mla_backward_with_target runs inside sparse_mla_distilled's backward (its AOT-dispatch check); on CPU it
# is a torch.func.vjp of the reference, which opcheck's own wrappers cannot enter
@pytest.mark.parametrize("op", ["sparse_target", "scores_at", "attention_lse", "dense_kl", "sparse_mla_distilled"])
def test_op_schema_fake_and_autograd_registrations(op):
    seg = packed_seg_start([5, 7])
    t = inputs(12, seed=3)
    idx = indexer_topk_reference(t["iq"], t["ik"], t["iw"], seg, 4, INDEX_SCALE)
    lse = ops.attention_lse(t["q"], t["kv"], seg, scale=SCALE)
    grad = lambda x: x.clone().requires_grad_()
    cases = {
        "sparse_target": (sparse_target_op, (t["q"], t["kv"], lse, idx, SCALE)),
        "scores_at": (scores_at_op, (grad(t["iq"]), grad(t["ik"]), grad(t["iw"]), idx, INDEX_SCALE)),
        "attention_lse": (attention_lse_op, (t["q"], t["kv"], seg, SCALE, 0)),
        "dense_kl": (dense_kl_op, (grad(t["iq"]), grad(t["ik"]), grad(t["iw"]), t["q"], t["kv"], lse, seg, 0,
                                   INDEX_SCALE, SCALE)),
    }
    if op.startswith("sparse_mla"):
        scores = scores_at_op(t["iq"], t["ik"], t["iw"], idx, INDEX_SCALE)
        cases["sparse_mla_distilled"] = (sparse_mla_distilled_op, (grad(t["q"]), grad(t["kv"]), idx, grad(scores),
                                                                   torch.rand(12), SCALE, D))

    fn, args = cases[op]
    torch.library.opcheck(fn, args)


def test_bad_shapes_are_rejected_naming_what_was_expected():
    t = inputs(8, seed=4)
    seg = packed_seg_start([8])
    with pytest.raises(ValueError, match=r"expects q \[T,H,D\], kv \[Tk,D\]"):
        ops.attention_lse(t["q"], t["kv"][:, :5], seg, scale=SCALE)
    with pytest.raises(ValueError, match=r"int32 idx"):
        ops.sparse_indexer_kl(t["iq"], t["ik"], t["iw"], t["q"], t["kv"], torch.zeros(8, H),
                              torch.zeros(8, 2, dtype=torch.int64), index_scale=INDEX_SCALE, scale=SCALE)
