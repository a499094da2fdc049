"""compile.prewarm_modules: which module kinds get a process, their input dtypes, when it is refused, how the wait
reports each outcome. That the trainer's first step then loads every graph from the cache the processes filled
(CPU, Inductor's C++ backend) is tested with compile.cache_dir in tests/test_compile_cache_dir.py."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from titan_kimi.models.kimi_k3 import model_args_for
from titan_kimi.compile.module_prewarm import input_dtype, prewarm_kinds, unsupported

ROOT = Path(__file__).resolve().parents[1]
F32, BF16 = torch.float32, torch.bfloat16


def test_one_process_per_module_kind_and_input_dtype():
    args = model_args_for("k3_debug")  # KDA + dense layer 0, KDA + MoE, MLA at layer 3, AttnRes blocks of 4
    # bf16 weights, no autocast: one graph per kind
    assert prewarm_kinds(args, stored=BF16, compute=BF16) == [(0, "attention"), (0, "ffn"), (1, "ffn"),
                                                               (3, "attention")]
    # fp32 weights under bf16 autocast: layer 0's attention sees the fp32 embedding, every later input is bf16
    assert prewarm_kinds(args, stored=F32, compute=BF16) == [(0, "attention"), (0, "ffn"), (1, "attention"),
                                                              (1, "ffn"), (3, "attention")]
    assert input_dtype(args, 0, "attention", stored=F32, compute=BF16) == F32
    assert input_dtype(args, 5, "ffn", stored=F32, compute=BF16) == BF16
    plain = model_args_for("k3_debug", attn_res_block_size=0)  # no AttnRes: the residual sum stays fp32
    assert input_dtype(plain, 5, "ffn", stored=F32, compute=BF16) == F32


def config(mode="default", granularity="module", components=("model",)):
    return SimpleNamespace(compile=SimpleNamespace(mode=mode, granularity=granularity, components=list(components)))


@pytest.mark.parametrize("cfg, world, image_text, expected", [
    (config(), 1, False, None),
    (config(granularity="block"), 1, False, "granularity = 'block'"),
    (config(mode="none"), 1, False, "compile.mode = 'none'"),
    (config(components=("loss",)), 1, False, "components = ['loss']"),
    (config(), 2, False, "a single process; this run has 2"),
    (config(), 1, True, "a text model"),
])
def test_unsupported_runs_are_named(cfg, world, image_text, expected):
    reason = unsupported(cfg, SimpleNamespace(world_size=world), image_text=image_text)
    assert reason is None if expected is None else expected in reason


def test_refused_with_block_granularity_before_any_work(tmp_path):
    run = subprocess.run([sys.executable, "-m", "titan_kimi.train", "--job.config_file", "train_configs/k3_debug.toml",
                          "--compile.mode", "default", "--compile.prewarm_modules", "true",
                          "--job.dump_folder", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "compile.prewarm_modules = true needs compile.granularity = 'module'" in run.stderr


# The prewarm run itself (every module kind compiled in its own process, the first step loading all 14 graphs)
# shares its compile with compile.cache_dir's test: tests/test_compile_cache_dir.py
# test_prewarm_processes_compile_into_the_folder_and_a_later_run_loads_every_graph_from_it.


def test_wait_logs_each_outcome(caplog):
    import logging

    from titan_kimi.compile.module_prewarm import RESULT_PREFIX, ModulePrewarm
    from titan_kimi.training.process.helper_process import HelperProcess

    prewarm = ModulePrewarm()
    done = f"print({RESULT_PREFIX!r} + 'layer 0 attention compiled in 1.0 s'); print('I torch log')"
    cases = {"layer 0 attention": done,
             "layer 0 ffn": "import sys; print('CUDA out of memory'); sys.exit(1)",
             "layer 3 attention": "import time; time.sleep(60)"}
    for name, code in cases.items():
        prewarm.processes.append(HelperProcess(name, [sys.executable, "-c", code]))
    prewarm.processes[0].popen.wait(timeout=60)
    prewarm.processes[1].popen.wait(timeout=60)
    with caplog.at_level(logging.INFO, logger="titan_kimi"):
        prewarm.wait(timeout_s=0)
    assert "compile.prewarm_modules: layer 0 attention compiled in 1.0 s" in caplog.text
    assert "layer 0 ffn failed (exit 1; the first step compiles it itself): CUDA out of memory" in caplog.text
    assert "layer 3 attention stopped before it finished" in caplog.text
    assert prewarm.processes == []
