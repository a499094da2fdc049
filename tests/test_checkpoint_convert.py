"""scripts/tools/convert_checkpoint.py: HF -> DCP -> HF, from a training checkpoint, and its errors."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from test_checkpoint_hf import VISION, build_model, empty_like_model, hf_layout, read_all, write_hf
from titan_kimi.checkpoint import CheckpointManager, checkpoint_format, load_hf_checkpoint, load_model_weights
from titan_kimi.models.kimi_k3.state_dict_adapter import hf_vision_config

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "tools" / "convert_checkpoint.py"
_spec = importlib.util.spec_from_file_location("convert_checkpoint", SCRIPT)
convert = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert)


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_hf_to_dcp_to_hf_round_trip(tmp_path, capsys):
    reference = build_model("k31_debug", seed=31)
    source = write_hf(tmp_path / "hf", hf_layout(reference, mxfp4=True), reference.args)
    # args from config.json; its vision_config is a stand-in (no real tower): the text model only
    assert convert.main(["hf-to-dcp", str(source), str(tmp_path / "dcp"), "--text-only"]) == 0
    assert "hf-to-dcp" in capsys.readouterr().err  # the progress bar
    assert checkpoint_format(tmp_path / "dcp") == "dcp"
    model = empty_like_model(reference)
    assert load_model_weights(model, tmp_path / "dcp") == "dcp"
    assert_same_state(model, reference)  # MXFP4 experts dequantised exactly

    out = tmp_path / "hf2"
    assert convert.main(["dcp-to-hf", str(tmp_path / "dcp"), str(out), "--hf-config", str(source / "config.json"),
                         "--max-shard-size", "100KB", "--quiet"]) == 0
    assert json.loads((out / "config.json").read_text())["vision_config"] == {"hidden_size": 8}
    assert len(list(out.glob("model-*.safetensors"))) > 1
    again = empty_like_model(reference)
    load_hf_checkpoint(again, out)
    assert_same_state(again, reference)


def test_bf16_checkpoint_survives_hf_dcp_hf_bit_exactly(tmp_path):
    reference = build_model("k3_debug", seed=32)
    source = write_hf(tmp_path / "hf", hf_layout(reference, mxfp4=False), reference.args)
    assert convert.main(["hf-to-dcp", str(source), str(tmp_path / "dcp"), "--flavor", "k3_debug", "--quiet"]) == 0
    assert convert.main(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "out"), "--flavor", "k3_debug",
                         "--quiet"]) == 0
    original, exported = read_all(source), read_all(tmp_path / "out")
    for key in VISION:
        original.pop(key)
    assert original.keys() == exported.keys()
    assert all(exported[k].dtype == original[k].dtype and torch.equal(exported[k], original[k]) for k in original)


def test_export_from_a_training_checkpoint_folder(tmp_path, capsys):
    reference = build_model("k3_debug", seed=33)
    ckpt = CheckpointManager(tmp_path / "ckpt", interval=1)
    ckpt.save(5, {"model": reference, "train": {"step": 5}})
    ckpt.save(7, {"model": reference, "train": {"step": 7}})
    out = tmp_path / "hf"
    assert convert.main(["dcp-to-hf", str(tmp_path / "ckpt"), str(out), "--flavor", "k3_debug", "--mxfp4-experts",
                         "--fp32-params-dtype", "float32", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "using the latest step" in err and "step-7" in err
    tensors = read_all(out)
    assert tensors["language_model.model.layers.0.self_attn.dt_bias"].dtype == torch.float32
    assert "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale" in tensors
    model = empty_like_model(reference)
    load_hf_checkpoint(model, out)
    for key, value in model.state_dict().items():
        if "experts" not in key:  # experts went through MXFP4: lossy
            assert torch.equal(value, reference.state_dict()[key]), key


def test_errors_exit_2_with_a_message(tmp_path, capsys):
    reference = build_model("k3_debug", seed=34)
    source = write_hf(tmp_path / "hf", hf_layout(reference, mxfp4=True), reference.args)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("taken")

    def fails(argv, message):
        assert convert.main(argv) == 2
        err = capsys.readouterr().err
        assert "convert_checkpoint: error:" in err and message in err, err

    fails(["hf-to-dcp", str(source), str(tmp_path / "out"), "--quiet"], "already exists")
    fails(["hf-to-dcp", str(source), str(tmp_path / "d"), "--flavor", "k31_debug", "--quiet"],
          "config.json holds a different model than this run builds (3 fields differ):\n  index_n_heads: 0 in the "
          "checkpoint, 2 in this model")
    assert not (tmp_path / "d").exists() and not (tmp_path / ".d.tmp").exists()  # nothing half-written
    fails(["dcp-to-hf", str(tmp_path / "hf"), str(tmp_path / "x"), "--flavor", "k3_debug"], "holds no complete step-N")
    assert convert.main(["hf-to-dcp", str(source), str(tmp_path / "dcp"), "--text-only", "--quiet"]) == 0
    fails(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "x"), "--flavor", "k31_debug"],
          "index_n_heads: 0 in the checkpoint, 2 in this model")
    (tmp_path / "dcp" / "model_args.json").unlink()  # as saved by an older titan_kimi
    fails(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "x")], "has no model_args.json")
    fails(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "x"), "--flavor", "k31_debug"],
          "does not match the model args")
    fails(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "x"), "--flavor", "nope"], "unknown model flavor")


def test_size_parsing():
    assert convert.parse_size("5GB") == 5 * 10**9 and convert.parse_size("2GiB") == 2 * 2**30
    assert convert.parse_size("1024") == 1024 and convert.parse_size("1.5 MB") == 1_500_000
    with pytest.raises(Exception, match="invalid size"):
        convert.parse_size("lots")


def test_initial_weights_format_detection(tmp_path):
    (tmp_path / "ckpt" / "step-3").mkdir(parents=True)
    (tmp_path / "ckpt" / "step-3" / ".metadata").write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds DCP steps \['step-3'\]: pass one of them"):
        checkpoint_format(tmp_path / "ckpt")


def test_the_converter_refuses_to_write_into_its_own_source(tmp_path, capsys):
    reference = build_model("k3_debug", seed=35)
    ckpt = CheckpointManager(tmp_path / "ckpt", interval=1)
    ckpt.save(5, {"model": reference})
    before = sorted(p.name for p in (tmp_path / "ckpt").rglob("*"))
    for out, relation in ((tmp_path / "ckpt", "is"), (tmp_path / "ckpt" / "hf", "lies inside"),
                          (tmp_path, "contains")):
        assert convert.main(["dcp-to-hf", str(tmp_path / "ckpt"), str(out), "--overwrite", "--quiet"]) == 2
        err = capsys.readouterr().err
        assert f"output {str(out)!r} {relation} the source" in err and "destroy the checkpoint" in err, err
    step = tmp_path / "ckpt" / "step-5"
    assert convert.main(["dcp-to-hf", str(step), str(step), "--overwrite", "--quiet"]) == 2
    assert sorted(p.name for p in (tmp_path / "ckpt").rglob("*")) == before  # nothing deleted
    source = write_hf(tmp_path / "hf", hf_layout(reference, mxfp4=False), reference.args)
    assert convert.main(["hf-to-dcp", str(source), str(source / "dcp"), "--quiet"]) == 2
    assert "lies inside the source" in capsys.readouterr().err


def test_a_wrong_flavor_never_drops_weights_and_a_corrupt_dcp_exits_2(tmp_path, capsys):
    k31 = build_model("k31_debug", seed=36)
    CheckpointManager(tmp_path / "ckpt", interval=1).save(1, {"model": k31})
    step = tmp_path / "ckpt" / "step-1"
    (step / "model_args.json").unlink()  # only the keys can tell
    assert convert.main(["dcp-to-hf", str(step), str(tmp_path / "out"), "--flavor", "k3_debug", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "model key(s) this model does not have: 'layers.3.attention.indexer" in err and "drop them" in err, err
    assert not (tmp_path / "out").exists()
    for distcp in step.glob("*.distcp"):
        distcp.write_bytes(distcp.read_bytes()[:100])  # truncated data files
    assert convert.main(["dcp-to-hf", str(step), str(tmp_path / "out"), "--flavor", "k31_debug", "--quiet"]) == 2
    assert re.search(rf"error: DCP checkpoint {step} is damaged, its model weights cannot be converted: "
                     rf"{step}/__0_0\.distcp is 100 bytes", capsys.readouterr().err)
    (step / ".metadata").write_bytes(b"garbage")
    assert convert.main(["dcp-to-hf", str(step), str(tmp_path / "out"), "--flavor", "k31_debug", "--quiet"]) == 2
    assert f"DCP metadata {step / '.metadata'} cannot be read" in capsys.readouterr().err


def public_vision_keys(n_blocks: int) -> set[str]:
    """Spec §9.2's tower and projector keys (the public K3.1-Pro layout), restated here."""
    blocks = {f"vision_tower.encoder.blocks.{i}.{name}.weight" for i in range(n_blocks)
              for name in ("norm0", "norm1", "wqkv", "wo", "mlp.fc0", "mlp.fc1")}
    return blocks | {"vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
                     "vision_tower.encoder.final_layernorm.weight", "mm_projector.proj.0.weight",
                     "mm_projector.proj.2.weight", "mm_projector.post_norm.weight"}


