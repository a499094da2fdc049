"""AttnRes: the mix op and the layer recurrence against references written from spec §6."""

import pytest
import torch

from lowerings import ops
from titan_kimi.models.kimi_k3 import KimiK3Model, model_args_for
from titan_kimi.models.kimi_k3.sequence import build_sequence_info


def reference_mix(values, g, w, eps):
    """z_i = sum_c w_c g_c v_i[c] / rms(v_i); softmax over i; weighted sum (float64)."""
    z = torch.stack([(v * g * w).sum(-1) / torch.sqrt(v.pow(2).mean(-1) + eps) for v in values], dim=-1)
    alpha = torch.softmax(z, dim=-1)
    return sum(alpha[..., i : i + 1] * v for i, v in enumerate(values))


# fp32 and bf16 inputs (the op computes in fp32 and rounds to the inputs' dtype), a bank of 3 and an empty one;
# on CPU the backward is the reference's closed form (lowerings/ops/attn_res_mix.py)
@pytest.mark.parametrize("m,dtype,tol", [(3, torch.float32, 1e-5), (3, torch.bfloat16, 1e-2),
                                         (0, torch.float32, 1e-5)])
def test_mix_op_matches_reference_forward_and_backward(m, dtype, tol):
    N, H = 6, 16
    torch.manual_seed(m)
    bank = (torch.randn(N, m, H) * 2).to(dtype).requires_grad_()
    partial = torch.randn(N, H).to(dtype).requires_grad_()
    g = (1 + 0.3 * torch.randn(H)).to(dtype).requires_grad_()
    w = torch.randn(H).to(dtype).requires_grad_()
    out = ops.attn_res_mix(bank, partial, g, w, 1e-5)
    leaves = [t.detach().double().requires_grad_() for t in (bank, partial, g, w)]
    ref = reference_mix([leaves[0][:, i] for i in range(m)] + [leaves[1]], leaves[2], leaves[3], 1e-5)
    assert out.dtype == dtype and rel_err(out, ref) < (1e-6 if dtype == torch.float32 else tol)
    cot = torch.randn(out.shape).to(dtype)
    grads = torch.autograd.grad(out, [bank, partial, g, w], cot)
    ref_grads = torch.autograd.grad(ref, leaves, cot.double(), allow_unused=True)
    for a, b, x in zip(grads, ref_grads, (bank, partial, g, w)):
        assert a.shape == x.shape and a.dtype == dtype
        if b is not None and b.norm() == 0:  # one value (m = 0): the softmax is 1, g and w get exactly none
            assert not a.any()
        elif a.numel():
            assert rel_err(a, b) < tol


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_model_follows_the_layer_recurrence():
    """Re-run spec §6.3 by hand with the model's own sub-modules: bank = [e, s_0, ...], p = partial sum."""
    torch.manual_seed(0)
    args = model_args_for("k3_debug")
    model = KimiK3Model(args)
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj_weight" in name:
                p.normal_(0, 1.0)  # make the mixes far from uniform
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    seq = build_sequence_info(2, 16, tokens.device)

    def mix(module, values):
        vals = [v.double() for v in values]
        return reference_mix(vals, module.norm_weight.double(), module.proj_weight.double().view(-1), module.eps).float()

    p = model.tok_embeddings(tokens)
    R = []
    for layer_id, layer in model.layers.items():
        x = mix(layer.attention_mix, R + [p]) if R else p
        if int(layer_id) % args.attn_res_block_size == 0:
            R, p = R + [p], torch.zeros_like(p)
        p = p + layer.attention(layer.attention_norm(x), seq)
        m_in = mix(layer.ffn_mix, R + [p])
        p = p + layer._mlp(layer.ffn_norm(m_in), seq)
    assert len(R) == args.num_attn_res_blocks
    expected = model.output(model.norm(mix(model.output_mix, R + [p])))
    out = model(tokens)
    assert rel_err(out, expected) < 1e-5
