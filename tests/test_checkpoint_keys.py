"""The key plans (model FQN <-> HF keys) and the config.json mapping, both ways."""

from __future__ import annotations

import pytest
import torch

from titan_kimi.checkpoint import hf_config, hf_text_config, model_args_from_hf, plan_key
from titan_kimi.models.kimi_k3 import KimiK3Model, flavor_names, model_args_for
from titan_kimi.models.kimi_k3.state_dict_adapter import hf_key_names

M = "language_model.model."


def keys_of(fqn, shape):
    return [(p.source.key, p.source.shape, p.offset) for p in plan_key(fqn, shape).pieces]


def test_renames_from_the_spec():
    assert keys_of("tok_embeddings.weight", (10, 4)) == [(M + "embed_tokens.weight", (10, 4), (0, 0))]
    assert keys_of("output.weight", (10, 4)) == [("language_model.lm_head.weight", (10, 4), (0, 0))]
    assert keys_of("output_mix.proj_weight", (1, 4))[0][0] == M + "output_attn_res_proj.weight"
    assert keys_of("layers.3.ffn_mix.norm_weight", (4,))[0][0] == M + "layers.3.mlp_res_norm.weight"
    assert keys_of("layers.3.attention_mix.proj_weight", (1, 4))[0][0] == M + "layers.3.self_attention_res_proj.weight"
    indexer_norm = keys_of("layers.2.attention.indexer.k_norm.bias", (16,))[0][0]
    assert indexer_norm == M + "layers.2.self_attn.indexer.k_norm.bias"
    assert keys_of("layers.5.moe.router.e_score_correction_bias", (8,))[0][0] == (
        M + "layers.5.block_sparse_moe.gate.e_score_correction_bias")
    a_log = plan_key("layers.0.attention.decay.A_log", (96,)).pieces[0].source
    assert (a_log.key, a_log.shape, a_log.padded) == (M + "layers.0.self_attn.A_log", (96,), True)
    assert keys_of("layers.0.attention.decay.dt_bias", (64,))[0][0] == M + "layers.0.self_attn.dt_bias"
    assert keys_of("vision_tower.encoder.blocks.0.wqkv.weight", (6, 2)) == [
        ("vision_tower.encoder.blocks.0.wqkv.weight", (6, 2), (0, 0))]


def test_fused_and_stacked_tensors():
    assert keys_of("layers.0.feed_forward.gate_up_proj.weight", (6, 4)) == [
        (M + "layers.0.mlp.gate_proj.weight", (3, 4), (0, 0)), (M + "layers.0.mlp.up_proj.weight", (3, 4), (3, 0))]
    assert [k for k, _, _ in keys_of("layers.1.moe.shared_experts.gate_up_proj.weight", (6, 4))] == [
        M + "layers.1.block_sparse_moe.shared_experts.gate_proj.weight",
        M + "layers.1.block_sparse_moe.shared_experts.up_proj.weight"]
    w13 = plan_key("layers.1.moe.experts.w13", (2, 6, 64)).pieces
    assert [(p.source.key, p.source.shape, p.offset) for p in w13] == [
        (M + "layers.1.block_sparse_moe.experts.0.w1.weight", (3, 64), (0, 0, 0)),
        (M + "layers.1.block_sparse_moe.experts.0.w3.weight", (3, 64), (0, 3, 0)),
        (M + "layers.1.block_sparse_moe.experts.1.w1.weight", (3, 64), (1, 0, 0)),
        (M + "layers.1.block_sparse_moe.experts.1.w3.weight", (3, 64), (1, 3, 0))]
    assert w13[0].box_shape == (1, 3, 64) and w13[0].source.expert
    assert w13[0].source.packed_key == M + "layers.1.block_sparse_moe.experts.0.w1.weight_packed"
    w2 = plan_key("layers.1.moe.experts.w2", (2, 64, 32)).pieces
    assert [(p.source.key, p.offset) for p in w2] == [
        (M + "layers.1.block_sparse_moe.experts.0.w2.weight", (0, 0, 0)),
        (M + "layers.1.block_sparse_moe.experts.1.w2.weight", (1, 0, 0))]


def test_unknown_keys_are_rejected():
    with pytest.raises(ValueError, match="'lora_a.weight' has no Hugging Face counterpart"):
        plan_key("lora_a.weight", (2, 2))
    with pytest.raises(ValueError, match="'layers.0.moe.lora.weight' has no Hugging Face counterpart"):
        plan_key("layers.0.moe.lora.weight", (2, 2))
    with pytest.raises(ValueError, match="needs an even number"):
        plan_key("layers.0.feed_forward.gate_up_proj.weight", (5, 2))


@pytest.mark.parametrize("flavor", ["k3_debug", "k31_debug", "k31"])
def test_every_model_key_has_a_plan_whose_pieces_tile_it(flavor):
    with torch.device("meta"):
        model = KimiK3Model(model_args_for(flavor))
    for fqn, tensor in model.state_dict().items():
        plan = plan_key(fqn, tensor.shape)
        covered = sum(torch.Size(p.box_shape).numel() for p in plan.pieces)
        assert covered == tensor.numel(), fqn  # pieces never overlap (boxes are disjoint by construction)
    names = hf_key_names({k: v.shape for k, v in model.state_dict().items()})
    last, expert = model.args.n_layers - 1, model.args.num_experts - 1
    forms = ("weight", "weight_packed", "weight_scale")
    assert {f"{M}layers.{last}.block_sparse_moe.experts.{expert}.w2.{s}" for s in forms} <= names


@pytest.mark.parametrize("flavor", flavor_names())
def test_config_round_trips(flavor):
    args = model_args_for(flavor)
    assert model_args_from_hf(hf_config(args)) == args  # composite
    assert model_args_from_hf(hf_text_config(args)) == args  # bare text config


def test_config_round_trips_non_default_fields():
    args = model_args_for(
        "k3_debug", q_lora_rank=0, moe_latent_dim=0, attn_res_block_size=0, kda_full_rank_gate=False,
        kda_gate_lower_bound=None, num_shared_experts=0, route_scale=2.5, num_expert_groups=2, topk_groups=1,
        router_score_func="softmax", kda_layers=(1, 2, 5, 6), full_attn_layers=(3, 4, 7, 8),
    )
    text = hf_text_config(args)
    assert text["q_lora_rank"] is None and text["routed_expert_hidden_size"] is None
    assert text["linear_attn_config"]["full_attn_layers"] == [3, 4, 7, 8]
    assert model_args_from_hf(text) == args


def test_config_fields_of_the_spec():
    text = hf_text_config(model_args_for("k31"))
    assert text["hidden_size"] == 7168 and text["num_experts"] == 896 and text["routed_expert_hidden_size"] == 3584
    assert text["attn_res_block_size"] == 12 and text["linear_attn_config"]["num_heads"] == 96
    assert (text["index_n_heads"], text["index_head_dim"], text["index_topk"]) == (64, 128, 2048)
    assert "index_n_heads" not in hf_text_config(model_args_for("k3"))
