"""GPU: lowerings/kernels/fla_prewarm.py fills Triton's cache with every kernel the fla KDA op needs at a shape,
alone or as several processes that share the kernels out (``--claims``), with the shape read from stdin."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ["--tokens", "1024", "--heads", "4", "--head-dim", "128", "--lower-bound", "-5.0"]
PREFIX = "fla_prewarm: "


def kernel_dirs(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir() if p.is_dir()}


def environment(cache: Path) -> dict[str, str]:
    return dict(os.environ, TRITON_CACHE_DIR=str(cache), PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def run(cache: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lowerings.kernels.fla_prewarm", *SHAPE, *args],
                          env=environment(cache), capture_output=True, text=True, timeout=600)


def result(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith(PREFIX)][-1][len(PREFIX):])


def test_a_second_process_at_the_prewarmed_shape_compiles_nothing_new(tmp_path):
    cache = tmp_path / "triton"
    first = run(cache)
    assert first.returncode == 0, first.stdout + first.stderr
    assert result(first.stdout)["calls"] == 1
    compiled = kernel_dirs(cache)
    assert len(compiled) >= 10  # FLA's forward and backward kernels, l2norm and the gate included
    second = run(cache)
    assert second.returncode == 0, second.stdout + second.stderr
    assert kernel_dirs(cache) == compiled  # every kernel came from the cache


def test_processes_with_claims_share_the_kernels_and_leave_nothing_to_compile(tmp_path):
    cache, claims = tmp_path / "triton", tmp_path / "claims"
    claims.mkdir()
    # the shape arrives on stdin, as the trainer sends it to processes it started before its imports
    processes = [subprocess.Popen([sys.executable, "-m", "lowerings.kernels.fla_prewarm", "--shape-from-stdin",
                                   "--claims", str(claims)], env=environment(cache), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(3)]
    outputs = [p.communicate(json.dumps(SHAPE) + "\n", timeout=600)[0] for p in processes]
    assert all(p.returncode == 0 for p in processes), outputs
    results = [result(out) for out in outputs]
    compiled = sum(r["compiled"] for r in results)
    assert compiled == len(list(claims.iterdir()))  # each claimed kernel compiled exactly once
    assert all(r["compiled"] + r["skipped"] >= 1 for r in results)
    shared = kernel_dirs(cache)
    alone = run(cache)  # a process at the same shape, as the trainer: every kernel is there
    assert alone.returncode == 0, alone.stdout + alone.stderr
    assert kernel_dirs(cache) == shared


def test_an_empty_line_sends_the_process_away(tmp_path):
    done = subprocess.run([sys.executable, "-m", "lowerings.kernels.fla_prewarm", "--shape-from-stdin"],
                          env=environment(tmp_path / "triton"), input="\n", capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "not needed" in done.stdout
    # no kernel compiled (Triton's own launcher library may be cached at start-up: a folder without a cubin)
    assert not list((tmp_path / "triton").glob("*/*.cubin"))
