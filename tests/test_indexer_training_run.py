"""Indexer training through the train loop and checkpoints: resume in either mode, a mode change refused on
resume, a K3 checkpoint given a fresh indexer (HF and DCP), the warm-up trains the indexer alone, and the HF
export carries the trained indexer into the sparse stage."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan_kimi.checkpoint import export_hf_checkpoint, load_model_weights
from titan_kimi.checkpoint.dcp_states import ModelState
from titan_kimi.checkpoint.model_identity import write_model_args
from titan_kimi.models.kimi_k3 import KimiK3Model, model_args_for

from test_train_resume import straight_and_resumed, trainer

LONG = ["--training.seq_len", "64", "--metrics.log_freq", "1"]  # documents longer than k31_debug's top-32


@pytest.mark.parametrize("mode", ["warmup", "sparse"])
def test_resume_in_either_mode_is_bit_identical_to_an_uninterrupted_run(tmp_path, monkeypatch, mode):
    expected, resumed, straight, second = straight_and_resumed(tmp_path, monkeypatch, "--indexer.mode", mode, *LONG)
    assert resumed == expected
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), second.model.state_dict().items()):
        assert torch.equal(a, b), name
    kl = [m.indexer_kl for m in straight.metrics.history]
    assert all(k is not None and k > 0 for k in kl), kl
    assert [m.indexer_kl for m in second.metrics.history] == kl[2:]


def test_a_resume_in_another_mode_is_refused_naming_both_and_the_way_to_start_a_stage(tmp_path):
    first = trainer(tmp_path, "--indexer.mode", "warmup", *LONG, "--training.steps", "2")
    first.train()
    first.close()
    with pytest.raises(ValueError, match=r"saved with indexer.mode = 'warmup', and this run has 'sparse'.*"
                                         r"checkpoint.initial_load_path = '.*step-2'"):
        trainer(tmp_path, "--indexer.mode", "sparse", *LONG)


def k3_model(seed: int) -> KimiK3Model:
    torch.manual_seed(seed)
    model = KimiK3Model(model_args_for("k3_debug"))
    model.init_weights()
    return model


@pytest.mark.parametrize("fmt", ["hf", "dcp"])
def test_a_k3_checkpoint_loads_into_a_model_given_an_indexer_which_keeps_its_initialisation(tmp_path, fmt):
    source = k3_model(seed=1)
    if fmt == "hf":
        export_hf_checkpoint(source, tmp_path, dtype=torch.float32)
    else:
        dcp.save({"model": ModelState(source)}, checkpoint_id=str(tmp_path))
        write_model_args(tmp_path, source.args)
    torch.manual_seed(2)
    target = KimiK3Model(model_args_for("k31_debug", index_training="warmup"))
    target.init_weights()
    fresh = {k: v.clone() for k, v in target.state_dict().items() if ".indexer." in k}
    with pytest.raises(ValueError):  # without model.add_indexer the missing indexer is an error
        load_model_weights(target, tmp_path)
    assert load_model_weights(target, tmp_path, indexer_optional=True) == fmt
    state, want = target.state_dict(), source.state_dict()
    assert set(state) - set(want) == set(fresh)
    assert all(torch.equal(state[k], v) for k, v in want.items())
    assert all(torch.equal(state[k], v) for k, v in fresh.items())


def test_k3_warmup_with_an_added_indexer_trains_it_alone_and_its_hf_export_starts_the_sparse_stage(tmp_path):
    base = tmp_path / "k3"
    export_hf_checkpoint(k3_model(seed=3), base, dtype=torch.float32)
    k3 = ["--model.flavor", "k3_debug", "--model.add_indexer", "true", *LONG]
    warm = trainer(tmp_path / "warmup", *k3, "--indexer.mode", "warmup", "--checkpoint.initial_load_path", str(base),
                   "--checkpoint.last_save_in_hf", "true", "--checkpoint.last_save_model_only", "true",
                   "--checkpoint.export_dtype", "float32")
    before = {k: v.clone() for k, v in warm.model.state_dict().items()}
    warm.train()
    after = warm.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".indexer." in k for k in changed), sorted(changed)[:4]
    assert all(m.indexer_recall is not None for m in warm.metrics.history)
    export = tmp_path / "warmup" / "checkpoint" / f"hf-step-{warm.step}"
    config = json.loads((export / "config.json").read_text())["text_config"]
    assert config["index_n_heads"] == 2 and config["index_topk"] == 32
    sparse = trainer(tmp_path / "sparse", *k3, "--indexer.mode", "sparse", "--checkpoint.initial_load_path",
                     str(export), "--training.steps", "1")
    loaded = sparse.model.state_dict()
    assert all(torch.equal(loaded[k], after[k]) for k in after)
