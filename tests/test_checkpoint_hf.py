"""Loading and exporting the public HF checkpoint layout.

``hf_layout`` below restates spec §9.2 key by key, independently of the adapter, to build synthetic
checkpoints (random weights, MXFP4 experts, padded A_log, composite config with vision keys).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from titan_kimi.checkpoint import decode_mxfp4, encode_mxfp4, export_hf_checkpoint, hf_text_config, load_hf_checkpoint
from titan_kimi.models.kimi_k3 import KimiK3Model, build_sequence_info, model_args_for
from titan_kimi.models.kimi_k3.init import cast_model_dtype

M = "language_model.model."
KDA_KEYS = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
            "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight", "g_proj.weight", "o_norm.weight", "o_proj.weight"]
MLA_KEYS = ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
            "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight", "g_proj.weight"]
INDEXER_KEYS = ["indexer.wq_b.weight", "indexer.wk.weight", "indexer.k_norm.weight", "indexer.k_norm.bias",
                "indexer.weights_proj.weight"]
VISION = {
    "vision_tower.patch_embed.proj.weight": torch.randn(8, 3, 2, 2).bfloat16(),
    "vision_tower.encoder.final_layernorm.weight": torch.ones(8).bfloat16(),
    "mm_projector.proj.0.weight": torch.randn(16, 16).bfloat16(),
}


def build_model(flavor: str = "k31_debug", seed: int = 0, **overrides) -> KimiK3Model:
    """A bf16 model (fp32 where the model keeps fp32) whose fp32 values are bf16-representable, so that a bf16
    checkpoint holds them exactly."""
    torch.manual_seed(seed)
    model = KimiK3Model(model_args_for(flavor, **overrides))
    model.init_weights()
    cast_model_dtype(model, torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().to(p.dtype))
    return model


def empty_like_model(model: KimiK3Model, layer_range=None) -> KimiK3Model:
    other = KimiK3Model(model.args, layer_range=layer_range)
    cast_model_dtype(other, torch.bfloat16)
    with torch.no_grad():
        for p in other.parameters():
            p.fill_(7.0)  # anything not loaded shows up
    return other


def hf_layout(model: KimiK3Model, *, mxfp4: bool = True) -> dict[str, torch.Tensor]:
    """Spec §9.2 names and shapes for ``model``'s weights (bf16 on disk). With ``mxfp4`` the experts are
    encoded and ``model``'s own experts are replaced by the decoded values (the reference for a load)."""
    sd, args = model.state_dict(), model.args
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        used.add(key)
        return sd[key].bfloat16()

    out = {
        M + "embed_tokens.weight": take("tok_embeddings.weight"),
        M + "norm.weight": take("norm.weight"),
        "language_model.lm_head.weight": take("output.weight"),
        M + "output_attn_res_norm.weight": take("output_mix.norm_weight"),
        M + "output_attn_res_proj.weight": take("output_mix.proj_weight"),
    }
    for i in range(args.n_layers):
        ours, hf = f"layers.{i}.", f"{M}layers.{i}."
        for a, b in [("attention_norm.weight", "input_layernorm.weight"),
                     ("ffn_norm.weight", "post_attention_layernorm.weight"),
                     ("attention_mix.norm_weight", "self_attention_res_norm.weight"),
                     ("attention_mix.proj_weight", "self_attention_res_proj.weight"),
                     ("ffn_mix.norm_weight", "mlp_res_norm.weight"),
                     ("ffn_mix.proj_weight", "mlp_res_proj.weight")]:
            out[hf + b] = take(ours + a)
        if args.is_kda_layer(i):
            for k in KDA_KEYS:
                out[hf + "self_attn." + k] = take(ours + "attention." + k)
            a_log = take(ours + "attention.decay.A_log")
            padded = torch.zeros(128, dtype=torch.bfloat16)
            padded[: a_log.numel()] = a_log
            out[hf + "self_attn.A_log"] = padded
            out[hf + "self_attn.dt_bias"] = take(ours + "attention.decay.dt_bias")
        else:
            for k in MLA_KEYS + (INDEXER_KEYS if args.has_indexer else []):
                out[hf + "self_attn." + k] = take(ours + "attention." + k)
        if not args.is_moe_layer(i):
            gate_up = take(ours + "feed_forward.gate_up_proj.weight")
            half = gate_up.shape[0] // 2
            out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = gate_up[:half], gate_up[half:]
            out[hf + "mlp.down_proj.weight"] = take(ours + "feed_forward.down_proj.weight")
            continue
        moe, bsm = ours + "moe.", hf + "block_sparse_moe."
        out[bsm + "gate.weight"] = take(moe + "router.gate.weight")
        out[bsm + "gate.e_score_correction_bias"] = take(moe + "router.e_score_correction_bias")
        for k in ("routed_expert_down_proj.weight", "routed_expert_up_proj.weight", "routed_expert_norm.weight",
                  "shared_experts.down_proj.weight"):
            out[bsm + k] = take(moe + k)
        gate_up = take(moe + "shared_experts.gate_up_proj.weight")
        half = gate_up.shape[0] // 2
        out[bsm + "shared_experts.gate_proj.weight"] = gate_up[:half]
        out[bsm + "shared_experts.up_proj.weight"] = gate_up[half:]
        w13, w2 = take(moe + "experts.w13"), take(moe + "experts.w2")
        F = w13.shape[1] // 2
        for e in range(w13.shape[0]):
            for name, w in (("w1", w13[e, :F]), ("w3", w13[e, F:]), ("w2", w2[e])):
                key = f"{bsm}experts.{e}.{name}"
                if mxfp4:
                    out[key + ".weight_packed"], out[key + ".weight_scale"] = encode_mxfp4(w)
                else:
                    out[key + ".weight"] = w.clone()
        if mxfp4:  # the reference model holds exactly what the checkpoint encodes
            experts = model.get_submodule(moe + "experts")
            with torch.no_grad():
                for e in range(w13.shape[0]):
                    for name, dst in (("w1", experts.w13[e, :F]), ("w3", experts.w13[e, F:]), ("w2", experts.w2[e])):
                        key = f"{bsm}experts.{e}.{name}"
                        decode_mxfp4(out[key + ".weight_packed"], out[key + ".weight_scale"], out=dst)
    assert used == set(sd), f"hf_layout does not cover {sorted(set(sd) - used)}"
    return out


