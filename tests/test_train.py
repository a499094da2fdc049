"""The training spine end to end on CPU: dry runs, the main recipe, accumulation, non-finite gradients."""

import json
import re
import warnings

import pytest
import torch

from titan_kimi.trainer import Trainer, main
from titan_kimi.config import load_job_config
from titan_kimi.training.process.distributed import DistEnv
from titan_kimi.parallel.layout import resolve_layout
from titan_kimi.training.setup.build import model_args_from_config
from titan_kimi.training.optim.grad_clip import NonFiniteGradientError, clip_gradients

TINY = ["--model.flavor", "k31_debug", "--model.dtype", "float32", "--training.seq_len", "32",
        "--training.mixed_precision", "false", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "0",
        "--metrics.log_freq", "1"]


def run_main(capsys, *argv):
    assert main(list(argv)) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("recipe, line", [
    ("k3_hellaswag", "params total=2779484476000 active=104189612640"),
    # K3.1-Pro image-text: the text model's 2,779,819,502,176 + the 27-block tower's 401,214,464 + the
    # projector's 46,144,512; active = the text model per token.
    ("k31", "params total=2780266861152 active=104524638816 vision=447358976"),
])
def test_full_scale_recipes_pass_dry_run(capsys, recipe, line):
    out = run_main(capsys, "--job.config_file", f"train_configs/{recipe}.toml", "--job.dry_run", "--job.world_size", "256")
    assert line in out.splitlines()
    assert "dp_shard 32" in out and "pp 8" in out and "ep 32" in out
    lines = out.splitlines()
    assert "# stage 0: layers [0, 12) on pp rank 0" in lines and "# stage 7: layers [84, 93) on pp rank 7" in lines
    # FSDP32 x EP32 x PP8: each rank holds ~11.3 B parameters of the middle stages (docs/checkpoints.md table).
    assert any(line.startswith("# pp rank 1: 11.3") and "GiB" in line for line in lines), lines


def test_main_command_finds_k31_in_train_configs_and_lora_dry_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no k31.toml here: the recipe comes from train_configs/
    out = run_main(capsys, "--job.config_file", "k31.toml", "--job.dry_run", "--job.world_size", "256",
                   "--lora.enable", "true")
    assert 'dataset = "medpix"' in out and 'vision_flavor = "moonvit3d"' in out
    # rank-8 adapters: every layer's attention projections, the dense MLP, shared and per-expert routed factors
    assert "# lora: rank 8, 10917439232 trainable adapter parameters" in out


def test_dry_run_rejects_a_layout_that_does_not_fit(capsys):
    with pytest.raises(ValueError, match=r"expert_parallel_degree = 32 .*does not divide data_parallel_shard_degree \(16\)"):
        run_main(capsys, "--job.config_file", "train_configs/k3_hellaswag.toml", "--job.dry_run", "--job.world_size", "128")
    with pytest.raises(ValueError, match=r"pipeline_parallel_degree = 16 with 1 stage\(s\) per rank \(1F1B\) is 16 "
                                         r"stages, but the model's 93 layers are 8 AttnRes blocks"):
        run_main(capsys, "--job.config_file", "train_configs/k3_hellaswag.toml", "--job.dry_run",
                 "--job.world_size", "512", "--parallelism.pipeline_parallel_degree", "16")


def test_dry_run_prints_the_context_parallel_layout_and_the_activation_estimate(capsys):
    """The layout names the CP split (zigzag by default); the activation estimate halves with twice the CP ranks
    (every rank holds half the tokens; only the gathered latent and keys are per sequence)."""
    acts = {}
    for cp, layout in ((2, "zigzag"), (4, "contiguous")):
        out = run_main(capsys, *TINY, "--training.seq_len", "64", "--training.local_batch_size", "2", "--job.dry_run",
                       "--job.world_size", str(cp), "--parallelism.context_parallel_degree", str(cp),
                       "--parallelism.context_parallel_layout", layout, "--job.estimate_activations")
        assert f"# layout: world {cp} = dp_replicate 1 x dp_shard 1 x cp {cp} ({layout}) x pp 1" in out
        line = next(line for line in out.splitlines() if line.startswith("# every rank: activations"))
        assert f"for 2 x {64 // cp} local tokens of 64 (cp {cp} {layout}, activation_checkpoint none)" in line
        acts[cp] = float(re.search(r"activations ([\d.e+-]+) GiB", line).group(1))
    assert 0 < acts[4] < acts[2]
    with pytest.raises(Exception, match="job.estimate_activations = true .* is measured by a dry run only"):
        run_main(capsys, *TINY, "--job.estimate_activations")


