"""Model args: validation, HF config mapping, flavors and meta-device accounting."""

import pytest
import torch

from titan_kimi.models.kimi_k3 import KimiK3Model, KimiK3ModelArgs, count_params, model_args_for
from titan_kimi.models.kimi_k3.args import default_full_attn_layers
from titan_kimi.models.kimi_k3.state_dict_adapter import args_from_hf_config


def meta_counts(flavor):
    with torch.device("meta"):
        return count_params(KimiK3Model(model_args_for(flavor)))


def test_k3_counts_on_meta():
    counts = meta_counts("k3")
    assert counts.total == 2_779_484_476_000
    assert counts.active == 104_189_612_640


def test_k31_counts_on_meta():
    counts = meta_counts("k31")
    assert counts.total == 2_779_819_502_176
    assert counts.active == 104_524_638_816


def test_small_flavor_geometry():
    # design.md's 3,498,331,840 leaves out the 15 MoE layers' router bias (64 each), which we count as in §8.
    assert meta_counts("k3_small").total == 3_498_331_840 + 15 * 64


def test_k3_layer_pattern():
    args = model_args_for("k3")
    assert default_full_attn_layers(93)[-3:] == (88, 92, 93)
    mla = [l for l in range(93) if not args.is_kda_layer(l)]
    assert len(mla) == 24 and mla[:3] == [3, 7, 11] and mla[-2:] == [91, 92]
    assert [args.is_moe_layer(l) for l in (0, 1, 92)] == [False, True, True]
    assert args.num_attn_res_blocks == 8


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("dim", 0, "dim = 0"),
        ("kda_layers", (1, 2), "every 1-based layer"),
        ("full_attn_layers", (1, 4, 8), "both KDA and full attention"),
        ("kda_gate_lower_bound", -6.0, "kda_gate_lower_bound"),
        ("num_experts_per_tok", 999, "num_experts_per_tok"),
        ("router_score_func", "relu", "valid: 'sigmoid', 'softmax'"),
        ("index_rope", True, "NoPE"),
        ("num_expert_groups", 3, "must divide num_experts"),
        ("pad_token_id", 5000, "pad_token_id"),
        ("norm_eps", 0.0, "norm_eps"),
    ],
)
def test_bad_args_raise_naming_the_field(field, value, message):
    base = dict(model_args_for("k3_debug").__dict__)
    base[field] = value
    if field == "full_attn_layers":
        base["kda_layers"] = tuple(n for n in range(1, 9) if n not in (4, 8))
    with pytest.raises(ValueError, match=message):
        KimiK3ModelArgs(**base)


def test_unknown_flavor_lists_valid_ones():
    with pytest.raises(ValueError, match="k31_debug"):
        model_args_for("k4")


def hf_text_config():
    return {
        "model_type": "kimi_linear", "vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 5,
        "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 512, "rms_norm_eps": 1e-5,
        "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "num_experts": 16, "num_experts_per_token": 4, "num_shared_experts": 2, "moe_intermediate_size": 64,
        "routed_expert_hidden_size": 128, "first_k_dense_replace": 1, "moe_router_activation_func": "sigmoid",
        "attn_res_block_size": 2, "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "linear_attn_config": {"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4], "num_heads": 4, "head_dim": 32,
                               "short_conv_kernel_size": 4, "use_full_rank_gate": True, "gate_lower_bound": -5.0},
    }


def test_from_hf_config_composite_and_bare():
    bare = hf_text_config()
    composite = {"model_type": "kimi_k3", "text_config": bare, "vision_config": {}}
    a, b = args_from_hf_config(bare), args_from_hf_config(composite)
    assert a == b
    assert (a.dim, a.n_layers, a.n_heads, a.moe_latent_dim, a.kda_num_heads, a.attn_res_block_size) == (256, 5, 4, 128, 4, 2)
    assert a.full_attn_layers == (4,) and not a.is_kda_layer(3) and a.index_n_heads == 0
    k31 = args_from_hf_config({**bare, "index_n_heads": 8, "index_head_dim": 32, "index_topk": 64})
    assert k31.has_indexer and k31.index_topk == 64


@pytest.mark.parametrize(
    "change, message",
    [
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"num_nextn_predict_layers": 1}, "MTP"),
    ],
)
def test_from_hf_config_rejects_unsupported(change, message):
    with pytest.raises(ValueError, match=message):
        args_from_hf_config({**hf_text_config(), **change})


@pytest.mark.parametrize("config, message", [
    ({"hidden_size": "big"}, r"config\.json: hidden_size = 'big' must be an integer"),
    ({"rms_norm_eps": True}, r"rms_norm_eps = True must be a number"),
    ([1, 2], r"config\.json: must be a JSON object, got list"),
    ({"linear_attn_config": {"kda_layers": "1,2"}}, r"linear_attn_config\.kda_layers = '1,2' must be a list of integers"),
    ({"linear_attn_config": [1]}, r"linear_attn_config must be an object, got list"),
    ({"q_lora_rank": 1.5}, r"q_lora_rank = 1\.5 must be an integer or null"),
])
def test_a_malformed_config_json_names_the_file_and_the_field(tmp_path, config, message):
    import json

    from titan_kimi.checkpoint import model_args_from_hf

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"^{tmp_path}/config\.json: .*" + message.removeprefix(r"config\.json: ")):
        model_args_from_hf(tmp_path)
