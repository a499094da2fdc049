"""Gated MLA and DSA against references written here from the spec equations (§4.2, §16a)."""

import math

import torch

from titan_kimi.models.kimi_k3 import build_sequence_info, model_args_for
from titan_kimi.models.kimi_k3.mla import GatedMLA


def make_mla(indexer: bool, topk: int = 2048, seed: int = 0) -> GatedMLA:
    torch.manual_seed(seed)
    overrides = dict(index_n_heads=8, index_head_dim=16, index_topk=topk) if indexer else dict(index_n_heads=0)
    mla = GatedMLA(model_args_for("k31_debug", **overrides))
    mla.init_weights()
    with torch.no_grad():  # larger weights than the init so attention patterns are far from uniform
        for p in mla.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    return mla


def reference_mla(mla: GatedMLA, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Unabsorbed MLA in float64; ``allowed [B,S,S]`` says which keys each query may see."""
    x = x.double()
    W = lambda lin: lin.weight.double()
    rms = lambda t, norm: norm.weight.double() * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + norm.eps)
    B, S, _ = x.shape
    n, nope, rope, dv = mla.n_heads, mla.nope, mla.rope, mla.v_dim
    c_q = rms(x @ W(mla.q_a_proj).T, mla.q_a_layernorm)
    q = (c_q @ W(mla.q_b_proj).T).view(B, S, n, nope + rope)
    kv_a = x @ W(mla.kv_a_proj_with_mqa).T
    c_kv, k_r = kv_a[..., : mla.kv_lora_rank], kv_a[..., mla.kv_lora_rank :]
    kv = (rms(c_kv, mla.kv_a_layernorm) @ W(mla.kv_b_proj).T).view(B, S, n, nope + dv)
    k = torch.cat([kv[..., :nope], k_r.unsqueeze(2).expand(B, S, n, rope)], dim=-1)
    v = kv[..., nope:]
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(nope + rope)
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    out = torch.einsum("bhts,bshd->bthd", torch.softmax(scores, dim=-1), v).reshape(B, S, n * dv)
    out = out * torch.sigmoid(x @ W(mla.g_proj).T)
    return out @ W(mla.o_proj).T


def reference_indexer_scores(mla: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    """I(t,s) of spec §16a in float64 for one row, ``x [S, D]`` -> ``[S, S]`` (causal, -inf above)."""
    ind = mla.indexer
    x = x.double()
    rms = lambda t, norm: norm.weight.double() * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + norm.eps)
    c_q = rms(x @ mla.q_a_proj.weight.double().T, mla.q_a_layernorm)
    q = (c_q @ ind.wq_b.weight.double().T).view(-1, ind.n_heads, ind.head_dim)
    k = torch.nn.functional.layer_norm(
        x @ ind.wk.weight.double().T, (ind.head_dim,), ind.k_norm.weight.double(), ind.k_norm.bias.double(), ind.k_norm.eps
    )
    w = (x @ ind.weights_proj.weight.double().T) / math.sqrt(ind.n_heads)
    scores = torch.einsum("th,ths->ts", w, torch.relu(torch.einsum("thd,sd->ths", q, k) / math.sqrt(ind.head_dim)))
    S = x.shape[0]
    return scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))


def causal(B, S):
    return torch.ones(S, S, dtype=torch.bool).tril().expand(B, S, S)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_dense_mla_matches_reference():
    mla = make_mla(indexer=False)
    x = torch.randn(2, 24, 128)
    out = mla(x, build_sequence_info(2, 24, x.device))
    assert rel_err(out, reference_mla(mla, x, causal(2, 24))) < 1e-5


def test_dsa_with_few_tokens_equals_dense_mla():
    """<= index_topk valid tokens: every causal key is kept, so the absorbed sparse form equals dense MLA."""
    dense, sparse = make_mla(indexer=False, seed=1), make_mla(indexer=True, topk=32, seed=1)
    sparse.load_state_dict(dense.state_dict(), strict=False)
    x = torch.randn(2, 32, 128)
    seq = build_sequence_info(2, 32, x.device)
    assert rel_err(sparse(x, seq), dense(x, seq)) < 1e-5


def test_dsa_with_many_tokens_equals_dense_masked_reference():
    torch.manual_seed(3)
    mla = make_mla(indexer=True, topk=8, seed=2)
    B, S = 2, 40
    x = torch.randn(B, S, 128)
    out = mla(x, build_sequence_info(B, S, x.device))
    allowed = torch.zeros(B, S, S, dtype=torch.bool)
    idx = mla.indexer(x, mla.q_a_layernorm(mla.q_a_proj(x)), build_sequence_info(B, S, x.device))
    for b in range(B):
        for t in range(S):
            chosen = idx[b * S + t]
            allowed[b, t, chosen[chosen >= 0].long() - b * S] = True
    assert allowed.sum(-1).max() == 8 and not (allowed & ~causal(B, S)).any()
    assert rel_err(out, reference_mla(mla, x, allowed)) < 1e-5


def test_indexer_picks_reference_topk_set():
    mla = make_mla(indexer=True, topk=8, seed=4)
    S = 48
    x = torch.randn(1, S, 128)
    idx = mla.indexer(x, mla.q_a_layernorm(mla.q_a_proj(x)), build_sequence_info(1, S, x.device))
    scores = reference_indexer_scores(mla, x[0])
    for t in range(S):
        chosen = idx[t][idx[t] >= 0].long()
        assert len(chosen) == min(8, t + 1) and len(set(chosen.tolist())) == len(chosen)
        ref_top = scores[t].topk(min(8, t + 1)).values
        # Same multiset of scores: the reference set, up to ties.
        assert torch.allclose(scores[t, chosen].sort().values, ref_top.sort().values, rtol=1e-4, atol=1e-6)


def test_dsa_respects_document_boundaries():
    mla = make_mla(indexer=True, topk=4, seed=5)
    doc = torch.tensor([[1] * 10 + [2] * 14])
    seq = build_sequence_info(1, 24, torch.device("cpu"), doc)
    x = torch.randn(1, 24, 128)
    idx = mla.indexer(x, mla.q_a_layernorm(mla.q_a_proj(x)), seq)
    assert (idx[10:][idx[10:] >= 0] >= 10).all() and (idx[:10][idx[:10] >= 0] < 10).all()
    separate = mla(x[:, 10:], build_sequence_info(1, 14, x.device))
    assert rel_err(mla(x, seq)[:, 10:], separate) < 1e-5
