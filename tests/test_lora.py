"""LoRA: adapters, targets, freezing (the indexer above all), PEFT save/load, merge and HF export."""

import copy
import json

import pytest
import torch

from titan_kimi.checkpoint import export_hf_checkpoint, load_hf_checkpoint
from titan_kimi.lora import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    LoRAGroupedExperts,
    LoRASettings,
    apply_lora,
    load_adapters,
    merge_adapters_,
    merged_tensors,
    reset_adapters,
    save_adapters,
    select_targets,
)
from titan_kimi.models.kimi_k3 import KimiK3Model, model_args_for
from titan_kimi.models.kimi_k3.moe import GroupedExperts
from titan_kimi.training.loss import LinearCrossEntropyLoss

EVERYTHING = ("attention", "mlp", "shared_experts", "experts", "latent_proj", "router", "lm_head")


def base_model(seed=0, **overrides):
    torch.manual_seed(seed)
    model = KimiK3Model(model_args_for("k31_debug", index_topk=8, **overrides))
    model.init_weights()
    return model


def lora_model(targets=EVERYTHING, seed=0, rank=8, randomize=True, **overrides):
    model = base_model(seed, **overrides)
    apply_lora(model, LoRASettings(rank, 16.0, 0.0, tuple(targets)))
    reset_adapters(model)
    if randomize:  # B = 0 makes an adapter a no-op; give every factor values so every path shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.05)
    return model


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


TOKENS = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(5))
DOCS = torch.tensor([[1] * 10 + [2] * 14, [1] * 20 + [0] * 4])


def test_fresh_adapters_change_nothing():
    base = base_model()
    model = copy.deepcopy(base)
    apply_lora(model, LoRASettings(8, 16.0, 0.0, EVERYTHING))
    reset_adapters(model)
    assert torch.equal(model(TOKENS, doc_ids=DOCS), base(TOKENS, doc_ids=DOCS))


def test_no_layer_bypasses_its_adapter():
    """Every adapted weight, including those layers read directly (DSA's absorbed kv_b_proj, the router gate,
    the lm_head inside the chunked loss), computes with the adapter: the LoRA model equals its merge."""
    model = lora_model()
    merged = merge_adapters_(copy.deepcopy(model))
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    out, ref = model(TOKENS, doc_ids=DOCS), merged(TOKENS, doc_ids=DOCS)
    assert (out - base_model()(TOKENS, doc_ids=DOCS)).abs().max() > 1e-2  # the adapters matter
    assert rel_err(out, ref) < 1e-5
    labels = TOKENS.roll(-1, 1)
    loss = LinearCrossEntropyLoss(8)
    for m in (model, merged):  # the head's loss path reads the weight through the adapter too
        m.loss = loss(m.output, m(TOKENS, doc_ids=DOCS, return_hidden=True), labels, labels.numel())
    assert torch.allclose(model.loss, merged.loss, rtol=1e-5)


@pytest.mark.parametrize("target", ["layers.3.attention.kv_b_proj", "layers.1.moe.router.gate", "output"])
def test_directly_read_weights_see_a_single_adapter(target):
    plain = lora_model(targets=(target,))
    assert not torch.allclose(plain(TOKENS, doc_ids=DOCS), base_model()(TOKENS, doc_ids=DOCS), atol=1e-4)
    assert rel_err(plain(TOKENS, doc_ids=DOCS), merge_adapters_(copy.deepcopy(plain))(TOKENS, doc_ids=DOCS)) < 1e-5


def test_only_adapters_get_gradients_and_the_indexer_stays_frozen():
    model = lora_model()
    indexer = [n for n, _ in model.named_parameters() if ".indexer." in n]
    assert indexer
    hidden = model(TOKENS, doc_ids=DOCS, return_hidden=True)
    LinearCrossEntropyLoss(8)(model.output, hidden, TOKENS.roll(-1, 1), 48.0).backward()
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert not p.requires_grad and p.grad is None, name
    assert not any("indexer" in n and "lora" in n for n, _ in model.named_parameters())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt.step()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)


def test_grouped_expert_adapters_match_a_per_expert_reference():
    torch.manual_seed(1)
    experts = GroupedExperts(4, 16, 12, 4.0, 25.0, 0.02)
    experts.init_weights()
    from titan_kimi.lora import add_adapter

    add_adapter(experts, 8, 16.0, 0.0)
    assert isinstance(experts, LoRAGroupedExperts)
    with torch.no_grad():
        for p in (experts.lora_B_w13, experts.lora_B_w2):
            p.normal_(0, 0.1)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 16)
    out = experts(x, counts)
    rows, s = 0, 2.0
    for e, n in enumerate(counts.tolist()):
        xe = x[rows : rows + n]
        w13 = experts.w13[e] + s * experts.lora_B_w13[e] @ experts.lora_A_w13[e]
        w2 = experts.w2[e] + s * experts.lora_B_w2[e] @ experts.lora_A_w2[e]
        g, u = (xe @ w13.t()).chunk(2, -1)
        h = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
        assert torch.allclose(out[rows : rows + n], h @ w2.t(), atol=1e-5)
        rows += n


