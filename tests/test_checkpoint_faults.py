"""CheckpointManager under bad checkpoints and faults: every one gets a message naming what it must, and nothing
resumes silently from the wrong weights."""

from __future__ import annotations

import errno
import os
import re

import pytest
import torch
from torch.distributed.checkpoint import filesystem

from titan_kimi.checkpoint import CheckpointManager, training_state
from titan_kimi.checkpoint.model_identity import MODEL_ARGS_FILE
from titan_kimi.models.kimi_k3 import KimiK3Model, model_args_for


def make_model(flavor: str = "k3_debug", seed: int = 0) -> KimiK3Model:
    torch.manual_seed(seed)
    model = KimiK3Model(model_args_for(flavor, n_layers=4))
    model.init_weights()
    return model


def full_state(model: KimiK3Model) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return training_state(model, optimizer, rng=False)


def weights(model: KimiK3Model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_step_folder_without_metadata_is_replaced_not_skipped(tmp_path):
    ckpt = CheckpointManager(tmp_path, interval=1)
    (tmp_path / "step-2").mkdir()
    (tmp_path / "step-2" / "__0_0.distcp").write_bytes(b"left over")
    model = make_model()
    assert ckpt.save(2, {"model": model})
    assert ckpt.steps() == [2] and (tmp_path / "step-2" / ".metadata").is_file()
    fresh = make_model(seed=1)
    assert ckpt.load({"model": fresh}) == 2
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_resuming_an_older_step_supersedes_the_newer_ones_at_the_first_save(tmp_path):
    old_run = make_model(seed=0)
    ckpt = CheckpointManager(tmp_path, interval=1, keep_latest_k=0)
    for step in (1, 2, 3):
        ckpt.save(step, {"model": old_run})
    new_run = make_model(seed=5)
    resumed = CheckpointManager(tmp_path, interval=1, keep_latest_k=0, load_step=1)
    assert resumed.load({"model": new_run}) == 1
    assert resumed.steps() == [1, 2, 3]  # loading alone moves nothing
    with torch.no_grad():
        next(new_run.parameters()).add_(1.0)  # the new timeline diverges
    expected = weights(new_run)
    resumed.save(2, {"model": new_run})
    assert resumed.steps() == [1, 2]  # the old step 3 is out of the resume path ...
    aside = sorted(p.name for p in tmp_path.iterdir() if ".superseded-" in p.name)
    assert [name.split(".")[0] for name in aside] == ["step-2", "step-3"]  # ... kept, not deleted
    probe = make_model(seed=9)
    assert CheckpointManager(tmp_path).load({"model": probe}) == 2  # the new run's step 2, not the old one
    assert all(torch.equal(probe.state_dict()[k], v) for k, v in expected.items())


def test_corrupt_metadata_names_the_file(tmp_path):
    ckpt = CheckpointManager(tmp_path, interval=1)
    model = make_model()
    ckpt.save(1, {"model": model})
    ckpt.save(2, {"model": model})
    (tmp_path / "step-2" / ".metadata").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(ValueError, match=r"checkpoint metadata .*step-2/\.metadata cannot be read \(\w+Error.*"
                                         r"checkpoint\.load_step = one of the other steps \[1\]"):
        ckpt.load({"model": model})


def test_a_k31_checkpoint_does_not_resume_into_a_k3_model(tmp_path):
    ckpt = CheckpointManager(tmp_path, interval=1)
    ckpt.save(1, {"model": make_model("k31_debug")})
    k3 = make_model("k3_debug")
    with pytest.raises(ValueError, match=r"(?s)holds a different model than this run builds .*index_n_heads: 2 in the "
                                         r"checkpoint, 0 in this model.*model\.flavor"):
        ckpt.load({"model": k3})
    os.remove(tmp_path / "step-1" / MODEL_ARGS_FILE)  # a step saved before model args were recorded
    with pytest.raises(ValueError, match=r"holds \d+ model key\(s\) this model does not have: "
                                         r"'layers\.3\.attention\.indexer\.\w+.*loading would drop them"):
        ckpt.load({"model": k3})


def test_a_model_with_more_keys_than_the_checkpoint_names_them(tmp_path):
    ckpt = CheckpointManager(tmp_path, interval=1)
    ckpt.save(1, {"model": make_model("k3_debug")})
    os.remove(tmp_path / "step-1" / MODEL_ARGS_FILE)
    with pytest.raises(ValueError, match=r"lacks \d+ key\(s\) of this model: 'layers\.3\.attention\.indexer"):
        ckpt.load({"model": make_model("k31_debug")})


def test_model_only_steps_are_not_resumed(tmp_path):
    model = make_model()
    state = full_state(model)
    ckpt = CheckpointManager(tmp_path, interval=1, keep_latest_k=0)
    ckpt.save(2, state)
    ckpt.save(3, {"model": model})  # a model-only final save
    assert CheckpointManager(tmp_path).load(state) == 2  # the newest resumable step
    with pytest.raises(ValueError, match=r"step-3 holds only \['model'\], not \['optimizer'\] .*resumable steps: "
                                         r"\[2\].*checkpoint\.load_step"):
        CheckpointManager(tmp_path, load_step=3).load(state)
    only = CheckpointManager(tmp_path / "only", interval=1)
    only.save(5, {"model": model})
    with pytest.raises(ValueError, match=r"no checkpoint in .* can be resumed: steps \[5\] hold only the model.*"
                                         r"checkpoint\.initial_load_path = '.*step-5'"):
        only.load(state)


def test_disk_full_mid_save_says_so_and_keeps_the_previous_step(tmp_path, monkeypatch):
    model = make_model()
    ckpt = CheckpointManager(tmp_path, interval=1)
    ckpt.save(1, {"model": model})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(filesystem, "_write_item", full)
    with pytest.raises(RuntimeError, match=r"(?s)save of step 2 failed; the previous checkpoints \[1\] are intact.*"
                                           r"no space left on the device holding .* free now"):
        ckpt.save(2, {"model": model})
    monkeypatch.undo()
    assert CheckpointManager(tmp_path).load({"model": make_model(seed=3)}) == 1


def test_an_interrupted_replacement_is_put_back(tmp_path):
    ckpt = CheckpointManager(tmp_path, interval=1)
    model = make_model()
    ckpt.save(4, {"model": model})
    os.replace(tmp_path / "step-4", tmp_path / "step-4.replaced")  # killed between the two renames
    assert ckpt.steps() == []
    assert ckpt.load({"model": make_model(seed=2)}) == 4
    assert ckpt.steps() == [4]


def test_non_finite_weights_are_caught_on_load(tmp_path):
    model = make_model()
    with torch.no_grad():
        model.layers["2"].attention.o_proj.weight[0, 0] = float("nan")
    ckpt = CheckpointManager(tmp_path, interval=1)
    ckpt.save(1, {"model": model})
    with pytest.raises(ValueError, match=r"step-1: model key 'layers\.2\.attention\.o_proj\.weight' holds 1 non-finite"):
        ckpt.load({"model": make_model(seed=1)})


def test_initial_load_of_a_dcp_step_checks_the_model(tmp_path):
    from titan_kimi.checkpoint import load_model_weights

    CheckpointManager(tmp_path, interval=1).save(1, {"model": make_model("k31_debug")})
    with pytest.raises(ValueError, match=r"(?s)DCP checkpoint .*step-1 holds a different model .*index_n_heads: 2"):
        load_model_weights(make_model("k3_debug"), tmp_path / "step-1")
    (tmp_path / "step-1" / ".metadata").write_bytes(b"")
    with pytest.raises(ValueError, match=r"DCP metadata .*step-1/\.metadata cannot be read"):
        load_model_weights(make_model("k31_debug"), tmp_path / "step-1")


def test_resuming_with_another_number_of_ranks_restarts_only_the_random_streams(tmp_path, monkeypatch, caplog):
    """Model, optimizer and data position reshard to another layout; a rank the checkpoint has no RNG streams
    for continues from the seed and says so. Other per-rank state cannot move and is named."""
    import titan_kimi.checkpoint.dcp_states as dcp_states
    import titan_kimi.checkpoint.manager as manager_module
    from titan_kimi.checkpoint import RankLocal

    model = make_model()
    state = training_state(model, torch.optim.AdamW(model.parameters()), rng=True)
    CheckpointManager(tmp_path, interval=1).save(1, state)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    monkeypatch.setattr(dcp_states, "global_rank", lambda: 1)  # rank 1 of a run that now has two ranks
    monkeypatch.setattr(manager_module, "global_rank", lambda: 1)
    with caplog.at_level("WARNING", logger="titan_kimi"):
        assert CheckpointManager(tmp_path).load(state) == 1
    assert "holds no RNG state for rank 1" in caplog.text
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())

    class Counter:
        def state_dict(self):
            return {"n": 3}

        def load_state_dict(self, state):
            pass

    monkeypatch.setattr(dcp_states, "global_rank", lambda: 0)
    monkeypatch.setattr(manager_module, "global_rank", lambda: 0)
    CheckpointManager(tmp_path / "b", interval=1).save(1, {"model": model, "counter": RankLocal(Counter())})
    monkeypatch.setattr(dcp_states, "global_rank", lambda: 1)
    monkeypatch.setattr(manager_module, "global_rank", lambda: 1)
    with pytest.raises(ValueError, match=r"holds the per-rank 'counter' state of ranks \[0\], not of rank 1: it was "
                                         r"saved by 1 rank\(s\); resume it with the same number of data-parallel"):
        CheckpointManager(tmp_path / "b").load({"model": model, "counter": RankLocal(Counter())})


