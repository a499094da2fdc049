"""Resume through the train loop: on a GPU within bf16 noise; the final HF export; extending a run whose last save
holds only the model. Bit-exact resumes on CPU, through every way a run ends: tests/test_resume_exactness.py."""

import pytest
import torch

from titan_kimi.trainer import Trainer
from titan_kimi.config import load_job_config
from titan_kimi.training.process.distributed import DistEnv
from titan_kimi.parallel.layout import resolve_layout
from titan_kimi.training.setup.build import model_args_from_config


def trainer(folder, *extra):
    cfg = load_job_config([
        "--job.config_file", "train_configs/k31_debug.toml", "--training.steps", "4", "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--job.dump_folder", str(folder), "--checkpoint.enable",
        "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false", "--lr_scheduler.warmup_steps", "1",
        *extra,
    ])
    args = model_args_from_config(cfg)
    return Trainer(cfg, args, resolve_layout(cfg, 1, args), DistEnv(0, 1, 0))


class Crash(Exception):
    pass


def straight_and_resumed(tmp_path, monkeypatch, *extra):
    """Losses and final trainers of a 4-step run and of one that crashes in step 3 and resumes from step 2."""
    straight = trainer(tmp_path / "straight", *extra)
    straight.train()
    first = trainer(tmp_path / "resumed", *extra)
    real_step = first.train_step

    def step_then_crash(data_iter):
        if first.step == 3:
            raise Crash  # dies during step 3, after the step-2 checkpoint
        return real_step(data_iter)

    monkeypatch.setattr(first, "train_step", step_then_crash)
    with pytest.raises(Crash):
        first.train()
    assert first.checkpointer.steps() == [2]
    second = trainer(tmp_path / "resumed", *extra)
    assert second.step == 2
    second.train()
    resumed = [m.loss for m in first.metrics.history] + [m.loss for m in second.metrics.history]
    return [m.loss for m in straight.metrics.history], resumed, straight, second


@pytest.mark.gpu
def test_resume_on_gpu_matches_within_bf16_tolerance(tmp_path, monkeypatch):
    """GPU kernels accumulate with atomics (sparse MLA backward), so runs agree to bf16 noise, not bits."""
    expected, resumed, straight, second = straight_and_resumed(tmp_path, monkeypatch, "--model.dtype", "bfloat16",
                                                               "--training.mixed_precision", "false")
    assert next(straight.model.parameters()).is_cuda
    assert resumed == pytest.approx(expected, rel=2e-2)
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), second.model.state_dict().items()):
        assert ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)) < 2e-2, name


def test_final_hf_export_and_initial_load(tmp_path):
    run = trainer(tmp_path / "export", "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only", "true",
                  "--checkpoint.export_dtype", "float32")
    run.train()
    hf = tmp_path / "export" / "checkpoint" / "hf-step-4"
    assert (hf / "model.safetensors.index.json").is_file() and (hf / "config.json").is_file()
    fresh = trainer(tmp_path / "fresh", "--checkpoint.initial_load_path", str(hf))
    for (name, a), (_, b) in zip(run.model.state_dict().items(), fresh.model.state_dict().items()):
        assert torch.equal(a, b), name


def test_extending_a_run_whose_final_save_holds_only_the_model_resumes_its_last_interval_save(tmp_path):
    """A model-only final save (step 3) is passed over for the newest resumable step (2); the extended run then
    equals the uninterrupted one (the constant schedule makes the 3- and 4-step runs' lrs equal)."""
    first_steps, resumed_at = 3, 2
    common = ("--lr_scheduler.decay_type", "constant", "--checkpoint.last_save_model_only", "true")
    straight = trainer(tmp_path / "straight", *common)
    straight.train()
    short = trainer(tmp_path / "extended", *common, "--training.steps", str(first_steps))
    short.train()
    assert short.checkpointer.steps()[-1] == first_steps
    extended = trainer(tmp_path / "extended", *common)
    assert extended.step == resumed_at
    extended.train()
    losses = [m.loss for m in short.metrics.history][:resumed_at] + [m.loss for m in extended.metrics.history]
    assert losses == [m.loss for m in straight.metrics.history]