def test_target_selection_and_its_errors():
    model = base_model()
    assert select_targets(model, ["o_proj"]) == [f"layers.{i}.attention.o_proj" for i in range(8)]
    assert select_targets(model, ["layers.[01].attention.q_proj"]) == ["layers.0.attention.q_proj",
                                                                        "layers.1.attention.q_proj"]
    attention = select_targets(model, ["attention"])
    assert attention and not any("indexer" in n for n in attention)
    assert "layers.3.attention.kv_b_proj" in attention and "layers.0.attention.q_conv1d" not in attention
    with pytest.raises(ValueError, match="adapters never sit on the K3.1 indexer"):
        select_targets(model, ["wq_b"])
    with pytest.raises(ValueError, match="'vision_tower' matches no adaptable module"):
        select_targets(model, ["vision_tower"])
    with pytest.raises(ValueError, match="target_modules is empty"):
        select_targets(model, [])
    with pytest.raises(ValueError, match="multiple of 8"):
        apply_lora(model, LoRASettings(4, 8.0, 0.0, ("experts",)))


def test_saved_adapters_reload_by_name_and_merge_to_the_same_logits(tmp_path):
    trained = lora_model(seed=0)
    expected = trained(TOKENS, doc_ids=DOCS)
    save_adapters(trained, tmp_path / "adapters", targets=EVERYTHING)
    config = json.loads((tmp_path / "adapters" / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 16.0
    assert {"q_proj", "kv_b_proj", "gate_proj", "up_proj", "w1", "w2", "w3", "lm_head"} <= set(config["target_modules"])
    from safetensors import safe_open

    with safe_open(str(tmp_path / "adapters" / ADAPTER_FILE), framework="pt") as f:
        keys = set(f.keys())
        prefix = "base_model.model.language_model."
        assert prefix + "model.layers.3.self_attn.kv_b_proj.lora_A.weight" in keys
        assert prefix + "model.layers.0.mlp.gate_proj.lora_B.weight" in keys
        assert prefix + "model.layers.1.block_sparse_moe.experts.7.w3.lora_B.weight" in keys
        assert prefix + "model.layers.1.block_sparse_moe.shared_experts.up_proj.lora_A.weight" in keys
        assert prefix + "lm_head.lora_A.weight" in keys
        assert not any(".indexer." in k for k in keys)
        # gate/up (w1/w3) share the fused projection's A; each gets its rows of B.
        gate = f.get_tensor(prefix + "model.layers.0.mlp.gate_proj.lora_B.weight")
        assert torch.equal(gate, trained.layers["0"].feed_forward.gate_up_proj.lora_B.weight[: gate.shape[0]])
    fresh = lora_model(seed=0, randomize=False)  # same base weights, other adapters
    assert not torch.allclose(fresh(TOKENS, doc_ids=DOCS), expected, atol=1e-4)
    filled = load_adapters(fresh, tmp_path / "adapters")
    assert len(filled) == sum(1 for n, _ in fresh.named_parameters() if "lora_" in n)
    assert torch.equal(fresh(TOKENS, doc_ids=DOCS), expected)
    merged = merge_adapters_(fresh)
    assert rel_err(merged(TOKENS, doc_ids=DOCS), expected) < 1e-5


def test_loading_mismatched_adapters_is_rejected(tmp_path):
    model = lora_model(targets=("mlp",))
    save_adapters(model, tmp_path / "a")
    with pytest.raises(ValueError, match="do not match the model"):
        load_adapters(lora_model(targets=("mlp", "lm_head")), tmp_path / "a")
    with pytest.raises(ValueError, match="rank 8, but the model's adapters have rank 16"):
        load_adapters(lora_model(targets=("mlp",), rank=16), tmp_path / "a")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "a" / ADAPTER_FILE))
    key = "base_model.model.language_model.model.layers.0.mlp.up_proj.lora_A.weight"
    tensors[key] = tensors[key] + 1
    save_file(tensors, str(tmp_path / "a" / ADAPTER_FILE))
    with pytest.raises(ValueError, match="needs one shared A"):
        load_adapters(lora_model(targets=("mlp",)), tmp_path / "a")


def test_merge_and_export_writes_a_full_hf_checkpoint(tmp_path):
    model = lora_model()
    expected = model(TOKENS, doc_ids=DOCS)
    export_hf_checkpoint(model, tmp_path / "hf", dtype=torch.float32, tensors=merged_tensors(model))
    plain = base_model(seed=9)  # other weights: everything must come from the export
    report = load_hf_checkpoint(plain, tmp_path / "hf")
    assert not report.missing and not report.unexpected
    assert rel_err(plain(TOKENS, doc_ids=DOCS), expected) < 1e-5
