"""kernels.prewarm_fla: the background FLA compile's command, when it starts, and how its outcome is logged."""

import io
import json
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lowerings.kernels import fla_prewarm
from titan_kimi.models.kimi_k3 import model_args_for
from titan_kimi.compile import kernel_prewarm
from titan_kimi.training.process.helper_process import HelperProcess
from titan_kimi.compile.kernel_prewarm import FlaPrewarm, prewarm_command

RECIPE = Path(__file__).resolve().parents[1] / "train_configs" / "k3_small.toml"


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


RESULT = ('import json, sys, time; print("fla_prewarm: " + json.dumps({"calls": 1, "compile_s": 1.5, '
          '"done_at": time.time(), "compiled": 6, "skipped": 18}))')


def started(monkeypatch, code):
    monkeypatch.setattr(kernel_prewarm, "prewarm_command", lambda *a: [sys.executable, "-c", code])
    prewarm = FlaPrewarm()
    assert prewarm.start(model_args_for("k3_small"), config(), torch.device("cuda"), kda_backend="fla",
                         context_parallel=1, local_rank=0)
    assert len(prewarm.processes) == kernel_prewarm.PROCESSES
    return prewarm


@pytest.mark.parametrize("code, expected", [
    (RESULT, f"kernels.prewarm_fla: {kernel_prewarm.PROCESSES} processes compiled "
             f"{6 * kernel_prewarm.PROCESSES} kernels"),
    ("print('fla_prewarm: not needed')", "kernels.prewarm_fla: not needed"),
    ("import sys; print('no CUDA'); sys.exit(3)", "kernels.prewarm_fla failed (exit 3"),
])
def test_outcome_is_logged_when_the_processes_end(monkeypatch, caplog, code, expected):
    prewarm = started(monkeypatch, code)
    claims = prewarm._claims
    for process in prewarm.processes:
        process.popen.wait(timeout=60)
    with caplog.at_level(logging.INFO, logger="titan_kimi"):
        prewarm.finish(stop=False)
    assert expected in caplog.text and prewarm.processes == []
    assert claims is not None and not os.path.exists(claims)  # the claim folder goes with them


def test_running_processes_are_left_alone_then_stopped_at_exit(monkeypatch, caplog):
    prewarm = started(monkeypatch, "import time; time.sleep(60)")
    prewarm.finish(stop=False)
    assert prewarm.processes and all(p.popen.poll() is None for p in prewarm.processes)
    with caplog.at_level(logging.INFO, logger="titan_kimi"):
        prewarm.finish(stop=True)
    assert f"{kernel_prewarm.PROCESSES} of {kernel_prewarm.PROCESSES} processes stopped before they finished" in caplog.text


# A stand-in for fla_prewarm --shape-from-stdin: echoes its arguments and the line it read, as a result line.
ECHO = ('import json, sys, time; line = sys.stdin.readline().strip(); '
        'print("fla_prewarm: " + (json.dumps({"argv": sys.argv[1:], "line": json.loads(line), "done_at": time.time(), '
        '"compile_s": 0.0}) if line else "not needed"))')


@pytest.fixture
def early(monkeypatch, tmp_path):
    """spawn_early on a job that may prewarm, with a GPU made visible and the script replaced by ECHO."""
    monkeypatch.setattr(kernel_prewarm, "_visible_gpu", lambda environ: True)
    monkeypatch.setattr(kernel_prewarm, "_SCRIPT", [sys.executable, "-c", ECHO])
    monkeypatch.setattr(kernel_prewarm.importlib.util, "find_spec", lambda name: object())
    prewarm = FlaPrewarm()
    assert prewarm.spawn_early(["--job.config_file", str(RECIPE)], environ={"LOCAL_RANK": "0"})
    assert prewarm.waiting and len(prewarm.processes) == kernel_prewarm.PROCESSES
    yield prewarm
    prewarm.finish(stop=True, quiet=True)


