"""kernels.prewarm_fla: the background FLA compile's command, when it starts, and how its outcome is logged."""

import logging
import sys
from types import SimpleNamespace

import pytest
import torch

from lowerings.kernels import fla_prewarm
from titan_kimi.models.kimi_k3 import model_args_for
from titan_kimi.training import kernel_prewarm
from titan_kimi.training.kernel_prewarm import FlaPrewarm, prewarm_command


def config(prewarm=True, dtype="bfloat16", param_dtype="bfloat16"):
    return SimpleNamespace(
        kernels=SimpleNamespace(prewarm_fla=prewarm, fla_configs="shipped"),
        model=SimpleNamespace(dtype=dtype),
        training=SimpleNamespace(local_batch_size=2, seq_len=4096, param_dtype=param_dtype))


def test_command_carries_the_runs_kda_shape_and_dtypes():
    args = model_args_for("k3_small")
    command = prewarm_command(args, config(dtype="float32"), torch.device("cuda", 1))
    assert command[:3] == [sys.executable, "-m", "lowerings.kernels.fla_prewarm"]
    opts = fla_prewarm.build_parser().parse_args(command[3:])  # the script's own parser reads it back
    assert (opts.tokens, opts.heads, opts.head_dim, opts.lower_bound) == (8192, 16, 128, -5.0)
    assert opts.decay_dtypes == ["float32", "bfloat16"] and opts.device == "cuda:1"
    assert opts.fla_configs == "shipped"


@pytest.mark.parametrize("why", ["off", "backend", "cpu", "cp", "rank", "no_kda"])
def test_it_starts_only_where_it_can_help(why):
    args = model_args_for("k3_small")
    if why == "no_kda":
        args = SimpleNamespace(n_layers=2, is_kda_layer=lambda i: False)
    started = FlaPrewarm().start(
        args, config(prewarm=why != "off"), torch.device("cpu" if why == "cpu" else "cuda"),
        kda_backend="reference" if why == "backend" else "fla", context_parallel=2 if why == "cp" else 1,
        local_rank=1 if why == "rank" else 0)
    assert started is False


@pytest.mark.parametrize("code, expected", [
    ("print('fla_prewarm: 2 calls in 1.0 s')", "kernels.prewarm_fla: fla_prewarm: 2 calls in 1.0 s"),
    ("import sys; print('no CUDA'); sys.exit(3)", "kernels.prewarm_fla failed (exit 3"),
])
def test_outcome_is_logged_when_the_process_ends(monkeypatch, caplog, code, expected):
    monkeypatch.setattr(kernel_prewarm, "prewarm_command", lambda *a: [sys.executable, "-c", code])
    prewarm = FlaPrewarm()
    assert prewarm.start(model_args_for("k3_small"), config(), torch.device("cuda"), kda_backend="fla",
                         context_parallel=1, local_rank=0)
    prewarm.process.popen.wait(timeout=60)
    with caplog.at_level(logging.INFO, logger="titan_kimi"):
        prewarm.finish(stop=False)
    assert expected in caplog.text and prewarm.process is None


def test_a_running_process_is_left_alone_then_stopped_at_exit(monkeypatch, caplog):
    monkeypatch.setattr(kernel_prewarm, "prewarm_command",
                        lambda *a: [sys.executable, "-c", "import time; time.sleep(60)"])
    prewarm = FlaPrewarm()
    prewarm.start(model_args_for("k3_small"), config(), torch.device("cuda"), kda_backend="fla",
                  context_parallel=1, local_rank=0)
    prewarm.finish(stop=False)
    assert prewarm.process is not None and prewarm.process.popen.poll() is None
    with caplog.at_level(logging.INFO, logger="titan_kimi"):
        prewarm.finish(stop=True)
    assert "stopped before it finished" in caplog.text


def test_document_boundaries_are_padded_to_the_slots():
    cu = fla_prewarm.document_boundaries(8192, 64, torch.device("cpu"))
    assert cu.shape == (65,) and cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == 8192
    assert bool((cu[1:] >= cu[:-1]).all())
    with pytest.raises(ValueError, match="slots = 2"):
        fla_prewarm.document_boundaries(8192, 2, torch.device("cpu"))