def test_disk_full_during_an_hf_export_says_so_and_replaces_nothing(tmp_path, monkeypatch):
    import titan_kimi.checkpoint.hf_writer as hf_writer
    from titan_kimi.checkpoint import export_hf_checkpoint

    model = make_model()
    out = export_hf_checkpoint(model, tmp_path / "hf", dtype=torch.float32)
    before = sorted(p.name for p in out.iterdir())

    def full(*args, **kwargs):
        raise RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space "
                           "left on device\" })")  # what safetensors raises

    monkeypatch.setattr(hf_writer, "save_file", full)
    with pytest.raises(RuntimeError, match=r"HF export to .*hf failed, nothing was replaced: no space left on the "
                                           r"device holding"):
        export_hf_checkpoint(model, out, dtype=torch.float32, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == before and not (tmp_path / ".hf.tmp").exists()


def tree(folder) -> dict[str, tuple[int, int]]:
    """Every path under ``folder`` with its size and modification time: what "nothing on disk changed" compares."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def cut_tail(step_dir, nbytes: int = 65536) -> str:
    """Truncate the step's data file by its last ``nbytes`` (where DCP wrote the optimizer's last moments and the
    RNG tensors, after the model's), as a full disk or a cut copy leaves it; returns the file's name."""
    (data,) = step_dir.glob("*.distcp")
    os.truncate(data, data.stat().st_size - nbytes)
    return data.name


def test_a_truncated_data_file_names_the_file_and_the_newest_intact_step_and_changes_nothing(tmp_path):
    model = make_model()
    state = training_state(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ckpt = CheckpointManager(tmp_path, interval=1, keep_latest_k=0)
    for step in (1, 2):
        ckpt.save(step, state)
    name = cut_tail(tmp_path / "step-2")
    before = tree(tmp_path)
    with pytest.raises(ValueError, match=rf"(?s)checkpoint .*step-2 is damaged: .*step-2/{name} is \d+ bytes, but "
                                         r"the step's metadata places data up to byte \d+ in it: it was cut short .*"
                                         r"'optimizer' and 'rng' entries\. Nothing was loaded or moved\. The newest "
                                         r"intact step is .*step-1: resume from it with checkpoint\.load_step = 1 "
                                         r".*model weights of step-2 are whole: checkpoint\.initial_load_path"):
        CheckpointManager(tmp_path).load(state)
    assert tree(tmp_path) == before
    assert CheckpointManager(tmp_path).load({"model": make_model(seed=4)}) == 2  # its weights alone are whole
    assert CheckpointManager(tmp_path, load_step=1).load(state) == 1
    os.remove(tmp_path / "step-1" / name)  # a deleted file: no step is intact now
    with pytest.raises(ValueError, match=r"step-2 is damaged: .*No other step in .* is intact and resumable"):
        CheckpointManager(tmp_path).load(state)


def test_damage_inside_a_data_file_names_the_step(tmp_path):
    model = make_model()
    ckpt = CheckpointManager(tmp_path, interval=1)
    ckpt.save(3, {"model": model})
    (data,) = (tmp_path / "step-3").glob("*.distcp")
    with open(data, "r+b") as f:  # the length is right, the bytes of the first saved item are not
        f.write(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"checkpoint .*step-3 is damaged: a data file of it cannot be read "
                                         r"\(\w+Error: .*\)\. No other step"):
        ckpt.load({"model": make_model(seed=1)})


def test_the_trainer_exits_2_on_a_truncated_checkpoint_and_changes_nothing(tmp_path, capsys):
    from resume_runs import build
    from titan_kimi.trainer import main
    from titan_kimi.training.process.exit_codes import EXIT_BAD_INPUT, run_cli

    argv = ["--job.config_file", "train_configs/k31_debug.toml", "--training.seq_len", "32",
            "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "1", "--training.steps", "3",
            "--checkpoint.enable", "true", "--job.dump_folder", str(tmp_path)]
    trainer = build(tmp_path, argv)
    for step in (1, 2):  # the run's own state as saved at two steps (untrained weights are enough)
        trainer.checkpointer.save(step, trainer.train_state, force=True)
    trainer.close()
    name = cut_tail(tmp_path / "checkpoint" / "step-2")
    before = tree(tmp_path)
    assert run_cli(main, argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(rf"titan_kimi\.train: error: checkpoint .*step-2 is damaged: .*step-2/{name} is \d+ bytes.* The "
                     r"newest intact step is .*step-1: resume from it with checkpoint\.load_step = 1", err), err
    assert tree(tmp_path) == before