def shard_of(key: str, n_layers: int) -> str:
    """Three shards: globals + vision, the first half of the layers, the second half."""
    if ".layers." not in key:
        return "model-00001-of-00003.safetensors"
    layer = int(key.split(".layers.")[1].split(".")[0])
    return "model-00002-of-00003.safetensors" if layer < n_layers // 2 else "model-00003-of-00003.safetensors"


def write_hf(path: Path, tensors: dict[str, torch.Tensor], args, *, index: bool = True, vision: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tensors = {**tensors, **(VISION if vision else {})}
    files: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        files.setdefault(shard_of(key, args.n_layers), {})[key] = value.contiguous()
    for name, content in files.items():
        save_file(content, str(path / name))
    if index:
        weight_map = {k: shard_of(k, args.n_layers) for k in tensors}
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
              "text_config": hf_text_config(args), "vision_config": {"hidden_size": 8}}
    (path / "config.json").write_text(json.dumps(config))
    return path


def read_all(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, key
        assert torch.equal(sa[key], sb[key]), key


TOKENS = torch.randint(0, 2048, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("flavor", ["k3_debug", "k31_debug"])
def test_synthetic_mxfp4_checkpoint_loads_exactly(tmp_path, flavor):
    reference = build_model(flavor)
    path = write_hf(tmp_path / "hf", hf_layout(reference, mxfp4=True), reference.args)
    model = empty_like_model(reference)
    report = load_hf_checkpoint(model, path)
    assert_same_state(model, reference)
    with torch.no_grad():
        assert torch.equal(model(TOKENS), reference(TOKENS))
    assert sorted(report.skipped) == sorted(VISION)  # text-only model: vision keys skipped, no error
    assert report.loaded == list(model.state_dict())
    fp32 = model.state_dict()["layers.0.attention.decay.A_log"]
    assert fp32.dtype == torch.float32 and fp32.shape == (model.args.kda_num_heads,)


def test_without_an_index_only_model_safetensors_is_read(tmp_path):
    reference = build_model("k3_debug", seed=3)
    path = write_hf(tmp_path / "hf", hf_layout(reference, mxfp4=True), reference.args, index=False)
    model = empty_like_model(reference)
    with pytest.raises(ValueError, match=r"has neither model.safetensors.index.json nor model.safetensors; it holds "
                                         r"\['model-00001-of-00003.safetensors', .*need an index"):
        load_hf_checkpoint(model, path)
    merged = read_all(path)
    for file in path.glob("*.safetensors"):
        file.unlink()
    save_file(merged, str(path / "model.safetensors"))
    save_file({"stray": torch.zeros(2)}, str(path / "adapter.safetensors"))  # not part of the checkpoint
    load_hf_checkpoint(model, path)
    assert_same_state(model, reference)


def test_fp32_keys_upcast_from_any_disk_dtype(tmp_path):
    reference = build_model("k3_debug", seed=4)
    tensors = hf_layout(reference, mxfp4=False)
    key = M + "layers.0.self_attn.dt_bias"
    tensors[key] = tensors[key].float()  # an fp32 tensor on disk; the others are bf16
    model = empty_like_model(reference)
    load_hf_checkpoint(model, write_hf(tmp_path / "hf", tensors, reference.args))
    assert model.state_dict()["layers.0.attention.decay.dt_bias"].dtype == torch.float32
    assert_same_state(model, reference)


def test_hf_to_ours_to_hf_is_bit_exact(tmp_path):
    reference = build_model("k31_debug", seed=5)
    source = write_hf(tmp_path / "src", hf_layout(reference, mxfp4=False), reference.args)
    model = empty_like_model(reference)
    load_hf_checkpoint(model, source)
    out = export_hf_checkpoint(model, tmp_path / "out", max_shard_bytes=200_000)
    original, exported = read_all(source), read_all(out)
    text = {k: v for k, v in original.items() if k.startswith("language_model.")}
    assert text.keys() == exported.keys()
    for key, value in text.items():
        assert exported[key].dtype == value.dtype == torch.bfloat16, key
        assert torch.equal(exported[key], value), key
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    for key, file in index["weight_map"].items():
        with safe_open(str(out / file), framework="pt") as f:
            assert key in f.keys()
    reloaded = empty_like_model(reference)
    load_hf_checkpoint(reloaded, out)
    assert_same_state(reloaded, reference)


def test_mxfp4_export_reloads_to_the_same_model(tmp_path):
    reference = build_model("k3_debug", seed=6)
    hf_layout(reference, mxfp4=True)  # puts MXFP4-representable experts into the reference
    out = export_hf_checkpoint(reference, tmp_path / "mx", mxfp4_experts=True)
    keys = read_all(out).keys()
    assert f"{M}layers.1.block_sparse_moe.experts.0.w1.weight_packed" in keys
    assert not any(k.endswith("experts.0.w1.weight") for k in keys)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "mxfp4-pack-quantized"
    model = empty_like_model(reference)
    load_hf_checkpoint(model, out)
    assert_same_state(model, reference)


def test_pipeline_stage_reads_only_its_keys_and_matches_the_full_model(tmp_path):
    reference = build_model("k3_debug", seed=7)
    tensors = hf_layout(reference, mxfp4=True)
    path = write_hf(tmp_path / "hf", tensors, reference.args)
    full = empty_like_model(reference)
    load_hf_checkpoint(full, path)
    first, second = empty_like_model(reference, (0, 4)), empty_like_model(reference, (4, 8))
    load_hf_checkpoint(first, path)
    report = load_hf_checkpoint(second, path)

    finals = {M + "norm.weight", "language_model.lm_head.weight", M + "output_attn_res_norm.weight",
              M + "output_attn_res_proj.weight"}
    expected = {k for k in tensors if any(k.startswith(f"{M}layers.{i}.") for i in range(4, 8))} | finals
    assert set(report.keys_read) == expected
    assert report.files_read == ["model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"]

    with torch.no_grad():
        hidden = full.tok_embeddings(TOKENS)
        bank = hidden.new_empty(hidden.shape[0] * hidden.shape[1], 0, hidden.shape[2])
        seq = build_sequence_info(*TOKENS.shape, TOKENS.device, None)
        for i in range(4):
            hidden, bank = full.layers[str(i)](hidden, bank, seq)
        stage_hidden, stage_bank = first(TOKENS)
        assert torch.equal(stage_hidden, hidden) and torch.equal(stage_bank, bank)
        assert torch.equal(second(stage_hidden, stage_bank), full(TOKENS))


def _localise_experts(model: KimiK3Model, first: int, last: int) -> None:
    """What an expert-parallel rank holds: plain w13/w2 with only experts [first, last)."""
    for layer in model.layers.values():
        if layer.moe_enabled:
            ex = layer.moe.experts
            ex.w13 = torch.nn.Parameter(torch.full_like(ex.w13[first:last], 7.0))
            ex.w2 = torch.nn.Parameter(torch.full_like(ex.w2[first:last], 7.0))


def test_expert_range_loads_exactly_the_local_experts(tmp_path):
    reference = build_model("k31_debug", seed=8)
    path = write_hf(tmp_path / "hf", hf_layout(reference, mxfp4=True), reference.args)
    model = empty_like_model(reference)
    _localise_experts(model, 2, 5)
    report = load_hf_checkpoint(model, path, expert_range=(2, 5))
    ref, got = reference.state_dict(), model.state_dict()
    for key, value in got.items():
        want = ref[key][2:5] if key.endswith(("experts.w13", "experts.w2")) else ref[key]
        assert torch.equal(value, want), key
    experts_read = {int(k.split(".experts.")[1].split(".")[0]) for k in report.keys_read if ".experts." in k}
    assert experts_read == {2, 3, 4}


def test_expert_range_must_match_the_local_tensors(tmp_path):
    reference = build_model("k3_debug", seed=9)
    path = write_hf(tmp_path / "hf", hf_layout(reference, mxfp4=False), reference.args)
    model = empty_like_model(reference)
    _localise_experts(model, 2, 5)
    with pytest.raises(ValueError, match=r"holds 3 experts but expert_range=\(0, 4\) names 4"):
        load_hf_checkpoint(model, path, expert_range=(0, 4))
    with pytest.raises(ValueError, match="pass expert_range"):
        load_hf_checkpoint(model, path)
    with pytest.raises(ValueError, match=r"expert_range=\(6, 9\) is invalid"):
        load_hf_checkpoint(model, path, expert_range=(6, 9))


def test_export_refuses_partial_models_and_existing_targets(tmp_path):
    reference = build_model("k3_debug", seed=10)
    stage = empty_like_model(reference, (0, 4))
    with pytest.raises(ValueError, match="pipeline stage"):
        export_hf_checkpoint(stage, tmp_path / "stage")
    local = empty_like_model(reference)
    _localise_experts(local, 0, 4)
    with pytest.raises(ValueError, match="holds 4 of num_experts=8"):
        export_hf_checkpoint(local, tmp_path / "local")
    assert not (tmp_path / "local").exists() and not (tmp_path / ".local.tmp").exists()  # the temp dir is removed
    export_hf_checkpoint(reference, tmp_path / "out")
    with pytest.raises(ValueError, match="already exists"):
        export_hf_checkpoint(reference, tmp_path / "out")
    export_hf_checkpoint(reference, tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "config.json").is_file()


def test_export_keeps_the_base_config_and_can_keep_fp32_params(tmp_path):
    reference = build_model("k3_debug", seed=11)
    base = {"model_type": "kimi_k3", "text_config": {"hidden_size": 1, "quantization_config": {"x": 1}},
            "vision_config": {"hidden_size": 8}, "quantization_config": {"quant_method": "mxfp4"}}
    out = export_hf_checkpoint(reference, tmp_path / "out", base_config=base, fp32_params_dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["vision_config"] == {"hidden_size": 8}
    assert "quantization_config" not in config and "quantization_config" not in config["text_config"]
    assert config["text_config"]["hidden_size"] == reference.args.dim
    tensors = read_all(out)
    assert tensors[M + "layers.0.self_attn.A_log"].dtype == torch.float32
    assert tensors[M + "layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16


def _own(model: torch.nn.Module, name: str, like: torch.Tensor) -> None:
    """Register parameter ``name`` (dotted, creating submodules) as a multimodal model would own it."""
    *path, leaf = name.split(".")
    module = model
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    module.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(like)))


def test_vision_keys_pass_through_when_the_model_owns_them(tmp_path):
    reference = build_model("k3_debug", seed=12)
    path = write_hf(tmp_path / "hf", hf_layout(reference, mxfp4=False), reference.args)
    model = empty_like_model(reference)
    owned = ["vision_tower.patch_embed.proj.weight", "mm_projector.proj.0.weight"]
    for name in owned:
        _own(model, name, VISION[name])
    report = load_hf_checkpoint(model, path)
    assert report.skipped == ["vision_tower.encoder.final_layernorm.weight"]
    for name in owned:
        assert torch.equal(model.get_parameter(name), VISION[name]), name
    exported = read_all(export_hf_checkpoint(model, tmp_path / "out"))
    assert all(torch.equal(exported[name], VISION[name]) for name in owned)


def test_an_arbitrary_box_of_a_stacked_mxfp4_tensor(tmp_path):
    """What a DTensor shard on several dims owns: experts 2..4, rows 40..89 (across the w1|w3 seam at 64) and
    columns 16..35 (cutting the 32-wide scale groups)."""
    from titan_kimi.checkpoint import Destination, HFCheckpoint
    from titan_kimi.checkpoint.hf_load import execute_reads
    from titan_kimi.checkpoint.hf_plan import plan_load

    reference = build_model("k3_debug", seed=13)
    path = write_hf(tmp_path / "hf", hf_layout(reference, mxfp4=True), reference.args)
    full = reference.state_dict()["layers.1.moe.experts.w13"]
    local = torch.zeros(3, 50, 20, dtype=torch.bfloat16)
    dest = Destination("layers.1.moe.experts.w13", local, tuple(full.shape), (2, 40, 16))
    with HFCheckpoint(path) as ckpt:
        plan = plan_load(ckpt, [dest], fp32_names=set(), expected_keys=None)
        execute_reads(ckpt, plan.reads, {dest.fqn: local})
        read = set(ckpt.keys_read)
    assert torch.equal(local, full[2:5, 40:90, 16:36])
    assert read == {f"{M}layers.1.block_sparse_moe.experts.{e}.{w}.weight_{s}"
                    for e in (2, 3, 4) for w in ("w1", "w3") for s in ("packed", "scale")}
