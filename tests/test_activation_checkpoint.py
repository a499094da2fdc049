"""Activation checkpointing (full, every N-th block, per-op selective) changes memory, not the math."""

import pytest
import torch

from titan_kimi.checkpoint.destinations import canonical_fqn
from titan_kimi.models.kimi_k3 import KimiK3Model, model_args_for
from titan_kimi.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_kimi.training.loss import LinearCrossEntropyLoss


def loss_and_grads(mode, option):
    torch.manual_seed(0)
    model = KimiK3Model(model_args_for("k31_debug", index_topk=8))
    model.init_weights()
    apply_activation_checkpointing(model, mode, option)
    tokens = torch.randint(0, 2048, (2, 24))
    doc_ids = torch.tensor([[1] * 24, [1] * 10 + [2] * 14])
    hidden = model(tokens, doc_ids=doc_ids, return_hidden=True)
    loss = LinearCrossEntropyLoss(512)(model.output, hidden, tokens, 48.0)
    loss.backward()
    grads = {canonical_fqn(n): p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, model


@pytest.mark.parametrize("mode, option", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_checkpointed_blocks_give_the_same_loss_and_gradients(mode, option):
    loss, grads, _ = loss_and_grads("none", "op")
    ckpt_loss, ckpt_grads, model = loss_and_grads(mode, option)
    wrapped = [type(b).__name__ for b in model.layers.values()]
    assert wrapped.count("CheckpointWrapper") == (4 if option == "2" else 8)
    assert torch.equal(loss, ckpt_loss)
    assert grads.keys() == ckpt_grads.keys()
    for name in grads:
        assert torch.allclose(grads[name], ckpt_grads[name], rtol=1e-5, atol=1e-7), name


def test_checkpoint_loading_sees_through_the_wrappers(tmp_path):
    from titan_kimi.checkpoint import export_hf_checkpoint, load_hf_checkpoint

    _, _, wrapped = loss_and_grads("full", "op")
    export_hf_checkpoint(wrapped, tmp_path / "hf", dtype=torch.float32)
    torch.manual_seed(1)
    fresh = KimiK3Model(wrapped.args)
    fresh.init_weights()
    apply_activation_checkpointing(fresh, "selective", "2")
    load_hf_checkpoint(fresh, tmp_path / "hf")
    ours = {canonical_fqn(n): t for n, t in wrapped.state_dict().items()}
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, ours[canonical_fqn(name)]), name