def read_metrics(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_metrics_jsonl_has_every_field_and_summary(tmp_path, capsys):
    out = run_main(capsys, *TINY, "--training.steps", "3", "--training.local_batch_size", "2",
                   "--job.dump_folder", str(tmp_path))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("loss", "grad_norm", "lr", "tokens_per_sec", "mfu", "peak_mem_gib", "step_time"):
        assert all(isinstance(r[key], float) for r in rows), key
    assert re.search(r"summary: steps=3 first_loss=\d", out)


def test_gradient_accumulation_matches_one_big_batch(tmp_path, capsys):
    base = [*TINY, "--training.steps", "3", "--data.shuffle", "false"]
    run_main(capsys, *base, "--training.local_batch_size", "4", "--job.dump_folder", str(tmp_path / "big"))
    run_main(capsys, *base, "--training.local_batch_size", "2", "--training.global_batch_size", "4",
             "--job.dump_folder", str(tmp_path / "accum"))
    big, accum = read_metrics(tmp_path / "big"), read_metrics(tmp_path / "accum")
    assert big[0]["loss"] == pytest.approx(accum[0]["loss"], rel=1e-6)
    assert big[0]["grad_norm"] == pytest.approx(accum[0]["grad_norm"], rel=1e-6)
    # After an update the runs drift at fp32 noise level: Adam's first steps move every weight by about
    # lr * sign(grad), so gradients that are ~0 flip sign between summation orders.
    for a, b in zip(big[1:], accum[1:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)


def make_trainer(tmp_path, *extra):
    cfg = load_job_config([*TINY, "--training.steps", "2", "--training.local_batch_size", "2",
                           "--job.dump_folder", str(tmp_path), *extra])
    args = model_args_from_config(cfg)
    return Trainer(cfg, args, resolve_layout(cfg, 1, args), DistEnv(0, 1, 0))


def poison(trainer, name):
    param = dict(trainer.model.named_parameters())[name]
    param.register_hook(lambda g: torch.full_like(g, float("nan")))
    return param


def test_nonfinite_gradients_skip_the_step(tmp_path):
    trainer = make_trainer(tmp_path, "--training.nonfinite_grad_policy", "skip")
    param = poison(trainer, "layers.1.attention.q_proj.weight")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    # The schedule advances without an optimizer step on purpose; torch's warning about it is filtered.
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert all(m.skipped for m in trainer.metrics.history)
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert param.grad is None


def test_nonfinite_gradients_stop_naming_the_parameter(tmp_path):
    trainer = make_trainer(tmp_path, "--training.nonfinite_grad_policy", "stop")
    poison(trainer, "layers.3.attention.kv_b_proj.weight")
    with pytest.raises(NonFiniteGradientError, match=r"layers\.3\.attention\.kv_b_proj\.weight"):
        trainer.train()


def test_clip_gradients_reports_after_clipping_overflow():
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.tensor([3e38, 3e38, 0.0, 0.0])  # the norm overflows fp32 although every entry is finite
    result = clip_gradients([("w", p)], max_norm=1.0)
    assert not result.finite and "norm overflowed" in result.report
    q = torch.nn.Parameter(torch.ones(2))
    q.grad = torch.tensor([3.0, 4.0])
    ok = clip_gradients([("q", q)], max_norm=1.0)
    assert ok.finite and ok.grad_norm == pytest.approx(5.0) and q.grad.norm().item() == pytest.approx(1.0, rel=1e-5)


def test_validation_and_tensorboard(tmp_path, capsys):
    run_main(capsys, *TINY, "--training.steps", "4", "--training.local_batch_size", "2",
             "--validation.enable", "--validation.freq", "2", "--validation.steps", "2",
             "--metrics.enable_tensorboard", "--job.dump_folder", str(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    validation = [r for r in rows if "validation_loss" in r]
    assert [r["step"] for r in validation] == [2, 4]
    assert all(r["validation_loss"] > 0 and r["validation_tokens"] > 0 for r in validation)
    assert validation[0]["validation_tokens"] == validation[1]["validation_tokens"]  # the same batches each time
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_deterministic_runs_repeat_exactly(tmp_path, capsys):
    args = [*TINY, "--training.steps", "2", "--training.local_batch_size", "2", "--job.deterministic"]
    run_main(capsys, *args, "--job.dump_folder", str(tmp_path / "a"))
    run_main(capsys, *args, "--job.dump_folder", str(tmp_path / "b"))
    assert read_metrics(tmp_path / "a")[-1]["loss"] == read_metrics(tmp_path / "b")[-1]["loss"]


def test_torch_adam_is_never_silently_replaced():
    from titan_kimi.config.sections import Optimizer
    from titan_kimi.training.optim.adam_multi_tensor import MultiTensorAdam
    from titan_kimi.training.optim.optimizer import build_optimizer

    bf16 = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"optimizer.implementation = 'fused': torch's Adam keeps the moments in the "
                                         r"parameter dtype, but optimizer.state_dtype = 'float32' differs"):
        build_optimizer([bf16], Optimizer(implementation="fused", state_dtype="float32"))
    assert isinstance(build_optimizer([bf16], Optimizer(implementation="auto", state_dtype="float32")),
                      MultiTensorAdam)
    fused = build_optimizer([bf16], Optimizer(implementation="fused", state_dtype="bfloat16"))
    assert type(fused) is torch.optim.AdamW and fused.defaults["fused"]


def test_image_text_training_rejects_context_parallelism():
    """The layout's check: at config time from model.vision_flavor, and once the model is known (a vision tower
    from model.hf_config_path's vision_config) from the trainer's resolve_layout."""
    from titan_kimi.config import ConfigError

    with pytest.raises(ConfigError, match=r"parallelism.context_parallel_degree = 2 \(from the command line\): with "
                                          r"an image-text model: .* not built; valid: 1"):
        load_job_config(["--model.vision_flavor", "moonvit3d_debug", "--parallelism.context_parallel_degree", "2"],
                        environ={})
    cfg = load_job_config(["--parallelism.context_parallel_degree", "2"], environ={})
    with pytest.raises(ValueError, match=r"parallelism.context_parallel_degree = 2: with an image-text model"):
        resolve_layout(cfg, 2, model_args_from_config(cfg), image_text=True)
