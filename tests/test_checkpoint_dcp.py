"""CheckpointManager: bit-exact save/resume of a training run, interval and pruning, atomic saves under a crash."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint import filesystem

from titan_kimi.checkpoint import CheckpointManager, training_state
from titan_kimi.config.sections import Checkpoint
from titan_kimi.data import build_dataloader
from titan_kimi.models.kimi_k3 import KimiK3Model, model_args_for


class Run:
    """A small training run: model, AdamW, warmup LR schedule, the synthetic dataloader, RNG-consuming steps."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        self.model = KimiK3Model(model_args_for("k3_debug", n_layers=4))  # one AttnRes block: KDA x3 + MLA
        self.model.init_weights()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / 3))
        self.loader = build_dataloader("synthetic", None, None, seq_len=16, local_batch_size=2, dp_rank=0,
                                       dp_world_size=1, seed=0, shuffle=True, vocab_size=2048)
        self.batches = iter(self.loader)
        self.state = training_state(self.model, self.optimizer, self.scheduler, self.loader)

    def step(self) -> tuple[float, float]:
        batch = next(self.batches)
        logits = self.model(batch["input_ids"], doc_ids=batch["doc_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
        # Draw from every RNG the checkpoint covers, as dropout or augmentation would.
        noise = torch.rand(()).item() + random.random() + float(np.random.rand())
        (loss * (1 + 1e-3 * noise)).backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item(), noise

    def resume(self) -> None:
        self.batches = iter(self.loader)  # a new iterator starts at the restored position

    def snapshot(self) -> dict:
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optimizer": {id_: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                          for id_, s in self.optimizer.state_dict()["state"].items()},
            "lr": [g["lr"] for g in self.optimizer.param_groups],
            "scheduler": self.scheduler.state_dict(),
            "loader": self.loader.state_dict(),
        }


def assert_snapshots_equal(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optimizer"].keys() == b["optimizer"].keys() and a["optimizer"]
    for pid in a["optimizer"]:
        for k, v in a["optimizer"][pid].items():
            assert torch.equal(v, b["optimizer"][pid][k]), (pid, k)
    assert a["lr"] == b["lr"] and a["scheduler"] == b["scheduler"] and a["loader"] == b["loader"]


def manager(tmp_path, **kw) -> CheckpointManager:
    return CheckpointManager(tmp_path / "ckpt", **kw)


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_resume_is_bit_exact(tmp_path, async_mode):
    a = Run(seed=0)
    ckpt = manager(tmp_path, interval=3, async_mode=async_mode)
    for step in range(1, 4):
        a.step()
        assert ckpt.save(step, a.state) == (step == 3)
    saved = a.snapshot()
    continued = [a.step() for _ in range(3)]  # changes the model while an async save may still be writing
    ckpt.close()
    assert ckpt.steps() == [3]

    b = Run(seed=1)  # different weights and RNG streams, the data loader at its start
    assert CheckpointManager(tmp_path / "ckpt").load(b.state) == 3
    b.resume()
    assert_snapshots_equal(b.snapshot(), saved)
    assert [b.step() for _ in range(3)] == continued  # losses and RNG draws


def test_interval_force_and_keep_latest_k(tmp_path):
    run = Run(seed=2)
    ckpt = manager(tmp_path, interval=2, keep_latest_k=2)
    saved = [step for step in range(1, 8) if ckpt.save(step, run.state)]
    assert saved == [2, 4, 6]
    assert ckpt.save(7, {"model": run.model}, force=True)
    assert ckpt.save(7, run.state, force=True)  # never skipped: the model-only step 7 is replaced
    assert ckpt.steps() == [6, 7] and ckpt.load(run.state) == 7
    assert sorted(p.name for p in ckpt.folder.iterdir()) == ["step-6", "step-7"]
    keep_all = manager(tmp_path / "all", interval=1, keep_latest_k=0)
    for step in range(1, 5):
        keep_all.save(step, {"model": run.model})
    assert keep_all.steps() == [1, 2, 3, 4]


def _fail_in_write_item(monkeypatch):
    """Raise from inside DCP's file writer after two items are written (a crash mid-write)."""
    real, calls = filesystem._write_item, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            raise OSError("disk full (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_item", flaky)


def _fail_in_finish(monkeypatch):
    """Raise after all data is written, before the metadata (a crash at the very end)."""
    def finish(self, metadata, results):
        raise OSError("killed (simulated)")

    monkeypatch.setattr(filesystem.FileSystemWriter, "finish", finish)


@pytest.mark.parametrize("crash", [_fail_in_write_item, _fail_in_finish])
def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, crash):
    run = Run(seed=3)
    ckpt = manager(tmp_path, interval=1, keep_latest_k=1)
    run.step()
    ckpt.save(1, run.state)
    at_one = run.snapshot()
    run.step()
    with monkeypatch.context() as patch:
        crash(patch)
        message = r"(?s)checkpoint save of step 2 failed; the previous checkpoints \[1\] are intact.*simulated"
        with pytest.raises(RuntimeError, match=message):
            ckpt.save(2, run.state)
    assert (ckpt.folder / "step-2.tmp").is_dir()  # the partial save stays aside
    assert ckpt.steps() == [1] and ckpt.latest_step() == 1  # keep_latest_k=1 did not prune step 1

    other = Run(seed=4)
    assert CheckpointManager(ckpt.folder).load(other.state) == 1
    assert_snapshots_equal(other.snapshot(), at_one)

    run.step()
    assert ckpt.save(3, run.state)
    assert sorted(p.name for p in ckpt.folder.iterdir()) == ["step-3"]  # .tmp cleaned, step 1 pruned


def test_failed_async_save_raises_on_wait_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    run = Run(seed=5)
    ckpt = manager(tmp_path, interval=1, async_mode="async")
    ckpt.save(1, run.state)
    ckpt.wait()
    _fail_in_finish(monkeypatch)
    assert ckpt.save(2, run.state)  # started in the background
    with pytest.raises(RuntimeError, match="checkpoint async save of step 2 failed"):
        ckpt.wait()
    assert ckpt.steps() == [1]


def test_resume_picks_the_latest_complete_step(tmp_path):
    run = Run(seed=6)
    ckpt = manager(tmp_path, interval=1, keep_latest_k=0)
    snapshots = {}
    for step in (1, 2):
        run.step()
        ckpt.save(step, run.state)
        snapshots[step] = run.snapshot()
    (ckpt.folder / "step-5.tmp").mkdir()  # an interrupted save
    (ckpt.folder / "step-9").mkdir()  # a folder without DCP metadata
    assert ckpt.steps() == [1, 2]
    other = Run(seed=7)
    assert CheckpointManager(ckpt.folder).load(other.state) == 2
    assert_snapshots_equal(other.snapshot(), snapshots[2])
    assert CheckpointManager(ckpt.folder, load_step=1).load(other.state) == 1
    assert_snapshots_equal(other.snapshot(), snapshots[1])
    with pytest.raises(ValueError, match=r"no complete checkpoint step-5 .* available steps: \[1, 2\]"):
        ckpt.load(other.state, step=5)


def test_model_only_load_from_a_full_checkpoint(tmp_path):
    run = Run(seed=8)
    run.step()
    ckpt = manager(tmp_path, interval=1)
    ckpt.save(1, run.state)
    fresh = KimiK3Model(run.model.args)
    assert ckpt.load({"model": fresh}) == 1  # a bare module is wrapped; only its entries are read
    for k, v in run.model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_config_disabled_and_bad_arguments(tmp_path):
    section = Checkpoint(enable=True, folder="ck", interval=5, keep_latest_k=3, async_mode="async", load_step=7)
    ckpt = CheckpointManager.from_config(section, tmp_path)
    assert (ckpt.folder, ckpt.interval, ckpt.keep_latest_k, ckpt.async_mode, ckpt.load_step) == (
        tmp_path / "ck", 5, 3, "async", 7)
    run = Run(seed=9)
    off = CheckpointManager(tmp_path / "off", enable=False)
    assert not off.save(1, run.state, force=True) and off.load(run.state) is None
    assert not (tmp_path / "off").exists()
    assert manager(tmp_path / "empty").load(run.state) is None  # nothing to resume: a fresh start
    with pytest.raises(ValueError, match="async_mode='threads' is invalid"):
        CheckpointManager(tmp_path, async_mode="threads")
    with pytest.raises(ValueError, match="bare torch optimizer"):
        manager(tmp_path, interval=1).save(1, {"optimizer": run.optimizer})


def test_fp32_moments_of_bf16_parameters_resume_exactly(tmp_path):
    """The train loop's optimizer keeps fp32 moments for bf16 weights; torch's Optimizer.load_state_dict would
    round them to bf16, the manager keeps the saved dtype."""
    from titan_kimi.config.sections import Optimizer
    from titan_kimi.models.kimi_k3.init import cast_model_dtype
    from titan_kimi.training.optim.optimizer import build_optimizer

    def make(seed):
        torch.manual_seed(seed)
        model = cast_model_dtype(KimiK3Model(model_args_for("k3_debug", n_layers=4)), torch.bfloat16)
        model.init_weights()
        return model, build_optimizer([model], Optimizer(state_dtype="float32"))

    def step(model, opt, tokens):
        model(tokens).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    tokens = torch.randint(0, 2048, (3, 2, 8), generator=torch.Generator().manual_seed(0))
    model, opt = make(0)
    step(model, opt, tokens[0])
    ckpt = manager(tmp_path, interval=1)
    ckpt.save(1, training_state(model, opt, rng=False))
    other, other_opt = make(1)
    ckpt.load(training_state(other, other_opt, rng=False))
    saved, loaded = opt.state_dict()["state"], other_opt.state_dict()["state"]
    assert saved.keys() == loaded.keys()
    for pid in saved:
        for name, value in saved[pid].items():
            assert loaded[pid][name].dtype == value.dtype and torch.equal(loaded[pid][name], value), (pid, name)
    assert all(v["exp_avg"].dtype == torch.float32 for v in saved.values())  # for bf16 weights too
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16, torch.float32}
    for t in tokens[1:]:
        step(model, opt, t)
        step(other, other_opt, t)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))


