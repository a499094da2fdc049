"""The per-step compile report: torch.compile's phases and Triton JIT hooks (CPU: Inductor's C++ backend)."""

import time

import pytest
import torch

from titan_kimi.compile.report import CompileReport, TritonJitClock
from titan_kimi.training.process.start_time import process_start_time


def test_first_step_reports_compile_and_a_quiet_step_reports_nothing():
    report = CompileReport(launched_at=time.time() - 5.0)
    torch._dynamo.reset()
    block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU())
    compiled = torch.compile(block)
    x = torch.randn(4, 16, requires_grad=True)
    t0 = time.perf_counter()
    compiled(x).sum().backward()
    line = report.line(1, time.perf_counter() - t0)
    assert line is not None and line.startswith("step 1 took ")
    assert "after this process started" in line
    compile_seconds = float(line.split("torch.compile ")[1].split(" s")[0])
    graphs = int(line.split(" over ")[1].split(" new graphs")[0])
    assert compile_seconds > 0 and graphs >= 1
    assert "the rest" in line
    compiled(x).sum().backward()  # same shapes: no recompile, nothing to report
    assert report.line(2, 0.01) is None
    report.close()


def test_an_eager_first_step_reports_its_time_alone():
    report = CompileReport(launched_at=time.time() - 3.0)
    line = report.line(1, 0.25)
    assert line.startswith("step 1 took 0.2 s (finished 3 s after this process started)") and ";" not in line
    report.close()


def test_triton_clock_chains_and_restores_existing_hooks():
    knobs = pytest.importorskip("triton").knobs
    seen = []
    previous = lambda **kw: seen.append(kw["key"]) or False
    knobs.runtime.jit_cache_hook = previous
    try:
        clock = TritonJitClock().install()
        assert clock.installed
        # Triton calls the hooks with keywords around a compile; a false start hook lets the compile run
        assert knobs.runtime.jit_cache_hook(key=("k", 1), repr="r") is False
        knobs.runtime.jit_post_compile_hook(key=("k", 1), repr="r")
        assert clock.kernels == 1 and clock.seconds >= 0 and seen == [("k", 1)]
        clock.uninstall()
        assert knobs.runtime.jit_cache_hook is previous and knobs.runtime.jit_post_compile_hook is None
    finally:
        knobs.runtime.jit_cache_hook = None


def test_process_start_time_is_in_the_past():
    started = process_start_time()
    assert started is None or 0 < time.time() - started < 24 * 3600 * 365
