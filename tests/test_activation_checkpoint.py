"""Activation checkpointing (full, every N-th block, per-op selective, mixers) changes memory, not the math."""

from collections import Counter

import pytest
import torch

from titan_kimi.checkpoint.destinations import canonical_fqn
from titan_kimi.models.kimi_k3 import KimiK3Model, model_args_for
from titan_kimi.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_kimi.training.loss import LinearCrossEntropyLoss


def loss_and_grads(mode, option, uncheckpointed=0):
    torch.manual_seed(0)
    model = KimiK3Model(model_args_for("k31_debug", index_topk=8))
    model.init_weights()
    apply_activation_checkpointing(model, mode, option, uncheckpointed)
    tokens = torch.randint(0, 2048, (2, 24))
    doc_ids = torch.tensor([[1] * 24, [1] * 10 + [2] * 14])
    hidden = model(tokens, doc_ids=doc_ids, return_hidden=True)
    loss = LinearCrossEntropyLoss(512)(model.output, hidden, tokens, 48.0)
    loss.backward()
    grads = {canonical_fqn(n): p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, model


@pytest.mark.parametrize("mode, option, uncheckpointed, wrapped_count",
                         [("full", "op", 0, 8), ("selective", "op", 0, 8), ("selective", "2", 0, 4),
                          ("selective", "mixers", 0, 8), ("full", "op", 3, 5), ("selective", "mixers", 2, 6)])
def test_checkpointed_blocks_give_the_same_loss_and_gradients(mode, option, uncheckpointed, wrapped_count):
    loss, grads, _ = loss_and_grads("none", "op")
    ckpt_loss, ckpt_grads, model = loss_and_grads(mode, option, uncheckpointed)
    wrapped = [type(b).__name__ for b in model.layers.values()]
    assert wrapped.count("CheckpointWrapper") == wrapped_count
    if uncheckpointed:  # the blocks left out are the stage's last: their backward runs first
        assert "CheckpointWrapper" not in wrapped[-uncheckpointed:]
    assert torch.equal(loss, ckpt_loss)
    assert grads.keys() == ckpt_grads.keys()
    for name in grads:
        assert torch.allclose(grads[name], ckpt_grads[name], rtol=1e-5, atol=1e-7), name


def test_which_blocks_are_checkpointed():
    from titan_kimi.parallel.activation_checkpoint import checkpointed_blocks

    assert checkpointed_blocks(5, "full", "op") == [True] * 5
    assert checkpointed_blocks(5, "full", "op", 2) == [True, True, True, False, False]
    assert checkpointed_blocks(3, "selective", "mixers", 7) == [False] * 3  # more than the stage holds: none
    assert checkpointed_blocks(5, "selective", "2") == [True, False, True, False, True]
    assert checkpointed_blocks(4, "none", "op") == [False] * 4


def count_runs(monkeypatch, option):
    """How many times each token mixer's implementation ran in one step (a kept output is not run again) and
    how many times a linear layer ran (the checkpoints' recompute included)."""
    from lowerings.ops.indexer_topk import indexer_topk_op
    from lowerings.ops.kda import kda_op
    from lowerings.ops.sparse_mla import sparse_mla_op

    runs = Counter()
    for name, op in (("kda", kda_op), ("sparse_mla", sparse_mla_op), ("indexer_topk", indexer_topk_op)):
        def counted(*args, _name=name, _run=op._backend_fns[None], **kwargs):
            runs[_name] += 1
            return _run(*args, **kwargs)
        monkeypatch.setitem(op._backend_fns, None, counted)  # the custom op's implementation, read at dispatch
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda module, *_: runs.update(["linear"]) if isinstance(module, torch.nn.Linear) else None)
    try:
        loss_and_grads("full" if option == "full" else "selective", option)
    finally:
        hook.remove()
        monkeypatch.undo()
    return runs


def test_mixers_checkpointing_recomputes_everything_but_the_token_mixers(monkeypatch):
    """k31_debug has KDA and DSA layers: under "mixers" each mixer runs once (its outputs kept) where full
    checkpointing runs it twice, while every linear layer runs in the forward and again in the recompute."""
    full, mixers = count_runs(monkeypatch, "full"), count_runs(monkeypatch, "mixers")
    kda_layers = sum(1 for i in range(8) if model_args_for("k31_debug").is_kda_layer(i))
    assert 0 < kda_layers < 8
    names, layers = ("kda", "sparse_mla", "indexer_topk"), (kda_layers, 8 - kda_layers, 8 - kda_layers)
    assert [full[n] for n in names] == [2 * n for n in layers]
    assert [mixers[n] for n in names] == list(layers)
    assert mixers["linear"] == full["linear"] > 0


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


EXCHANGES_UNDER_CHECKPOINT = """
import sys
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from titan_kimi.parallel.activation_checkpoint import _op_policy

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
calls = []


class CountExchanges(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func == torch.ops._c10d_functional.all_to_all_single.default:
            calls.append(func)
        return func(*args, **(kwargs or {}))


def block(x):
    rows = all_to_all_single_autograd(x * 2, None, None, dist.group.WORLD)
    return (rows * rows).sum()  # the product keeps the exchanged rows for its backward


for name, context in (("full", None), ("op", _op_policy)):
    calls.clear()
    x = torch.randn(4, 3, requires_grad=True)
    with CountExchanges():
        kwargs = {"context_fn": context} if context else {}
        checkpoint(block, x, use_reentrant=False, **kwargs).backward()
    assert torch.allclose(x.grad, 8 * x.detach()), name
    print(name, len(calls))
dist.destroy_process_group()
"""


def test_per_op_checkpointing_repeats_no_expert_exchange():
    """The forward's exchange and the backward's reverse one, and under full checkpointing the recompute's third;
    per-op selective checkpointing keeps the exchanged rows (the step-time estimate counts the same)."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from titan_kimi.parallel.activation_checkpoint import saves_expert_exchanges

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", EXCHANGES_UNDER_CHECKPOINT, str(port)], cwd=root,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["full", "3", "op", "2"]
    assert saves_expert_exchanges("selective", "op")
    assert not saves_expert_exchanges("full", "op") and not saves_expert_exchanges("selective", "4")