def test_a_resume_takes_the_state_from_the_checkpoint_and_the_hyperparameters_from_this_run(tmp_path, caplog):
    """Moments and step counts come back; lr, betas, weight decay stay those the resuming run built (the trainer's
    schedule then sets the lr), also when another optimizer class saved the state (titan_kimi's Adam with bf16
    moments, resumed by torch's AdamW with fp32 moments: the moments take the new dtype)."""
    from titan_kimi.training.optim.adam_multi_tensor import MultiTensorAdam

    torch.manual_seed(0)
    saved_model = torch.nn.Linear(4, 4)
    saved = MultiTensorAdam(saved_model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            decoupled=True, state_dtype=torch.bfloat16)
    saved_model(torch.randn(2, 4)).sum().backward()
    saved.step()
    manager(tmp_path, interval=1).save(1, training_state(saved_model, saved, rng=False))
    model = torch.nn.Linear(4, 4)
    resumed = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.8, 0.9), weight_decay=0.0)
    with caplog.at_level("INFO", logger="titan_kimi"):
        assert manager(tmp_path).load(training_state(model, resumed, rng=False)) == 1
    assert "this run's hyperparameters replace the checkpoint's: betas (0.9, 0.95) -> (0.8, 0.9)" in caplog.text
    group = resumed.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (3e-4, (0.8, 0.9), 0.0)
    for param, saved_param in zip(model.parameters(), saved_model.parameters()):
        state, before = resumed.state[param], saved.state[saved_param]
        assert state["exp_avg"].dtype == torch.float32 and torch.equal(state["exp_avg"], before["exp_avg"].float())
        assert torch.equal(state["exp_avg_sq"], before["exp_avg_sq"].float()) and float(state["step"]) == 1.0
