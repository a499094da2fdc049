"""How the command line ends: bad inputs print the message alone with exit 2, bugs keep their traceback."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_kimi.trainer import main
from titan_kimi.config import ConfigError
from titan_kimi.training.process.exit_codes import EXIT_BAD_INPUT, RunStopped, is_bad_input, run_cli

ROOT = Path(__file__).resolve().parents[1]


def test_config_error_prints_the_message_alone_and_exits_2():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "titan_kimi.train", "--training.steps", "0"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_BAD_INPUT
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == ("titan_kimi.train: error: training.steps = 0 (from the command line): "
                                     "out of range; valid: an integer >= 1")


def test_value_errors_of_our_code_are_bad_inputs_library_ones_are_bugs(capsys):
    def ours(argv):
        from titan_kimi.data.records import read_records

        read_records("no/such/file.jsonl")  # raises a ValueError written for users

    assert run_cli(ours) == EXIT_BAD_INPUT
    assert "data file not found: no/such/file.jsonl" in capsys.readouterr().err

    def library(argv):
        json.loads("{")  # a ValueError (JSONDecodeError) from inside the json module

    with pytest.raises(json.JSONDecodeError):
        run_cli(library)
    assert is_bad_input(ConfigError("x"))
    assert not is_bad_input(RuntimeError("x"))


def test_a_requested_stop_exits_with_its_code():
    def stopped(argv):
        raise RunStopped("stopped by SIGTERM", 143)

    assert run_cli(stopped) == 143


def test_job_description_is_printed_at_start(capsys):
    assert main(["--job.description", "ablation 7: no indexer", "--job.dry_run"]) == 0
    assert "job: ablation 7: no indexer" in capsys.readouterr().out