def test_early_processes_get_the_shape_and_the_cache_folder(early, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/triton")
    args = model_args_for("k3_small")
    assert early.start(args, config(), torch.device("cuda", 0), kda_backend="fla", context_parallel=1, local_rank=0)
    outputs = [p.finish(timeout_s=60, result_prefix=kernel_prewarm.RESULT_PREFIX) for p in early.processes]
    early.processes = []
    for outcome in outputs:
        result = json.loads(outcome.line)
        assert result["argv"][:1] == ["--shape-from-stdin"] and "--claims" in result["argv"]
        assert result["argv"][result["argv"].index("--fla-configs") + 1] == "shipped"
        opts = fla_prewarm.build_parser().parse_args(result["argv"] + result["line"])  # as the script reads it
        assert (opts.tokens, opts.heads, opts.head_dim, opts.lower_bound) == (8192, 16, 128, -5.0)
        assert opts.triton_cache_dir == "/somewhere/triton" and opts.shape_from_stdin
    assert len({json.loads(o.line)["argv"][-1] for o in outputs}) == 1  # one claim folder for all


def test_early_processes_of_a_run_that_failed_before_the_shape_are_stopped_quietly(early, caplog):
    processes = list(early.processes)
    with caplog.at_level(logging.INFO, logger="titan_kimi"):
        early.finish(stop=True)  # main()'s finally, after a config error
    assert early.processes == [] and all(p.popen.returncode is not None for p in processes)
    assert "prewarm_fla" not in caplog.text


def test_early_processes_are_sent_away_when_the_run_does_not_prewarm(early, caplog):
    processes = list(early.processes)
    with caplog.at_level(logging.INFO, logger="titan_kimi"):
        assert not early.start(model_args_for("k3_small"), config(), torch.device("cuda", 0),
                               kda_backend="reference", context_parallel=1, local_rank=0)
    assert early.processes == [] and all(p.popen.returncode is not None for p in processes)  # stopped
    assert "prewarm_fla" not in caplog.text  # nothing to report about a prewarm that never ran


@pytest.mark.parametrize("why, argv, environ", [
    ("rank", [], {"LOCAL_RANK": "1"}),
    ("gpu", [], {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": ""}),
    ("config", ["--job.config_file", "/no/such/recipe.toml"], {}),
    ("off", ["--kernels.prewarm_fla", "false"], {}),
    ("dry", ["--job.dry_run", "true"], {}),
    ("kda", ["--kernels.kda", "reference"], {}),
])
def test_early_start_only_where_it_can_help(monkeypatch, why, argv, environ):
    if why != "gpu":
        monkeypatch.setattr(kernel_prewarm, "_visible_gpu", lambda environ: True)
    argv = argv if why == "config" else ["--job.config_file", str(RECIPE), *argv]
    reason, _ = kernel_prewarm.early_unsupported(argv, environ)
    assert reason is not None
    assert not FlaPrewarm().spawn_early(argv, environ)


def test_shape_line_is_read_from_stdin(monkeypatch):
    parser = fla_prewarm.build_parser()
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(["--tokens", "4096", "--heads", "8"]) + "\n"))
    full = fla_prewarm._shape_arguments(parser, ["--device", "cuda:0", "--head-dim", "64"])
    opts = parser.parse_args(full)
    assert (opts.tokens, opts.heads, opts.head_dim, opts.device) == (4096, 8, 64, "cuda:0")
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # the trainer closed the pipe: no prewarm
    assert fla_prewarm._shape_arguments(parser, []) is None
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"tokens": 1}\n'))
    with pytest.raises(SystemExit):
        fla_prewarm._shape_arguments(parser, [])


def test_claims_share_each_kernel_out_once(tmp_path):
    fn = lambda name: SimpleNamespace(module="fla.ops.kda", name=name)
    first, second = fla_prewarm.KernelClaims(tmp_path), fla_prewarm.KernelClaims(tmp_path)
    assert first(key="k1", fn=fn("a")) is False  # first to reach it: compiles
    assert second(key="k1", fn=fn("a")) is True  # claimed: skipped, neither compiled nor launched
    assert second(key="k2", fn=fn("a")) is False and second(key="k1", fn=fn("b")) is False
    assert first(key="k2", fn=fn("a")) is True
    assert (first.claimed, first.skipped, second.claimed, second.skipped) == (1, 1, 2, 1)


def test_send_line_reaches_the_helper_once(tmp_path):
    helper = HelperProcess("echo", [sys.executable, "-c", "import sys; print('got ' + sys.stdin.readline())"],
                           stdin=True)
    assert helper.send_line("hello")
    assert helper.finish(timeout_s=60).line == "got hello"
    with pytest.raises(ValueError, match="stdin"):
        helper.send_line("again")


def test_document_boundaries_are_padded_to_the_slots():
    cu = fla_prewarm.document_boundaries(8192, 64, torch.device("cpu"))
    assert cu.shape == (65,) and cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == 8192
    assert bool((cu[1:] >= cu[:-1]).all())
    with pytest.raises(ValueError, match="slots = 2"):
        fla_prewarm.document_boundaries(8192, 2, torch.device("cpu"))
