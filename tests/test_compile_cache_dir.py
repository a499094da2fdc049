"""compile.cache_dir: Inductor's and Triton's caches in a chosen folder, which a later run (a fresh /tmp, another
machine) loads instead of compiling (CPU: Inductor's C++ backend)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from titan_kimi.compile.cache_dir import use_compile_cache_dir

ROOT = Path(__file__).resolve().parents[1]


def test_both_caches_move_under_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    made = use_compile_cache_dir(str(tmp_path / "cache"))
    assert made == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "inductor"),
                    "TRITON_CACHE_DIR": str(tmp_path / "cache" / "triton")}
    assert all(os.environ[k] == v and Path(v).is_dir() for k, v in made.items())


def test_empty_changes_nothing(monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert use_compile_cache_dir("") == {} and "TRITON_CACHE_DIR" not in os.environ


def test_a_folder_that_cannot_be_made_is_named(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"compile\.cache_dir = '.*a_file/cache': cannot create"):
        use_compile_cache_dir(str(blocker / "cache"))


FP32 = ("--training.mixed_precision", "false")


def _first_step(tmp_path: Path, run: str, *extra: str) -> str:
    # each run gets its own empty TORCHINDUCTOR_CACHE_DIR, as on a fresh machine; compile.cache_dir replaces it
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"tmp_{run}"))
    env.pop("TRITON_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-m", "titan_kimi.train", "--job.config_file",
                           "train_configs/k3_debug.toml", "--training.steps", "1", "--lr_scheduler.warmup_steps", "0",
                           "--compile.mode", "default", "--compile.granularity", "module",
                           "--compile.cache_dir", str(tmp_path / "cache"), "--job.dump_folder", str(tmp_path / run),
                           *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    return log


def test_prewarm_processes_compile_into_the_folder_and_a_later_run_loads_every_graph_from_it(tmp_path):
    """compile.prewarm_modules: every module kind compiled in its own process (from the empty folder: each
    misses), the trainer's first step loads every graph they compiled; then a second run of the same model on the
    same compile.cache_dir loads every graph from the folder and writes nothing to its own /tmp cache. In fp32
    (one dtype: 4 kinds; mixed precision adds the kinds whose input dtype differs, tests/test_compile_prewarm.py)."""
    first = _first_step(tmp_path, "first", "--compile.prewarm_modules", "true", *FP32)
    done = re.findall(r"compile\.prewarm_modules: layer \d+ \w+ compiled in .*", first)
    assert len(done) == 4, first[-3000:]
    assert all("set-up" in line and "torch.compile" in line for line in done), done
    assert all(re.search(r"graph cache \d+ hits, [1-9]\d* misses\)", line) for line in done), done
    startup = re.search(r"startup: imports [\d.]+ s, .*waiting for compile\.prewarm_modules [\d.]+ s; .*", first)
    assert startup is not None and "backend libraries" in startup[0], first[-3000:]
    hits, misses = map(int, re.search(r"step 1 took .*Inductor's graph cache (\d+) hits, (\d+) misses",
                                      first).groups())
    assert misses == 0 and hits == 10  # 5 graphs of the 4 kinds, forward and backward
    assert any((tmp_path / "cache" / "inductor").iterdir())
    assert not (tmp_path / "tmp_first").exists() or not any((tmp_path / "tmp_first").rglob("*.py"))
    second = re.search(r"step 1 took .*", _first_step(tmp_path, "second", *FP32))[0]
    hits, misses = map(int, re.search(r"Inductor's graph cache (\d+) hits, (\d+) misses", second).groups())
    assert misses == 0 and hits > 0, second
    assert not (tmp_path / "tmp_second").exists() or not any((tmp_path / "tmp_second").rglob("*.py"))
