"""from_pretrained: one call from an HF folder to a ready model; HF-style attention masks as doc_ids."""

from __future__ import annotations

import pytest
import torch

from titan_kimi import from_pretrained
from titan_kimi.checkpoint import CheckpointManager, export_hf_checkpoint
from titan_kimi.models.kimi_k3 import KimiK3Model, model_args_for


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(3)
    model = KimiK3Model(model_args_for("k31_debug"))
    model.init_weights()
    return model.eval()


def test_from_pretrained_builds_the_model_of_config_json(tmp_path, trained):
    path = export_hf_checkpoint(trained, tmp_path / "hf", dtype=torch.float32)
    model = from_pretrained(path, dtype="float32")
    assert not model.training and model.args.index_n_heads == trained.args.index_n_heads
    for key, value in trained.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens), trained(tokens))
    bf16 = from_pretrained(path)  # default dtype bfloat16; the fp32-by-design parameters stay fp32
    assert bf16.output.weight.dtype == torch.bfloat16
    assert bf16.layers["0"].attention.decay.A_log.dtype == torch.float32


def test_from_pretrained_errors_name_the_path(tmp_path, trained):
    path = export_hf_checkpoint(trained, tmp_path / "hf", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"dtype 'float16' is not supported; valid: \['bfloat16', 'float32'\]"):
        from_pretrained(path, dtype="float16")
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match=r"no config.json at '.*hf/config.json'"):
        from_pretrained(path)
    CheckpointManager(tmp_path / "ckpt", interval=1).save(1, {"model": trained})
    with pytest.raises(ValueError, match=r"step-1' is a DCP checkpoint; from_pretrained reads HF folders"):
        from_pretrained(tmp_path / "ckpt" / "step-1")


@pytest.mark.parametrize("side", ["right", "left"])
def test_an_hf_attention_mask_is_the_doc_ids_of_one_document_per_row(trained, side):
    """docs/checkpoints.md: ``doc_ids = attention_mask`` (1 = token, 0 = padding); padded rows give the unpadded logits."""
    g = torch.Generator().manual_seed(1)
    lengths = (16, 11)
    rows = [torch.randint(1, 2048, (n,), generator=g) for n in lengths]
    tokens = torch.zeros(2, 16, dtype=torch.long)
    mask = torch.zeros(2, 16, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(0, len(row)) if side == "right" else slice(16 - len(row), 16)
        tokens[i, span], mask[i, span] = row, 1
    with torch.no_grad():
        padded = trained(tokens, doc_ids=mask)
        for i, row in enumerate(rows):
            alone = trained(row.unsqueeze(0))[0]
            got = padded[i][mask[i].bool()]
            torch.testing.assert_close(got, alone, rtol=1e-4, atol=1e-4)
