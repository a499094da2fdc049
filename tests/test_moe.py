"""LatentMoE against a per-token, per-expert loop written from spec §7.2-7.3; SiTU-GLU gradients."""

import torch

from lowerings import ops
from titan_kimi.models.kimi_k3 import model_args_for
from titan_kimi.models.kimi_k3.moe import LatentMoE


def situ_glu_formula(gate, up, beta=4.0, beta_lin=25.0):
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * beta_lin * torch.tanh(up / beta_lin)


def reference_moe(moe: LatentMoE, x: torch.Tensor, is_real: torch.Tensor | None = None) -> torch.Tensor:
    """``is_real [T]``: padding tokens skip the routed experts (spec §2.3)."""
    args_k = moe.top_k
    F = moe.experts.w2.shape[-1]
    rms = lambda t, norm: norm.weight * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + norm.eps)
    out = []
    for t, xt in enumerate(x.view(-1, x.shape[-1])):
        scores = torch.sigmoid(moe.router.gate.weight @ xt)
        chosen = (scores + moe.router.e_score_correction_bias).topk(args_k).indices
        weights = scores[chosen] / scores[chosen].sum()
        z = moe.routed_expert_down_proj.weight @ xt
        r = torch.zeros_like(z)
        for e, wt in zip(chosen.tolist() if is_real is None or is_real[t] else [], weights):
            h = moe.experts.w13[e] @ z
            r = r + wt * (moe.experts.w2[e] @ situ_glu_formula(h[:F], h[F:]))
        y = moe.routed_expert_up_proj.weight @ rms(r, moe.routed_expert_norm)
        shared = moe.shared_experts
        hs = shared.gate_up_proj.weight @ xt
        y = y + shared.down_proj.weight @ situ_glu_formula(hs[: shared.hidden], hs[shared.hidden :])
        out.append(y)
    return torch.stack(out).view_as(x)


def test_latent_moe_matches_per_token_loop():
    torch.manual_seed(0)
    moe = LatentMoE(model_args_for("k3_debug"))
    moe.init_weights()
    with torch.no_grad():
        moe.router.e_score_correction_bias.normal_(0, 0.5)  # the bias must change the choice, not the weights
        for p in moe.parameters():
            if p.dim() > 1:
                p.mul_(10)
    x = torch.randn(2, 7, 128)
    out = moe(x)
    ref = reference_moe(moe, x)
    assert rel_err(out, ref) < 1e-5
    cot = torch.randn_like(out)
    grads = torch.autograd.grad(out, [moe.experts.w13, moe.router.gate.weight], cot)
    ref_grads = torch.autograd.grad(ref, [moe.experts.w13, moe.router.gate.weight], cot)
    for a, b in zip(grads, ref_grads):
        assert rel_err(a, b) < 1e-5
    assert moe.router.e_score_correction_bias.grad is None


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_padding_tokens_skip_the_routed_experts():
    """Padding tokens are routed but no expert runs on them: their routed output is zero (the shared experts
    alone remain), the real tokens' outputs and every gradient through them are those of the unmasked layer,
    and the load counts real tokens only."""
    torch.manual_seed(3)
    moe = LatentMoE(model_args_for("k3_debug"))
    moe.init_weights()
    with torch.no_grad():
        for p in moe.parameters():
            if p.dim() > 1:
                p.mul_(10)
    x = torch.randn(2, 9, 128)
    is_real = torch.tensor([[True] * 6 + [False] * 3, [True] * 2 + [False] * 7]).view(-1)
    out = moe(x, is_real)
    ref = reference_moe(moe, x, is_real)
    assert rel_err(out, ref) < 1e-5
    unmasked = moe(x)
    real = is_real.view(2, 9)
    assert rel_err(out[real], unmasked[real]) < 1e-6
    cot = torch.randn_like(out) * real.unsqueeze(-1)  # the loss reads real tokens only
    params = [moe.experts.w13, moe.experts.w2, moe.router.gate.weight, moe.routed_expert_down_proj.weight]
    grads = torch.autograd.grad(out, params, cot)
    for a, b in zip(grads, torch.autograd.grad(ref, params, cot)):
        assert rel_err(a, b) < 1e-5
    for a, b in zip(grads, torch.autograd.grad(unmasked, params, cot)):
        assert rel_err(a, b) < 1e-5
    moe.tokens_per_expert.zero_()
    moe(x, is_real)
    assert moe.tokens_per_expert.sum().item() == int(is_real.sum()) * moe.top_k


def test_situ_glu_gradient_matches_autograd_of_the_formula():
    gate_up = (torch.randn(5, 2 * 24) * 8).requires_grad_()  # reach the tanh saturation
    exact = gate_up.detach().double().requires_grad_()
    cot = torch.randn(5, 24)
    (ours,) = torch.autograd.grad(ops.situ_glu(gate_up), gate_up, cot)
    (ref,) = torch.autograd.grad(situ_glu_formula(*exact.chunk(2, dim=-1)), exact, cot.double())
    assert rel_err(ours, ref) < 1e-6
    assert rel_err(ops.situ_glu(gate_up), situ_glu_formula(*exact.chunk(2, dim=-1))) < 1e-6


