"""export_hf_stages in one process (every stage passed at once): the checkpoint of the whole model's export
(keys, values, config.json, index total), for the text model and the image-text model with LoRA merged; it
loads back; a failure leaves nothing that looks complete. The multi-rank cases are in
tests/parallel_parity_worker.py (PP2 x FSDP2, PP2 x EP2 x FSDP2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import titan_kimi.checkpoint.hf_export_stages as stages_module
from titan_kimi.checkpoint import export_hf_checkpoint, export_hf_stages, load_hf_checkpoint
from titan_kimi.checkpoint.destinations import model_destinations
from titan_kimi.config import load_job_config
from titan_kimi.lora import merged_tensors
from titan_kimi.lora.modules import is_adapter_parameter
from titan_kimi.models.kimi_k3 import KimiK3Model, model_args_for
from titan_kimi.training.setup.build import build_model_from_config, model_args_from_config, tokenizer_from_config
from titan_kimi.training.setup.seeded_init import init_weights_seeded, parameter_seed

SEED = 11


def read_folder(path: Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {k: v for f in sorted(set(index["weight_map"].values())) for k, v in load_file(str(path / f)).items()}
    return tensors, index, json.loads((path / "config.json").read_text())


def assert_same_checkpoint(a: Path, b: Path) -> None:
    (ta, ia, ca), (tb, ib, cb) = read_folder(a), read_folder(b)
    assert ta.keys() == tb.keys() == ia["weight_map"].keys()
    assert all(ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in ta)
    assert ia["metadata"] == ib["metadata"] and ca == cb
    assert all((a / f).is_file() for f in set(ia["weight_map"].values()))


def fill_adapters(model: torch.nn.Module, seed: int) -> None:
    """Non-zero LoRA factors (B starts at zero), drawn per name over the global shape: the same values in every
    layout (a sharded factor copies its own box)."""
    with torch.no_grad():
        for dest in model_destinations(model):
            if is_adapter_parameter(dest.fqn):
                gen = torch.Generator().manual_seed(parameter_seed(seed, dest.fqn, 0))
                full = torch.randn(dest.global_shape, generator=gen) * 0.05
                box = tuple(slice(o, o + n) for o, n in zip(dest.offset, dest.local_shape))
                dest.local.copy_(full[box])


def logits_with_an_image(model: torch.nn.Module) -> torch.Tensor:
    """Logits of one row holding one image (through the tower and projector) for an image-text model; of text
    tokens for a text model."""
    args, vision = model.args, getattr(model, "vision_args", None)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, args.vocab_size, (1, 12), generator=gen)
    if vision is None:
        with torch.no_grad():
            return model(tokens)
    tokens[tokens == vision.media_placeholder_token_id] = 1
    tokens[0, 3] = vision.media_placeholder_token_id
    kh, kw = vision.merge_kernel
    grid = torch.tensor([[1, 2 * kh, 2 * kw]])
    pixels = torch.randn(int(grid.prod()), 3, vision.patch_size, vision.patch_size, generator=gen)
    with torch.no_grad():
        return model(tokens, pixel_values=pixels, grid_thws=grid)


def text_model(layer_range=None) -> KimiK3Model:
    model = KimiK3Model(model_args_for("k31_debug_pp"), layer_range=layer_range)
    init_weights_seeded(model, SEED)
    return model


def test_text_stages_export_the_whole_models_checkpoint(tmp_path):
    whole = text_model()
    n = whole.args.n_layers
    parts = [text_model((0, 4)), text_model((4, n))]
    export_hf_checkpoint(whole, tmp_path / "one", dtype=torch.float32)
    # Stages in any order, small shards: several files per stage.
    export_hf_stages(parts[::-1], tmp_path / "pp", dtype=torch.float32, max_shard_bytes=200_000)
    assert_same_checkpoint(tmp_path / "pp", tmp_path / "one")
    files = sorted(p.name for p in (tmp_path / "pp").glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    again = KimiK3Model(whole.args)
    load_hf_checkpoint(again, tmp_path / "pp")
    assert all(torch.equal(again.state_dict()[k], v) for k, v in whole.state_dict().items())


def vl_lora_model(cfg, args, tokenizer, layer_range=None) -> torch.nn.Module:
    model = build_model_from_config(cfg, args, tokenizer, layer_range=layer_range)
    model.to_empty(device="cpu")
    init_weights_seeded(model, SEED)
    fill_adapters(model, SEED)
    return model


def test_image_text_stages_with_lora_merged_export_the_whole_models_checkpoint(tmp_path):
    cfg = load_job_config(["--job.config_file", "train_configs/k31_medpix_debug.toml", "--model.dtype", "float32",
                           "--lora.enable", "true", "--lora.target_modules",
                           "attention,experts,lm_head,projector,vision_tower"], environ={})
    args = model_args_from_config(cfg)
    tokenizer = tokenizer_from_config(cfg, args)
    whole = vl_lora_model(cfg, args, tokenizer)
    split = args.attn_res_block_size  # stages hold whole AttnRes blocks
    parts = [vl_lora_model(cfg, args, tokenizer, (0, split)), vl_lora_model(cfg, args, tokenizer,
                                                                           (split, args.n_layers))]
    export_hf_checkpoint(whole, tmp_path / "one", dtype=torch.float32, tensors=merged_tensors(whole))
    export_hf_stages(parts, tmp_path / "pp", dtype=torch.float32, tensors_of=merged_tensors)
    assert_same_checkpoint(tmp_path / "pp", tmp_path / "one")
    tensors, _, config = read_folder(tmp_path / "pp")
    assert "vision_config" in config and any(k.startswith("vision_tower.encoder.blocks.1.") for k in tensors)
    assert any(k.startswith("mm_projector.") for k in tensors) and not any("lora" in k for k in tensors)

    plain = build_model_from_config(load_job_config(["--job.config_file", "train_configs/k31_medpix_debug.toml",
                                                     "--model.dtype", "float32"], environ={}), args, tokenizer)
    plain.to_empty(device="cpu")
    load_hf_checkpoint(plain, tmp_path / "pp")  # strict: every tower, projector and text key
    merged, adapted = logits_with_an_image(plain), logits_with_an_image(whole)
    assert torch.allclose(merged, adapted, rtol=1e-4, atol=1e-5)


def test_a_failed_stage_leaves_the_old_checkpoint_and_no_temporary_folder(tmp_path, monkeypatch):
    whole = text_model()
    target = tmp_path / "hf"
    export_hf_checkpoint(whole, target, dtype=torch.float32)
    before = sorted(p.name for p in target.iterdir())
    real = stages_module.write_state

    def fail_on_second_stage(part, state, writer, **kw):
        if part.first_layer > 0:
            writer.add("language_model.model.norm.weight", torch.zeros(1))
            writer.finish()  # a shard of the failing stage is on disk when it fails
            raise OSError("disk unplugged")
        real(part, state, writer, **kw)

    monkeypatch.setattr(stages_module, "write_state", fail_on_second_stage)
    parts = [text_model((0, 4)), text_model((4, whole.args.n_layers))]
    with pytest.raises(ValueError, match="disk unplugged.*|nothing was replaced"):
        export_hf_stages(parts, target, dtype=torch.float32, overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == before
    assert not (tmp_path / ".hf.tmp").exists()


def test_stages_that_miss_layers_are_refused(tmp_path):
    n = model_args_for("k31_debug_pp").n_layers
    with pytest.raises(ValueError, match=rf"end at layer 4, not at {n}"):
        export_hf_stages([text_model((0, 4))], tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not (tmp_path / ".hf.tmp").exists()