def test_an_image_text_training_checkpoint_keeps_its_tower_through_dcp_hf_dcp(tmp_path):
    from test_checkpoint_hf_stages import assert_same_checkpoint
    from titan_kimi.checkpoint import export_hf_checkpoint
    from titan_kimi.config import load_job_config
    from titan_kimi.training.setup.build import build_model_from_config, model_args_from_config, tokenizer_from_config
    from titan_kimi.training.setup.seeded_init import init_weights_seeded

    cfg = load_job_config(["--job.config_file", "train_configs/k31_medpix_debug.toml"], environ={})
    args = model_args_from_config(cfg)
    tokenizer = tokenizer_from_config(cfg, args)

    def vl_model(seed):
        model = build_model_from_config(cfg, args, tokenizer)
        model.to_empty(device="cpu")
        init_weights_seeded(model, seed)
        return model

    model = vl_model(37)
    ckpt = CheckpointManager(tmp_path / "ckpt", interval=1)
    ckpt.save(3, {"model": model})  # as a training run saves it: vision_args.json beside model_args.json
    resumed = vl_model(0)
    assert ckpt.load({"model": resumed}) == 3  # the tower's keys are the model's, not unexpected ones
    assert_same_state(resumed, model)

    out = tmp_path / "hf"
    assert convert.main(["dcp-to-hf", str(tmp_path / "ckpt"), str(out), "--dtype", "float32", "--quiet"]) == 0
    tensors = read_all(out)
    vision = {k for k in tensors if not k.startswith("language_model.")}
    assert vision == public_vision_keys(model.vision_args.n_layers)
    assert all(torch.equal(tensors[k], model.state_dict()[k]) for k in vision)
    config = json.loads((out / "config.json").read_text())
    assert config["vision_config"] == hf_vision_config(model.vision_args, text_hidden_size=args.dim)
    export_hf_checkpoint(model, tmp_path / "exported", dtype=torch.float32)  # one mapping: the export's checkpoint
    assert_same_checkpoint(out, tmp_path / "exported")

    # Back to DCP from the folder's config.json (text model and tower), then loaded as initial weights.
    assert convert.main(["hf-to-dcp", str(out), str(tmp_path / "dcp2"), "--dtype", "float32", "--quiet"]) == 0
    again = vl_model(0)
    assert load_model_weights(again, tmp_path / "dcp2") == "dcp"
    assert_same_state(again, model)
    assert convert.main(["dcp-to-hf", str(tmp_path / "dcp2"), str(tmp_path / "hf2"), "--dtype", "float32",
                         "--quiet"]) == 0
    assert_same_checkpoint(tmp_path / "hf2", out)


def test_a_step_with_a_damaged_optimizer_part_converts_its_weights_and_says_it_cannot_be_resumed(tmp_path, capsys):
    from test_checkpoint_faults import cut_tail
    from titan_kimi.checkpoint import training_state

    reference = build_model("k3_debug", seed=34)
    state = training_state(reference, torch.optim.AdamW(reference.parameters()), rng=False)
    CheckpointManager(tmp_path / "ckpt", interval=1).save(3, state)
    step = tmp_path / "ckpt" / "step-3"
    name = cut_tail(step)  # the tail holds optimizer moments, written after the model's tensors
    assert convert.main(["dcp-to-hf", str(step), str(tmp_path / "hf"), "--dtype", "float32", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert re.search(rf"warning: .*step-3 cannot be resumed from \(its model weights were read whole and written\): "
                     rf".*step-3/{name} is \d+ bytes.*'optimizer' entries", err), err
    model = empty_like_model(reference)
    load_hf_checkpoint(model, tmp_path / "hf")
    assert_same_state(model, reference)