def test_cuda_row_alignment_padding_changes_nothing():
    """The padded copy that CUDA grouped GEMMs get (each expert's rows 8-aligned) gives the same output and
    gradients as the unpadded rows, with empty and uneven experts."""
    from titan_kimi.models.kimi_k3.moe import _aligned_for_grouped_mm

    torch.manual_seed(1)
    moe = LatentMoE(model_args_for("k3_debug"))
    moe.init_weights()
    experts = moe.experts
    counts = torch.tensor([3, 0, 9, 1, 0, 0, 17, 2] + [0] * (experts.num_experts - 8))
    x = torch.randn(int(counts.sum()), experts.w13.shape[-1], requires_grad=True)
    cot = torch.randn(x.shape[0], experts.w2.shape[1])
    ref = experts.run(experts.w13, experts.w2, x, counts)
    out = _aligned_for_grouped_mm(experts.run, experts.w13, experts.w2, x, counts)
    assert rel_err(out, ref) < 1e-6
    g_ref = torch.autograd.grad(ref, [x, experts.w13], cot)
    g_out = torch.autograd.grad(out, [x, experts.w13], cot)
    for a, b in zip(g_out, g_ref):
        assert rel_err(a, b) < 1e-6


def test_cuda_row_alignment_leaves_unrouted_rows_zero():
    """Rows past the counts' sum (padding tokens' choices) get zero output and no gradient; the routed rows
    are the experts' output on them alone."""
    from titan_kimi.models.kimi_k3.moe import _aligned_for_grouped_mm

    torch.manual_seed(4)
    moe = LatentMoE(model_args_for("k3_debug"))
    moe.init_weights()
    experts = moe.experts
    counts = torch.tensor([3, 0, 9, 1, 0, 0, 17, 2] + [0] * (experts.num_experts - 8))
    routed = int(counts.sum())
    x = torch.randn(routed + 11, experts.w13.shape[-1], requires_grad=True)
    cot = torch.randn(x.shape[0], experts.w2.shape[1])
    out = _aligned_for_grouped_mm(experts.run, experts.w13, experts.w2, x, counts)
    assert out[routed:].abs().max() == 0
    ref = experts.run(experts.w13, experts.w2, x[:routed], counts)
    assert rel_err(out[:routed], ref) < 1e-6
    g_out = torch.autograd.grad(out, [x, experts.w13], cot)
    g_ref = torch.autograd.grad(ref, [x, experts.w13], cot[:routed])
    assert g_out[0][routed:].abs().max() == 0
    assert rel_err(g_out[0], g_ref[0]) < 1e-6
    assert rel_err(g_out[1], g_ref[1]) < 1e-6
    # the CPU path (no alignment) keeps the same contract
    assert rel_err(experts(x, counts), out) < 1e-6


def test_router_load_is_counted_per_expert():
    torch.manual_seed(2)
    moe = LatentMoE(model_args_for("k3_debug"))
    moe.init_weights()
    moe(torch.randn(2, 5, 128))
    moe(torch.randn(1, 3, 128))
    assert moe.tokens_per_expert.sum().item() == (2 * 5 + 3) * moe.top_k
    assert "tokens_per_expert" not in moe.state_dict()


def test_row_alignment_keeps_only_indices_for_backward():
    """The padded copy must not keep its source alive until backward (index_copy would: +1 copy of the
    experts' input per MoE layer, 1.4 GiB on k31_small)."""
    from torch.autograd.graph import saved_tensors_hooks

    from titan_kimi.models.kimi_k3.moe import _aligned_for_grouped_mm

    counts = torch.tensor([3, 0, 9, 1])
    x = torch.randn(13, 64, requires_grad=True)
    saved = []

    def run(w13, w2, buffer, padded):
        return buffer * 2.0  # stands in for the grouped GEMMs, which save their own inputs

    with saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _aligned_for_grouped_mm(run, None, None, x, counts)
    assert not any(t.is_floating_point() for t in saved), [(t.dtype, tuple(t.shape)) for t in saved]


def test_compiled_experts_under_autocast_use_grouped_gemm(monkeypatch):
    """fp32 rows under bf16 autocast (fp32 master weights, one process) go to the grouped GEMM in bf16 as
    autocast would, never to _masked_mm (every expert times every row) in the compiled step."""
    from lowerings.ops import expert_gemm
    from titan_kimi.models.kimi_k3 import moe

    def masked(*args):
        raise AssertionError("the compiled experts fell back to _masked_mm")

    monkeypatch.setattr(expert_gemm, "_masked_mm", masked)
    torch.manual_seed(0)
    experts = moe.GroupedExperts(4, 16, 16, 4.0, 25.0, 0.02)
    experts.init_weights()
    x, counts = torch.randn(32, 16), torch.tensor([8, 4, 12, 8])
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(experts.run, fullgraph=True)(experts.w13, experts.w2, x, counts)
    ref = experts.run(experts.w13.bfloat16(), experts.w2.bfloat16(), x.bfloat16(), counts)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
