"""KDA: the chunked op against a token-by-token recurrence written here (forward and gradients)."""

import math

import pytest
import torch

from lowerings import ops


def recurrent_kda(q, k, v, u, beta, A_log, dt_bias, lower_bound, scale, starts=None):
    """Per-token gated delta rule in float64, straight from the spec (§3.2 steps 3, 5, 6)."""
    B, T, H, K = q.shape
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    a, x = A_log.exp().view(H, 1), u + dt_bias.view(H, K)
    g = lower_bound * torch.sigmoid(a * x) if lower_bound is not None else -a * torch.nn.functional.softplus(x)
    S = q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for t in range(T):
        if starts is not None and t in starts:
            S = torch.zeros_like(S)
        S = S * g[:, t].exp().unsqueeze(-1)
        delta = beta[:, t].unsqueeze(-1) * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, dim=1), S


def make_inputs(B, T, H, K, V, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    return dict(
        q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), u=r(B, T, H, K) * 2,
        beta=torch.rand(B, T, H, generator=gen),
        A_log=torch.empty(H).uniform_(1, 16, generator=gen).log(), dt_bias=r(H * K) * 0.3,
    )


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def grads_of(fn, inputs, names):
    leaves = {n: inputs[n].double().requires_grad_() for n in names}
    out = fn(**{**inputs, **leaves})
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    out.backward(cot)
    return out.detach(), {n: leaves[n].grad for n in names}


# packed "rows": the trainer's packing (a document starts every 32 tokens, at each row), which the CPU reference
# runs as 2 rows of 32 side by side (kda_reference._independent_row_length)
# lower_bound -5 takes the reference's factored scores (|log decay| over a chunk <= 40); -10 and the unbounded
# softplus gate (None) take its [C, C, K] decay tensor
@pytest.mark.parametrize("lower_bound", [-5.0, -10.0, None])
@pytest.mark.parametrize("packed", [False, True, "rows"])
def test_chunked_kda_matches_recurrence(packed, lower_bound):
    B, T, H, K, V = (1, 64, 3, 16, 8) if packed == "rows" else (1, 53, 3, 16, 8) if packed else (2, 37, 3, 16, 8)
    inputs = make_inputs(B, T, H, K, V, seed=1 if packed else 2)
    scale = 1 / math.sqrt(K)
    starts = [0, 9, 32, 50] if packed == "rows" else [0, 9, 10, 31] if packed else None
    if packed == "rows":
        from lowerings.ops.kda_reference import _independent_row_length

        assert _independent_row_length(torch.tensor(starts + [T]), T) == 32
    cu = torch.tensor(starts + [T], dtype=torch.int32) if packed else None
    names = ["q", "k", "v", "u", "beta", "A_log", "dt_bias"]

    def ours(q, k, v, u, beta, A_log, dt_bias):
        return ops.kda(q, k, v, u, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                       cu_seqlens=cu, l2norm_qk=True)[0]

    def reference(q, k, v, u, beta, A_log, dt_bias):
        return recurrent_kda(q, k, v, u, beta, A_log, dt_bias, lower_bound, scale, starts)[0]

    out, grads = grads_of(ours, inputs, names)
    ref, ref_grads = grads_of(reference, inputs, names)
    # The op computes in fp32 (like the kernels); the recurrence runs in float64.
    assert rel_err(out, ref) < 1e-5
    for n in names:
        # A_log's 3 gradients sum every token's gate term; under the unbounded gate (log decays up to ~100 per
        # token here) fp32 accumulation leaves 1e-5..7e-5 of cancellation in them (every factor there is <= 1)
        tolerance = 1e-4 if n == "A_log" and lower_bound is None else 1e-5
        assert rel_err(grads[n], ref_grads[n]) < tolerance, n


def test_kda_final_state_and_initial_state_per_sequence():
    B, T, H, K, V = 1, 30, 2, 8, 8
    x = make_inputs(B, T, H, K, V, seed=3)
    cu = torch.tensor([0, 12, 30], dtype=torch.int32)
    kw = dict(scale=0.3, A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-5.0, l2norm_qk=True)
    o, final = ops.kda(x["q"], x["k"], x["v"], x["u"], x["beta"], cu_seqlens=cu, output_final_state=True, **kw)
    assert final.shape == (2, H, K, V)
    # Running the second document with the first one's final state as initial state equals running both as one.
    cut = lambda t: t[:, 12:]
    o_first, f_first = ops.kda(*(t[:, :12] for t in (x["q"], x["k"], x["v"], x["u"], x["beta"])), output_final_state=True, **kw)
    o_joint, _ = ops.kda(x["q"], x["k"], x["v"], x["u"], x["beta"], **kw)
    o_cont, _ = ops.kda(*(cut(x[n]) for n in ("q", "k", "v", "u", "beta")), initial_state=f_first, **kw)
    assert torch.allclose(o_cont, o_joint[:, 12:], atol=1e-5)
    assert torch.allclose(o[:, :12], o_first, atol=1e-6)


def test_kda_op_registration_passes_opcheck():
    x = make_inputs(1, 20, 2, 8, 8, seed=4)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    args = (x["q"], x["k"], x["v"], x["u"], x["beta"], x["A_log"], x["dt_bias"], -5.0, 0.35, cu, None, True, True)
    args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    torch.library.opcheck(torch.ops.titan_kimi.kda.default, args)


def test_kda_rejects_bad_shapes():
    x = make_inputs(2, 8, 2, 8, 8, seed=5)
    with pytest.raises(ValueError, match="batch 1"):
        ops.kda(x["q"], x["k"], x["v"], x["u"], x["beta"], scale=1.0, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="shapes disagree"):
        ops.kda(x["q"], x["k"][:, :4], x["v"], x["u"], x["beta"], scale=1.0)
