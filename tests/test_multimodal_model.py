"""The image-text model: forward against the text model on hand-merged embeddings, freezing, pipeline stages,
HF checkpoints with vision keys in the public layout, LoRA on the tower."""

import json

import pytest
import torch
from safetensors.torch import save_file

from titan_kimi.checkpoint import hf_config, hf_tensors_for, load_hf_checkpoint
from titan_kimi.checkpoint import export_hf_checkpoint
from titan_kimi.lora import LoRASettings, apply_lora, reset_adapters
from titan_kimi.models.kimi_k3 import KimiK3Model, model_args_for
from titan_kimi.models.kimi_k3.multimodal import KimiK3VLModel
from titan_kimi.models.kimi_k3.state_dict_adapter import hf_vision_config, vision_args_from_hf_config
from titan_kimi.models.kimi_k3.vision_args import vision_args_for
from titan_kimi.training.loss import LinearCrossEntropyLoss

IMG = 1813


def build(seed=0, layer_range=None):
    torch.manual_seed(seed)
    model = KimiK3VLModel(model_args_for("k31_debug", index_topk=8),
                          vision_args_for("moonvit3d_debug", media_placeholder_token_id=IMG), layer_range)
    model.init_weights()
    return model


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    grids = torch.tensor([[1, 4, 6], [1, 2, 2], [1, 6, 4]])  # 6, 1 and 6 merged tokens
    tokens = torch.randint(0, 1800, (2, 20), generator=g)
    tokens[0, 3], tokens[0, 12], tokens[1, 0] = IMG, IMG, IMG  # row 0: images 0 and 1; row 1: image 2
    pixels = torch.randn(int(grids.prod(1).sum()), 3, 14, 14, generator=g)
    doc_ids = torch.ones(2, 20 + 5, dtype=torch.int32)
    doc_ids[1, 25 - 5 :] = 0  # row 1 expands to 25 positions too; call its tail padding
    return tokens, pixels, grids, doc_ids


def test_forward_equals_the_text_model_on_hand_merged_embeddings():
    model = build()
    tokens, pixels, grids, doc_ids = batch()
    out = model(tokens, pixel_values=pixels, grid_thws=grids, doc_ids=doc_ids)
    assert out.shape == (2, 25, 2048)
    feats = model.mm_projector(model.vision_tower(pixels, grids))
    assert feats.shape == (13, 128)
    text = model.tok_embeddings(tokens)
    rows = []
    for b, spans in ((0, [(3, feats[:6]), (12, feats[6:7])]), (1, [(0, feats[7:])])):
        pieces, start = [], 0
        for pos, f in spans:
            pieces += [text[b, start:pos], f]
            start = pos + 1
        pieces.append(text[b, start:])
        rows.append(torch.cat(pieces)[:25])
    text_model = KimiK3Model(model.args)
    text_model.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith(("vision", "mm_"))})
    ref = text_model(None, inputs_embeds=torch.stack(rows), doc_ids=doc_ids)
    assert rel_err(out, ref) < 1e-6


def test_tower_frozen_projector_and_text_train():
    model = build()
    for p in model.vision_tower.parameters():
        p.requires_grad_(False)
    tokens, pixels, grids, doc_ids = batch()
    hidden = model(tokens, pixel_values=pixels, grid_thws=grids, doc_ids=doc_ids, return_hidden=True)
    labels = torch.randint(0, 2048, (2, 25))
    LinearCrossEntropyLoss(16)(model.output, hidden, labels, 50.0).backward()
    assert all(p.grad is None for p in model.vision_tower.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.mm_projector.parameters())
    assert model.tok_embeddings.weight.grad is not None


def test_placeholder_mismatch_raises_in_the_forward():
    model = build()
    tokens, pixels, grids, doc_ids = batch()
    tokens[1, 0] = 5  # two placeholders left, three images
    with pytest.raises(ValueError, match="2 image placeholder.*but 3 image"):
        model(tokens, pixel_values=pixels, grid_thws=grids, doc_ids=doc_ids)
    with pytest.raises(ValueError, match="2 image placeholder.*but 0 image"):
        model(tokens, doc_ids=doc_ids)


def test_pipeline_stages_of_the_image_text_model():
    full = build()
    tokens, pixels, grids, doc_ids = batch()
    first, last = build(seed=1, layer_range=(0, 4)), build(seed=1, layer_range=(4, 8))
    assert first.vision_tower is not None and last.vision_tower is None
    for stage in (first, last):
        stage.load_state_dict({k: v for k, v in full.state_dict().items() if k in stage.state_dict()})
    hidden, bank = first(tokens, pixel_values=pixels, grid_thws=grids, doc_ids=doc_ids)
    out = last(hidden, bank, doc_ids=doc_ids)
    assert torch.equal(out, full(tokens, pixel_values=pixels, grid_thws=grids, doc_ids=doc_ids))
    with pytest.raises(ValueError, match="images go to the first stage"):
        last(hidden, bank, pixel_values=pixels, grid_thws=grids, doc_ids=doc_ids)


def write_public_checkpoint(model, folder, *, extra=None, drop=()):
    """An HF folder in the public layout, written key by key from the spec's names (not by our exporter)."""
    tensors = {}
    for fqn, tensor in model.state_dict().items():
        if fqn.startswith(("vision_tower.", "mm_projector.")):
            tensors[fqn] = tensor.clone()  # spec §9.2: the vision keys are the module names
        else:
            tensors.update({k: v.clone() for k, v in hf_tensors_for(fqn, tensor, dtype=torch.float32)})
    tensors.update(extra or {})
    for key in drop:
        del tensors[key]
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    config = hf_config(model.args)  # the composite kimi_k3 config: text_config ...
    config.update(media_placeholder_token_id=IMG, vision_config=hf_vision_config(model.vision_args, model.args.dim))
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


