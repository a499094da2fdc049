"""Whole-model properties: packing without leakage, padding, pipeline cuts, dtypes, finiteness."""

import pytest
import torch

from titan_kimi.models.kimi_k3 import KimiK3Model, model_args_for
from titan_kimi.models.kimi_k3.init import cast_model_dtype, fp32_parameter_names


def build(flavor="k31_debug", seed=0, **overrides):
    torch.manual_seed(seed)
    model = KimiK3Model(model_args_for(flavor, **overrides))
    model.init_weights()
    return model


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("flavor", ["k3_debug", "k31_debug"])
def test_packed_documents_equal_separate_runs(flavor):
    model = build(flavor, index_topk=8)  # topk < document lengths: DSA selection is exercised too
    lengths = [13, 30, 21]
    docs = [torch.randint(1, 2048, (n,)) for n in lengths]
    packed = torch.cat(docs).unsqueeze(0)
    doc_ids = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)]).unsqueeze(0)
    logits = model(packed, doc_ids=doc_ids)
    start = 0
    for d in docs:
        alone = model(d.unsqueeze(0))
        assert rel_err(logits[:, start : start + len(d)], alone) < 1e-5
        start += len(d)


def test_padding_never_influences_real_tokens():
    model = build()
    tokens = torch.randint(1, 2048, (2, 24))
    doc_ids = torch.ones(2, 24, dtype=torch.int32)
    doc_ids[0, 17:] = 0  # right padding
    other = tokens.clone()
    other[0, 17:] = torch.randint(1, 2048, (7,))  # different pad contents
    a, b = model(tokens, doc_ids=doc_ids), model(other, doc_ids=doc_ids)
    # Equal up to GEMM blocking: pad tokens still route to experts and change the group sizes (1.05e-6 on some
    # CPUs; a pad token that leaked into a real one would show orders of magnitude more).
    assert rel_err(a[0, :17], b[0, :17]) < 1e-5 and rel_err(a[1], b[1]) < 1e-5
    assert rel_err(a[0, :17], model(tokens[:1, :17])[0]) < 1e-5


@pytest.mark.parametrize("cuts", [[4], [4, 6]])
def test_pipeline_stages_reproduce_full_model_bit_exactly(cuts):
    """Stages of whole AttnRes blocks (block size 2 -> 4 blocks) give identical logits and gradients."""
    full = build("k31_debug", attn_res_block_size=2, index_topk=8)
    bounds = [0, *cuts, full.args.n_layers]
    stages = [KimiK3Model(full.args, layer_range=(a, b)) for a, b in zip(bounds, bounds[1:])]
    for stage in stages:
        missing, unexpected = stage.load_state_dict(full.state_dict(), strict=False)
        assert not missing
    tokens = torch.randint(0, 2048, (2, 20))
    doc_ids = torch.tensor([[1] * 8 + [2] * 12, [1] * 15 + [0] * 5])
    expected = full(tokens, doc_ids=doc_ids)
    hidden, bank = stages[0](tokens, doc_ids=doc_ids)
    for stage in stages[1:-1]:
        hidden, bank = stage(hidden, bank, doc_ids=doc_ids)
    logits = stages[-1](hidden, bank, doc_ids=doc_ids)
    assert torch.equal(logits, expected)
    cot = torch.randn_like(expected)
    expected.backward(cot)
    logits.backward(cot)
    full_grads = {n: p.grad for n, p in full.named_parameters() if p.requires_grad}
    for stage in stages:
        for name, p in stage.named_parameters():
            if full_grads.get(name) is None:  # layer 0's attention mix sees an empty bank and is never used
                assert p.grad is None, name
            else:
                assert torch.equal(p.grad, full_grads[name]), name


def test_stage_boundaries_must_follow_blocks():
    args = model_args_for("k3_debug")
    with pytest.raises(ValueError, match="cuts an AttnRes block"):
        KimiK3Model(args, layer_range=(0, 3))
    # a benchmark's part of a stage's first layers (the rank slice's max_layers) may end inside a block
    part = KimiK3Model(args, layer_range=(0, 3), allow_block_cut=True)
    assert not part.is_last and part.output is None and list(part.layers) == ["0", "1", "2"]
    hidden, bank = part(torch.randint(0, args.vocab_size, (1, 8)))
    assert hidden.shape == (1, 8, args.dim) and bank.shape[-1] == args.dim
    with pytest.raises(ValueError, match="needs hidden and bank"):
        KimiK3Model(args, layer_range=(4, 8))(torch.zeros(1, 2, 128))


def test_debug_bf16_forward_backward_finite_and_fp32_params_kept():
    model = build("k31_debug")
    cast_model_dtype(model, torch.bfloat16)
    keep = fp32_parameter_names(model)
    assert any("A_log" in n for n in keep) and any("e_score_correction_bias" in n for n in keep)
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if name in keep else torch.bfloat16), name
    logits = model(torch.randint(0, 2048, (2, 64)))
    logits.float().logsumexp(-1).mean().backward()
    # Layer 0's attention mix is the only unused parameter: the bank is empty before the first block closes.
    trained = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("layers.0.attention_mix.")]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in trained)
    assert all(p.grad is None for n, p in model.named_parameters() if ".indexer." in n)


def test_plain_residual_without_attn_res_runs():
    model = build("k3_debug", attn_res_block_size=0)
    assert torch.isfinite(model(torch.randint(0, 2048, (1, 16)))).all()
