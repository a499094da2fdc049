"""Expert and pipeline parallelism on gloo, against one process with the same data, init and global batch.

Tolerances: in fp32 every layout's gradients match one process to 1e-4 relative (observed ~5e-6: summation
order). With the shipped recipe's bf16 mixed precision, each layout is compared with a reference of the same
precision policy: FSDP layouts with FSDP over 2 ranks (bf16 copies of every parameter), layouts without FSDP
(pipeline parallelism alone) with one process (autocast matmuls). Losses then agree within 2% at each of 8 steps
(observed <= 0.85%, PP2 against one process: the 8 microbatches round differently) and within 0.5% at step 1.
Between the two policies the curves differ by up to ~2% after 8 steps, which is why they are not mixed.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_kimi.checkpoint import export_hf_checkpoint
from titan_kimi.models.kimi_k3 import KimiK3Model, model_args_for

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ["--job.config_file", "train_configs/k31_debug.toml"]


def launch(args: list[str], nproc: int = 0, timeout: int = 900) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}"] if nproc else [sys.executable]
    result = subprocess.run([*head, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def train(folder: Path, *overrides: str, nproc: int = 0) -> list[float]:
    launch(["-m", "titan_kimi.train", *RECIPE, "--job.dump_folder", str(folder), *overrides], nproc)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.slow
def test_every_layout_gives_one_process_gradients_in_fp32(tmp_path):
    """EP2, PP2 (every schedule), PP2 x EP2 x FSDP2 (also with its weights prefetched at the step's start),
    selective AC + compile under PP2 x EP2,
    full AC under EP2, per-module compile under PP2 x FSDP2, HF initial weights read per rank, and the image-text model at PP2 x FSDP2 with and without
    LoRA and with LoRA under ZBVZeroBubble (adapter files byte-equal to one process's): one step's gradients on 4 ranks.
    PP2 x EP2 x FSDP2 (text) and the image-text LoRA layouts also export their stages as one HF checkpoint, equal to
    one process's export (adapters merged) and loading back with its logits."""
    hf = tmp_path / "hf"
    torch.manual_seed(5)
    model = KimiK3Model(model_args_for("k31_debug_pp"))
    model.init_weights()
    export_hf_checkpoint(model, hf, dtype=torch.float32)
    out = launch(["tests/parallel_parity_worker.py", "--hf", str(hf)], nproc=4)
    results = dict(re.findall(r"PARITY (\S+) (grad_rel \S+ loss_rel \S+ params \d+)", out))
    assert set(results) == {"ep2", "pp2_1f1b", "pp2_interleaved", "pp2_zbv", "pp2_ep2_fsdp2",
                            "pp2_ep2_fsdp2_prefetch", "pp2_interleaved_zb",
                            "pp2_looped_bfs", "pp2_dualpipev", "pp2_gpipe", "pp2_ep2_sac_compile", "ep2_full_ac",
                            "pp2_fsdp2_module_compile",
                            "ep2_efsdp2_hf", "pp2_ep2_hf", "vl_pp2_fsdp2", "vl_lora_pp2_fsdp2",
                            "vl_lora_pp2_zbv"}, out
    for name, line in results.items():
        grad, loss, params = re.match(r"grad_rel (\S+) loss_rel (\S+) params (\d+)", line).groups()
        assert float(grad) < 1e-4 and float(loss) < 1e-5 and int(params) > 100, (name, line)
    # The stages' HF exports equal one process's (checked in the worker, which prints these lines only then).
    assert set(re.findall(r"HF_EXPORT (\S+) ok", out)) == {"pp2_ep2_fsdp2", "vl_lora_pp2_fsdp2", "vl_lora_pp2_zbv"}, out


def close(curve: list[float], reference: list[float]) -> None:
    assert len(curve) == len(reference) == 8
    assert abs(curve[0] - reference[0]) <= 5e-3 * reference[0], (curve, reference)
    for a, b in zip(curve, reference):
        assert abs(a - b) <= 2e-2 * b, (curve, reference)


# 8 steps of the shipped recipe, global batch 8: the references of tests/conftest.py's shipped_reference.
SHIPPED_STEPS = ["--training.steps", "8", "--metrics.log_freq", "100"]
REFERENCE_RUNS = {
    "one_process": (0, []),
    "one_process_pp_flavor": (0, ["--model.flavor", "k31_debug_pp"]),
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
}


@pytest.mark.slow
def test_shipped_recipe_trains_under_every_layout_like_one_process(tmp_path, shipped_reference):
    """As users type it (mixed precision on), 8 steps, global batch 8."""
    assert shipped_reference("one_process")[-1] < 0.75 * shipped_reference("one_process")[0]
    runs = {
        "ep2": (2, "fsdp2", ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"]),
        "pp2": (2, "one_process", ["--parallelism.pipeline_parallel_degree", "2"]),
        "pp2_interleaved": (2, "one_process_pp_flavor", [
            "--model.flavor", "k31_debug_pp", "--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
        "pp2_zbv": (2, "one_process_pp_flavor", [
            "--model.flavor", "k31_debug_pp", "--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]),
        "pp2_ep2_fsdp2": (4, "fsdp2", ["--parallelism.pipeline_parallel_degree", "2",
                                       "--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"]),
    }
    for name, (nproc, reference, overrides) in runs.items():
        close(train(tmp_path / name, *SHIPPED_STEPS, *overrides, nproc=nproc), shipped_reference(reference))


@pytest.mark.slow
def test_checkpoint_saved_at_pp2_ep2_resumes_at_one_process_and_at_ep2(tmp_path):
    common = ["--model.dtype", "float32", "--training.mixed_precision", "false", "--training.steps", "4",
              "--training.seq_len", "64", "--lr_scheduler.warmup_steps", "1", "--checkpoint.enable", "true",
              "--checkpoint.interval", "2", "--metrics.log_freq", "100"]
    full = train(tmp_path / "pp2_ep2", *common, "--parallelism.pipeline_parallel_degree", "2",
                 "--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4", nproc=4)
    saved = tmp_path / "pp2_ep2" / "checkpoint" / "step-2"
    assert (saved / ".metadata").is_file()
    for name, nproc, overrides in (("single", 0, ["--training.local_batch_size", "8"]),
                                   ("ep2", 2, ["--parallelism.expert_parallel_degree", "2",
                                               "--training.local_batch_size", "4"])):
        shutil.copytree(saved, tmp_path / name / "checkpoint" / "step-2")
        resumed = train(tmp_path / name, *common, *overrides, nproc=nproc)
        assert len(resumed) == 2, resumed  # steps 3 and 4
        for a, b in zip(resumed, full[2:]):
            assert a == pytest.approx(b, rel=1e-4), (name, resumed, full)