def test_hf_checkpoint_with_vision_keys_loads_into_the_image_text_model(tmp_path):
    source = build(seed=0)
    tensors = write_public_checkpoint(source, tmp_path / "hf")
    for key in ("vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
                "vision_tower.encoder.blocks.1.wqkv.weight", "vision_tower.encoder.blocks.0.mlp.fc1.weight",
                "vision_tower.encoder.final_layernorm.weight", "mm_projector.proj.0.weight",
                "mm_projector.proj.2.weight", "mm_projector.post_norm.weight",
                "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight"):
        assert key in tensors
    target = build(seed=7)
    report = load_hf_checkpoint(target, tmp_path / "hf")
    assert not report.missing and not report.unexpected and not report.skipped
    assert any(k.startswith("vision_tower.") for k in report.loaded)
    tokens, pixels, grids, doc_ids = batch()
    assert torch.equal(target(tokens, pixel_values=pixels, grid_thws=grids, doc_ids=doc_ids),
                       source(tokens, pixel_values=pixels, grid_thws=grids, doc_ids=doc_ids))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert vision_args_from_hf_config(config) == source.vision_args
    # A text model reads the same checkpoint and skips the vision keys.
    text = KimiK3Model(source.args)
    assert len(load_hf_checkpoint(text, tmp_path / "hf").skipped) == len(
        [k for k in tensors if k.startswith(("vision_tower.", "mm_projector."))])


def test_hf_checkpoint_vision_key_problems(tmp_path):
    source = build()
    write_public_checkpoint(source, tmp_path / "deeper", extra={
        "vision_tower.encoder.blocks.2.wqkv.weight": torch.zeros(96, 64)})  # a 3-block tower's key
    with pytest.raises(ValueError, match="unexpected key.*vision_tower.encoder.blocks.2.wqkv.weight"):
        load_hf_checkpoint(build(seed=1), tmp_path / "deeper")
    write_public_checkpoint(source, tmp_path / "missing", drop=("mm_projector.post_norm.weight",))
    with pytest.raises(ValueError, match="'mm_projector.post_norm.weight'.* is missing"):
        load_hf_checkpoint(build(seed=1), tmp_path / "missing")


def test_export_round_trip_carries_the_vision_config(tmp_path):
    source = build()
    export_hf_checkpoint(source, tmp_path / "out", dtype=torch.float32)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert vision_args_from_hf_config(config) == source.vision_args
    target = build(seed=3)
    load_hf_checkpoint(target, tmp_path / "out")
    tokens, pixels, grids, doc_ids = batch()
    assert torch.equal(target(tokens, pixel_values=pixels, grid_thws=grids, doc_ids=doc_ids),
                       source(tokens, pixel_values=pixels, grid_thws=grids, doc_ids=doc_ids))


def test_lora_on_the_tower_only_on_request():
    model = build()
    names = apply_lora(model, LoRASettings(8, 16.0, 0.0, ("attention", "experts")))
    assert not any(n.startswith(("vision_tower", "mm_projector")) for n in names)
    assert not any(p.requires_grad for p in model.vision_tower.parameters())
    model = build()
    names = apply_lora(model, LoRASettings(8, 16.0, 0.0, ("vision_tower", "projector")))
    assert "vision_tower.encoder.blocks.0.wqkv" in names and "mm_projector.proj.2" in names
    reset_adapters(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    tokens, pixels, grids, doc_ids = batch()
    hidden = model(tokens, pixel_values=pixels, grid_thws=grids, doc_ids=doc_ids, return_hidden=True)
    LinearCrossEntropyLoss(16)(model.output, hidden, torch.randint(0, 2048, (2, 25)), 50.0).backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained == {n for n, _ in model.named_parameters() if "lora_" in n}
    assert any(n.startswith("vision_tower.") for n in trained)


def test_seeded_init_of_the_image_text_model_with_adapters_matches_init_weights():
    """The layout-independent initialiser (training/setup/seeded_init.py) draws the tower, projector and LoRA factors
    from the distributions their init_weights / reset_lora_parameters use."""
    from titan_kimi.models.kimi_k3.init_specs import init_specs
    from titan_kimi.training.setup.seeded_init import init_weights_seeded

    targets = ("attention", "experts", "lm_head", "vision_tower", "projector")
    reference = build()
    apply_lora(reference, LoRASettings(8, 16.0, 0.0, targets))
    reset_adapters(reference)
    with torch.device("meta"):
        ours = KimiK3VLModel(reference.args, reference.vision_args)
    apply_lora(ours, LoRASettings(8, 16.0, 0.0, targets))
    ours.to_empty(device="cpu")
    init_weights_seeded(ours, 7)
    specs = init_specs(ours)
    assert set(specs) == set(dict(ours.named_parameters()))
    for key, want in reference.state_dict().items():
        got = ours.state_dict()[key]
        if not specs[key].random:
            assert torch.equal(got, want), key
        elif specs[key].kind == "uniform":
            assert specs[key].low <= got.min().item() and got.max().item() <= specs[key].high, key
        if specs[key].random and got.numel() >= 512:
            assert got.std().item() == pytest.approx(want.std().item(), rel=0.1), key
    assert (ours.vision_tower.encoder.blocks[0].norm0.weight == 1).all()
    assert not ours.output.lora_B.weight.any() and ours.layers["1"].moe.experts.lora_A_w13.any()
