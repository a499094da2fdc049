"""The one-GPU parts of scripts/gpu/measure.sh, each named for what it measures (not run on its own: --list).

A part writes into its own folder of the work folder (``<part>/``): one log per command, a recipe run's
``metrics.jsonl`` under ``<part>/<run>/``, tables as the benchmarks print them. docs/perf.md cites these files
under ``docs/perf/h200/<part>/``. To add a part: a function ``(runner, folder) -> None`` here and a row in
``PARTS``; or no code at all, as ``script:scripts/bench/foo.py --args``, which runs the script with
``--out <its folder>`` appended.
"""

from __future__ import annotations

import datetime
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from runner import ROOT, Command, Runner, env_int, python

FP32_MASTER = ["--model.dtype", "float32", "--optimizer.state_dtype", "float32"]  # fp32 weights, bf16 compute
BF16 = ["--model.dtype", "bfloat16", "--optimizer.state_dtype", "bfloat16"]
K3_SMALL_STEP = ["--flavor", "k3_small", "--config", "train_configs/k31_small.toml", "--seq-len", "8192", "--batch", "1",
                 "--steps", "20", "--lr-warmup-steps", "5", "--cache", "warm", "--no-plot"]
K31_SMALL_STEP = ["--flavor", "k31_small", "--seq-len", "8192", "--batch", "1", "--steps", "20", "--lr-warmup-steps",
                  "5", "--cache", "warm", "--no-plot", "--warmup"]


@dataclass(frozen=True)
class Part:
    name: str
    what: str
    run: Callable[[Runner, Path], None]


# ----------------------------------------------------------------------------------------------- recipe runs

def recipe(r: Runner, folder: Path, name: str, config: str, *overrides: str, cache: str = "cold") -> None:
    """One shipped recipe as users run it, 20 steps; ``cache="cold"``: empty Inductor and Triton caches.

    Writes ``<name>.log``, ``<name>/metrics.jsonl`` and a line per run in ``first_step.txt``: launch to the end
    of step 1 (from the log's clock), then the trainer's own start-up, compile and summary lines.
    """
    if cache == "cold":
        cache = name
        if not r.dry_run:
            for path in (f"/tmp/inductor_{name}", f"/tmp/triton_{name}", f"/tmp/{name}"):
                shutil.rmtree(path, ignore_errors=True)
    extra = shlex.split(os.environ.get("RECIPE_EXTRA", ""))
    log = folder / f"{name}.log"
    launched = datetime.datetime.now(datetime.timezone.utc)
    r.run(name, Command(
        python("-m", "torch.distributed.run", "--nproc-per-node=1", "-m", "titan_kimi.train", "--job.config_file",
               config, "--training.steps", "20", "--metrics.log_freq", "1", "--job.dump_folder", f"/tmp/{name}",
               *overrides, *extra),
        log=log, timeout=env_int("RECIPE_TIMEOUT", 280),
        env={"TORCHINDUCTOR_CACHE_DIR": f"/tmp/inductor_{cache}", "TRITON_CACHE_DIR": f"/tmp/triton_{cache}",
             "TORCH_LOGS": "recompiles"}))
    if r.dry_run:
        return
    metrics = Path(f"/tmp/{name}/metrics.jsonl")
    if metrics.is_file():
        (folder / name).mkdir(parents=True, exist_ok=True)
        shutil.copy(metrics, folder / name / "metrics.jsonl")
    lines = [f"{name}: launch -> first step finished: {first_step_seconds(log, launched)}"]
    if log.is_file():
        lines += ["    " + t[:400] for t in log.read_text(errors="replace").splitlines()
                  if re.search(r"startup:|took|summary:|Error", t)][-6:]
    with open(folder / "first_step.txt", "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def first_step_seconds(log: Path, launched: datetime.datetime) -> str:
    """Seconds from ``launched`` to the trainer's ``step 1`` line (its clock is UTC HH:MM:SS)."""
    if not log.is_file():
        return "no log"
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"\[rank0\] (\d\d):(\d\d):(\d\d) step 1 ", line)
        if m:
            done = launched.replace(hour=int(m[1]), minute=int(m[2]), second=int(m[3]), microsecond=0)
            if done < launched.replace(microsecond=0):
                done += datetime.timedelta(days=1)
            return f"{(done - launched).total_seconds():.0f} s"
    return "step 1 not reached"


def recipes(r: Runner, folder: Path) -> None:
    for name in ("k3_small", "k31_small", "k31_vl_small"):
        recipe(r, folder, f"{name}_recipe", f"train_configs/{name}.toml")


def recipes_fp32_master(r: Runner, folder: Path) -> None:
    for name in ("k3_small", "k31_small"):
        recipe(r, folder, f"{name}_recipe_fp32", f"train_configs/{name}.toml", *FP32_MASTER)


def recipe_lora(r: Runner, folder: Path) -> None:
    recipe(r, folder, "k31_vl_small_lora", "train_configs/k31_vl_small.toml", "--lora.enable", "true")


def recipe_no_fla_prewarm(r: Runner, folder: Path) -> None:
    recipe(r, folder, "k3_small_recipe_no_fla_prewarm", "train_configs/k3_small.toml", "--kernels.prewarm_fla", "false")


def image_text_compile_modes(r: Runner, folder: Path) -> None:
    config = "train_configs/k31_vl_small.toml"
    recipe(r, folder, "k31_vl_small_default_bf16", config, "--compile.mode", "default")
    recipe(r, folder, "k31_vl_small_ro_fp32", config, *FP32_MASTER)
    recipe(r, folder, "k31_vl_small_eager_fp32", config, "--compile.mode", "none", *FP32_MASTER)


def compile_granularity(r: Runner, folder: Path) -> None:
    """The text recipes with whole blocks compiled (the shipped module granularity is part recipes)."""
    for name in ("k3_small", "k31_small"):
        recipe(r, folder, f"{name}_block", f"train_configs/{name}.toml", "--compile.granularity", "block")


def first_step_cache_dir(r: Runner, folder: Path) -> None:
    """The second process starts on empty Inductor/Triton caches but finds the first one's in compile.cache_dir."""
    if not r.dry_run:
        shutil.rmtree("/tmp/k3_small_compile_cache", ignore_errors=True)
    for run in ("first", "restart"):
        recipe(r, folder, f"k3_small_cache_{run}", "train_configs/k3_small.toml",
               "--compile.cache_dir", "/tmp/k3_small_compile_cache")


def first_step_prewarm_modules(r: Runner, folder: Path) -> None:
    recipe(r, folder, "k3_small_recipe_prewarm", "train_configs/k3_small.toml", "--compile.prewarm_modules", "true")


def loss_spread_k3_small(r: Runner, folder: Path) -> None:
    """Two eager runs and an eager run on another exact attention kernel: the spread a compiled run is judged by."""
    config = "train_configs/k3_small.toml"
    recipe(r, folder, "k3_small_eager_a", config, "--compile.mode", "none", cache="eager")
    recipe(r, folder, "k3_small_eager_b", config, "--compile.mode", "none", cache="eager")
    recipe(r, folder, "k3_small_eager_sdpa", config, "--compile.mode", "none", "--kernels.causal_attention", "sdpa",
           cache="eager")
    runs = [folder / f"k3_small_eager_{x}" / "metrics.jsonl" for x in ("a", "b", "sdpa")]
    shipped = r.work / "recipes" / "k3_small_recipe" / "metrics.jsonl"  # when part recipes ran first
    if r.dry_run or shipped.is_file():
        runs.append(shipped)
    r.run("loss_curves", Command(python("scripts/check/loss_curves.py", *map(str, runs), "--out",
                                        str(folder / "loss_curves.json")), log=folder / "loss_curves.md", timeout=60))
    r.tail(folder / "loss_curves.md", 14)


def loss_curves_fp8_experts(r: Runner, folder: Path) -> None:
    """k3_small as shipped with FP8 routed-expert GEMMs between two bf16 runs (their spread is the yardstick),
    60 steps each."""
    config = "train_configs/k3_small.toml"
    for name, extra in (("k3_small_bf16_a", []), ("k3_small_fp8", ["--training.routed_expert_gemm", "fp8_rowwise"]),
                        ("k3_small_bf16_b", [])):
        recipe(r, folder, name, config, "--training.steps", "60", *extra, cache="fp8_loss_curves")
    runs = [folder / name / "metrics.jsonl" for name in ("k3_small_bf16_a", "k3_small_bf16_b", "k3_small_fp8")]
    r.run("loss_curves", Command(python("scripts/check/loss_curves.py", *map(str, runs), "--out",
                                        str(folder / "loss_curves.json")), log=folder / "loss_curves.md", timeout=60))
    r.tail(folder / "loss_curves.md", 14)


# ----------------------------------------------------------------------------------------------- one step, numerics

def compile_modes_step(r: Runner, folder: Path, label: str, args: list[str], timeout: int) -> None:
    """scripts/bench/compile_modes.py into ``folder`` (its per-mode trainer folders removed afterwards)."""
    r.run(label, Command(python("scripts/bench/compile_modes.py", *args), log=folder / f"{label}.log", timeout=timeout))
    if not r.dry_run:
        shutil.rmtree(folder / label / "runs", ignore_errors=True)
    r.tail(folder / label / "results.md", 8)


def profile_k3_small(r: Runner, folder: Path) -> None:
    compile_modes_step(r, folder, "k3_small_bf16", [*K3_SMALL_STEP, "--modes", "reduce-overhead", "--profile",
                                                    "--out", str(folder / "k3_small_bf16"), "--", *BF16], 200)


def compile_modes_k31_small(r: Runner, folder: Path) -> None:
    compile_modes_step(r, folder, "modes", [*K31_SMALL_STEP, "--modes", "none,default,reduce-overhead,inductor",
                                            "--out", str(folder / "modes"), "--", *FP32_MASTER,
                                            "--kernels.triton_autotune", "false"], 280)


def compile_modes_max_autotune(r: Runner, folder: Path) -> None:
    compile_modes_step(r, folder, "max_autotune", [*K31_SMALL_STEP, "--modes", "none,max-autotune", "--out",
                                                   str(folder / "max_autotune"), "--", *FP32_MASTER,
                                                   "--kernels.triton_autotune", "false"], 585)


def numerics(r: Runner, folder: Path) -> None:
    """The compiled k3_small step against eager on the same weights every step, beside an eager kernel swap."""
    r.run("numerics_bf16", Command(python("scripts/check/compile_numerics.py", "--config", "train_configs/k3_small.toml",
                                          "--steps", "12", "--variant", "causal_attention=sdpa", "--out",
                                          str(folder / "numerics_bf16.json")),
                                   log=folder / "numerics_bf16.log", timeout=280))
    r.tail(folder / "numerics_bf16.log", 16, "median")


def numerics_fp32_truth(r: Runner, folder: Path) -> None:
    """Compiled and eager bf16 against the fp32 truth (no autocast, the reference KDA: FLA has no tuned fp32
    configs and tunes them for minutes), fp32 master weights, sdpa attention in all three (varlen takes no fp32)."""
    r.run("numerics_fp32", Command(
        python("scripts/check/compile_numerics.py", "--config", "train_configs/k3_small.toml", "--steps",
               str(env_int("NUMERICS_STEPS", 6)), "--variant", "autocast=off,kda=reference", "--out",
               str(folder / "numerics_fp32.json"), "--", *FP32_MASTER, "--kernels.causal_attention", "sdpa",
               "--training.seq_len", "2048"),
        log=folder / "numerics_fp32.log", timeout=env_int("NUMERICS_TIMEOUT", 400)))
    r.tail(folder / "numerics_fp32.log", 16, "median")


def graph_breaks(r: Runner, folder: Path) -> None:
    r.run("graph_breaks", Command(python("scripts/check/graph_breaks.py", "--flavor", "k31_small", "--device", "cuda",
                                         "--dtype", "bfloat16", "--seq-len", "1024"),
                                  log=folder / "graph_breaks.log", timeout=120))
    r.tail(folder / "graph_breaks.log", 8, "graph_breaks=")


def cudnn_kda_gradients(r: Runner, folder: Path) -> None:
    r.run("cudnn_kda_gradients", Command(python("scripts/check/cudnn_kda_gradients.py"),
                                         log=folder / "cudnn_kda_gradients.md", timeout=120))
    r.tail(folder / "cudnn_kda_gradients.md", 12)


def import_profile(r: Runner, folder: Path) -> None:
    """Where the start-up's imports go: ``python -X importtime`` of the trainer and of the backends' modules."""
    for name, code in (("train", "import titan_kimi.trainer"),
                       ("backends", "import torch, fla.ops.kda.chunk_fwd, fla.ops.kda.chunk_bwd, "
                                    "liger_kernel.ops.fused_linear_cross_entropy")):
        r.run(f"importtime_{name}", Command(python("-X", "importtime", "-c", code),
                                            log=folder / f"importtime_{name}.txt", timeout=120))


# ----------------------------------------------------------------------------------------------- tests

def gpu_test_files() -> list[str]:
    """Every test file with GPU cases, but the multi-GPU one (part layout_tests)."""
    files = [p for p in sorted((ROOT / "tests").glob("test_*.py"))
             if "mark.gpu" in p.read_text(encoding="utf-8") and p.name != "test_multi_gpu.py"]
    return [str(p.relative_to(ROOT)) for p in files]


def tests(r: Runner, folder: Path) -> None:
    """One pytest per file, each with its own limit and log (a slow file costs its own time only)."""
    wait_for_flash_mla_build(r, folder)  # the flash_mla tests need it, when part flash_mla_build started one
    files = shlex.split(os.environ.get("TEST_FILES", "")) or gpu_test_files()
    for path in files:
        if not (ROOT / path).is_file():
            raise SystemExit(f"measure: TEST_FILES names {path!r}, which is not a file of this tree")
        log = folder / f"{Path(path).stem}.log"
        r.run(Path(path).stem, Command(python("-m", "pytest", "-m", "gpu", "--kernels-triton-autotune", "false", path,
                                              "-v", "-rs", "-rf", "--durations=5"),
                                       log=log, timeout=env_int("TESTS_TIMEOUT", 240), interrupt=True))
        r.tail(log, 2)


# ----------------------------------------------------------------------------------------------- per op

def bench(r: Runner, folder: Path, name: str, script: str, *args: str, timeout: int = 200) -> None:
    """A benchmark printing its markdown table to ``<name>.md`` and its numbers to ``<name>.json``."""
    r.run(name, Command(python(script, *args, "--out", str(folder / f"{name}.json")), log=folder / f"{name}.md",
                        timeout=timeout))
    r.tail(folder / f"{name}.md", 14)


def op_loss_optimizer(r: Runner, folder: Path) -> None:
    bench(r, folder, "bench_linear_cross_entropy", "scripts/bench/linear_cross_entropy.py")
    bench(r, folder, "bench_optimizer_step", "scripts/bench/optimizer_step.py", timeout=150)


def op_causal_attention(r: Runner, folder: Path) -> None:
    bench(r, folder, "bench_causal_attention", "scripts/bench/causal_attention.py", "--docs", "100", "1000", "4000")


def op_kda(r: Runner, folder: Path) -> None:
    bench(r, folder, "bench_kda", "scripts/bench/kda.py", "--shapes", *shlex.split(os.environ.get("KDA_SHAPES", "k3")),
          "--layouts", *shlex.split(os.environ.get("KDA_LAYOUTS", "docs_padded")), timeout=300)
    bench(r, folder, "bench_kda_op_overhead", "scripts/bench/kda_op_overhead.py", timeout=120)


def op_fused(r: Runner, folder: Path) -> None:
    """The kernels written here (sparse MLA, indexer, SiTU-GLU, AttnRes mix) at K3 shapes; the sparse MLA forward
    also in the Triton language (the Gluon kernel is what runs on Hopper)."""
    bench(r, folder, "bench_fused_ops", "scripts/bench/fused_ops.py", "--T", "8192", "--no-ref", timeout=120)
    bench(r, folder, "bench_sparse_mla_triton_language", "scripts/bench/fused_ops.py", "--T", "8192", "--ops",
          "sparse_mla", "--no-ref", "--no-sparse-mla-ws", timeout=60)


def op_sparse_attention(r: Runner, folder: Path) -> None:
    """Every backend of sparse_mla and indexer_topk: ours, cuDNN's (the CuTe-DSL runtime) and FlashMLA's (after
    part flash_mla_build, here or in an earlier run on the same machine)."""
    wait_for_flash_mla_build(r, folder)
    bench(r, folder, "bench_sparse_mla_backward", "scripts/bench/sparse_mla_backward.py", timeout=300)
    bench(r, folder, "bench_sparse_mla_forward", "scripts/bench/sparse_mla_forward.py")
    bench(r, folder, "bench_indexer_topk", "scripts/bench/indexer_topk.py", timeout=400)


def op_dsa_layer(r: Runner, folder: Path) -> None:
    bench(r, folder, "bench_dsa_layer", "scripts/bench/dsa_layer.py", "--T", "8192", "16384", "32768", "--reps", "3",
          timeout=120)
    bench(r, folder, "bench_dsa_layer_compiled", "scripts/bench/dsa_layer.py", "--T", "32768", "--reps", "3",
          "--compile", timeout=120)


def op_cp_dsa_layer(r: Runner, folder: Path) -> None:
    bench(r, folder, "cp_dsa_zigzag", "scripts/bench/cp_dsa_layer.py", "--no-autotune", "--T", "32768", "--cp", "1",
          "2", "4", "--layout", "zigzag", "--reps", "5", timeout=240)
    bench(r, folder, "cp_dsa_contiguous", "scripts/bench/cp_dsa_layer.py", "--no-autotune", "--T", "32768", "--cp",
          "2", "4", "--layout", "contiguous", "--reps", "5", timeout=120)


def op_moe_alignment(r: Runner, folder: Path) -> None:
    r.run("bench_moe_alignment", Command(python("scripts/bench/moe_alignment.py"),
                                         log=folder / "bench_moe_alignment.md", timeout=120))
    r.tail(folder / "bench_moe_alignment.md", 6)


def op_routed_combine(r: Runner, folder: Path) -> None:
    checked_script(r, folder, "routed_combine", "scripts/bench/routed_combine.py", timeout=120)


def op_router_logits(r: Runner, folder: Path) -> None:
    checked_script(r, folder, "router_logits", "scripts/bench/router_logits.py", timeout=120)


def op_short_conv(r: Runner, folder: Path) -> None:
    checked_script(r, folder, "short_conv", "scripts/bench/short_conv.py", timeout=120)


def op_situ_glu(r: Runner, folder: Path) -> None:
    checked_script(r, folder, "situ_glu", "scripts/bench/situ_glu.py", timeout=180)


FLASH_BUILD_RC = Path("/tmp/flash_build.rc")


def flash_mla_build(r: Runner, folder: Path) -> None:
    """FlashMLA's two sm90 sparse kernels from the carried .src/flash_mla_src.tar.xz into /tmp/flash_site, in the
    background (1-2 minutes on 16 cores; it outlives the driver while the machine stays up)."""
    cmd = ["bash", "scripts/tools/build_flash_mla.sh", "build", ".src/flash_mla_src.tar.xz", "/tmp/flash_site"]
    if r.dry_run:
        r.note(f"[flash_mla_build] (background) MAX_JOBS=8 {shlex.join(cmd)} > /tmp/flash_build.log")
        return
    FLASH_BUILD_RC.unlink(missing_ok=True)
    script = f"MAX_JOBS=8 {shlex.join(cmd)} > /tmp/flash_build.log 2>&1; echo $? > {FLASH_BUILD_RC}"
    subprocess.Popen(["setsid", "nohup", "bash", "-c", script], cwd=ROOT, env=r.env, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r.note("[flash_mla_build] started in the background (/tmp/flash_build.log)")


def wait_for_flash_mla_build(r: Runner, folder: Path) -> None:
    """Waits (at most 5 minutes) for a build part flash_mla_build started, then puts its folder on the path."""
    if r.dry_run or not Path("/tmp/flash_build.log").exists():
        return
    for _ in range(60):
        if FLASH_BUILD_RC.exists():
            break
        time.sleep(5)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy("/tmp/flash_build.log", folder / "flash_build.log")
    r.note(f"[flash_mla_build] rc={FLASH_BUILD_RC.read_text().strip() if FLASH_BUILD_RC.exists() else 'still running'}")
    if Path("/tmp/flash_site/flash_mla").is_dir() and "/tmp/flash_site" not in r.env["PYTHONPATH"].split(":"):
        r.env["PYTHONPATH"] += ":/tmp/flash_site"


# ----------------------------------------------------------------------------------------------- checks and layouts

def checked_script(r: Runner, folder: Path, name: str, script: str, *args: str, timeout: int) -> None:
    """A script that writes its own report under ``--out <folder>``; its output goes to ``<name>.log``."""
    r.run(name, Command(python(script, *args, "--out", str(folder)), log=folder / f"{name}.log", timeout=timeout))
    r.tail(folder / f"{name}.log", 24)


def resume_exactness(r: Runner, folder: Path) -> None:
    checked_script(r, folder, "resume_exactness", "scripts/check/resume_exactness.py", "--budget-s", "515",
                   timeout=545)


def indexer_training(r: Runner, folder: Path) -> None:
    checked_script(r, folder, "indexer_training", "scripts/check/indexer_training.py", "--part", "learning",
                   timeout=400)


def indexer_throughput(r: Runner, folder: Path) -> None:
    checked_script(r, folder, "indexer_throughput", "scripts/check/indexer_training.py", "--part", "throughput",
                   timeout=330)


def rank_slice_k31(r: Runner, folder: Path) -> None:
    checked_script(r, folder, "rank_slice", "scripts/bench/rank_slice.py", "--config", "train_configs/k31.toml",
                   "--world-size", "256", "--table", str(folder / "step_time_h200.json"), "--parts", "layers",
                   "profile", "stage", timeout=400)


def rank_slice_k31_compile(r: Runner, folder: Path) -> None:
    # A/B only: variants do not write the step-time table, which stays the recipe's as shipped.
    checked_script(r, folder, "rank_slice", "scripts/bench/rank_slice.py", "--config", "train_configs/k31.toml",
                   "--world-size", "256", "--loads", "balanced", "--parts", "--variants", "eager=",
                   "compiled=--compile.mode default", "--variant-parts", "layers", "profile", "stage", timeout=540)


def rank_slice_k31_compiled(r: Runner, folder: Path) -> None:
    # The whole stage compiled (every block variant compiles: ~6 minutes on an H200), its entries (the head's too,
    # built alone) merged into a copy of the shipped table beside the eager ones (the estimate picks them for
    # compile.mode default).
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "titan_kimi/parallel/step_time_h200.json", folder / "step_time_h200.json")
    checked_script(r, folder, "rank_slice", "scripts/bench/rank_slice.py", "--config", "train_configs/k31.toml",
                   "--world-size", "256", "--table", str(folder / "step_time_h200.json"), "--parts", "layers",
                   "stage", "--compile.mode", "default", timeout=560)


def rank_slice_k31_fp8(r: Runner, folder: Path) -> None:
    # A/B only, compiled as the faster mode measured: bf16 against FP8 routed-expert GEMMs
    checked_script(r, folder, "rank_slice", "scripts/bench/rank_slice.py", "--config", "train_configs/k31.toml",
                   "--world-size", "256", "--loads", "balanced", "--parts", "--variants",
                   "bf16=--compile.mode default",
                   "fp8=--compile.mode default --training.routed_expert_gemm fp8_rowwise", "--variant-parts",
                   "layers", "profile", "stage", timeout=540)


def rank_slice_k31_checkpointing(r: Runner, folder: Path) -> None:
    # A/B, compiled: full checkpointing against "mixers" (the token mixers' outputs kept), all 12 layers of
    # stage 0 with the buffer: per layer kind and the schedule's peak (the fit needs an H200)
    checked_script(r, folder, "rank_slice", "scripts/bench/rank_slice.py", "--config", "train_configs/k31.toml",
                   "--world-size", "256", "--loads", "balanced", "--parts", "--variants",
                   "full=--compile.mode default",
                   "mixers=--compile.mode default --activation_checkpoint.mode selective "
                   "--activation_checkpoint.selective_ac_option mixers", "--variant-parts", "layers", "stage",
                   timeout=580)


NO_PP_EP128 = ("--max-layers", "4", "--loads", "balanced", "--compile.mode", "default",
               "--parallelism.pipeline_parallel_degree", "1", "--parallelism.pipeline_gradient_sync", "step",
               "--parallelism.expert_parallel_degree", "128", "--parallelism.expert_parallel_dispatch", "hierarchical",
               "--training.local_batch_size", "1")


def rank_slice_k31_no_pp(r: Runner, folder: Path) -> None:
    # The layout the estimate recommends for k31.toml at 256 GPUs (FSDP 256 x EP128 hierarchical, no PP), its
    # first 4 layers compiled, with that dispatch's own local work: under full (with the kernel profile: where a
    # layer's time goes beside its GEMMs, and each item's host time; and the cost of each backward's add into
    # the gradients held from the previous run, which the entries hold and FSDP training does not do), none and
    # mixers checkpointing, each one's entries merged into a copy of the shipped table (the estimate reads them
    # for blocks out of checkpointing and for mixers jobs); the routed_combine backends on its sums (A/B); the
    # flat dispatch's full entries beside.
    # NO_PP_RUNS picks some of the runs (to split the part over shorter runs of the driver); the table copy is
    # kept between runs on the same machine, and each run's own rank_slice.json holds its entries besides.
    folder.mkdir(parents=True, exist_ok=True)
    table = folder / "step_time_h200.json"
    if not table.exists():
        shutil.copy(ROOT / "titan_kimi/parallel/step_time_h200.json", table)
    table_arg = ("--table", str(table))
    runs = {"full": (*NO_PP_EP128, *table_arg, "--parts", "layers", "gradients", "profile"),
            "none": (*NO_PP_EP128, *table_arg, "--activation_checkpoint.mode", "none", "--parts", "layers"),
            "mixers": (*NO_PP_EP128, *table_arg, "--activation_checkpoint.mode", "selective",
                       "--activation_checkpoint.selective_ac_option", "mixers", "--parts", "layers"),
            "flat_full": (*NO_PP_EP128, *table_arg, "--parallelism.expert_parallel_dispatch", "flat",
                          "--parts", "layers"),
            # the routed_combine backends on the hierarchical dispatch's sums (an A/B: no table written)
            "routed_combine": (*NO_PP_EP128, "--parts", "--variants", "reference=--kernels.routed_combine reference",
                               "triton=", "--variant-parts", "layers"),
            # the recipe's own layout (PP8, 28 local experts) without checkpointing: its DSA + MoE layers'
            # entries, which the estimate needs to size blocks out of checkpointing there
            "pp8_none": ("--loads", "balanced", "--compile.mode", "default", "--activation_checkpoint.mode", "none",
                         "--parts", "layers", *table_arg)}
    chosen = shlex.split(os.environ.get("NO_PP_RUNS", "")) or list(runs)
    unknown = [name for name in chosen if name not in runs]
    if unknown:  # before any run: a typo late in the list would otherwise stop the part minutes in
        raise SystemExit(f"measure: NO_PP_RUNS names {' '.join(unknown)}; expected some of {' '.join(runs)}")
    for name in chosen:
        (folder / name).mkdir(exist_ok=True)
        checked_script(r, folder / name, "rank_slice", "scripts/bench/rank_slice.py", "--config",
                       "train_configs/k31.toml", "--world-size", "256", *runs[name], timeout=300)


def rank_slice_before_after(r: Runner, folder: Path) -> None:
    # A code change's before/after on the rank slice (config overrides have --variants; a change of code needs
    # the earlier tree): BEFORE_REV checked out beside this one (git worktree, its own imports first), the same
    # rank_slice.py arguments (RANK_SLICE_ARGS, default the recommended no-PP layout's first 4 layers, compiled,
    # full checkpointing) in both trees, then the side-by-side of their items.
    rev = os.environ.get("BEFORE_REV", "")
    if not rev and not r.dry_run:
        raise SystemExit("measure: part rank_slice_before_after needs BEFORE_REV=<commit of the tree before>")
    args = shlex.split(os.environ.get("RANK_SLICE_ARGS", "")) or ["--config", "train_configs/k31.toml",
                                                                   "--world-size", "256", *NO_PP_EP128,
                                                                   "--parts", "layers"]
    before = Path("/tmp/rank_slice_before_tree")
    r.run("checkout", Command(["bash", "-c", f"git worktree remove --force {before} 2>/dev/null; rm -rf {before}; "
                                             f"git worktree prune; git worktree add --detach {before} {rev}"],
                              log=folder / "checkout.log", timeout=60))
    r.run("before", Command(python(str(before / "scripts/bench/rank_slice.py"), *args, "--out",
                                   str(folder / "before")),
                            log=folder / "before.log", timeout=env_int("SCRIPT_TIMEOUT", 280),
                            env={"PYTHONPATH": f"{before}:{r.env.get('PYTHONPATH', '')}"}))
    checked_script(r, folder / "after", "rank_slice", "scripts/bench/rank_slice.py", *args,
                   timeout=env_int("SCRIPT_TIMEOUT", 280))
    r.run("compare", Command(python("scripts/bench/compare_rank_slices.py", f"before={folder / 'before'}",
                                    f"after={folder / 'after'}", "--out", str(folder)),
                             log=folder / "compare.log", timeout=60))
    r.tail(folder / "compare.log", 20)


def rank_slice_hellaswag(r: Runner, folder: Path) -> None:
    # As shipped the recipe's stage needs ~233 GiB (docs/perf.md): the stage part runs it with the FSDP handling
    # that fits an H200 (k31.toml ships the same two settings).
    checked_script(r, folder, "rank_slice", "scripts/bench/rank_slice.py", "--config",
                   "train_configs/k3_hellaswag.toml", "--world-size", "256", "--table",
                   str(folder / "step_time_h200.json"), "--parts", "layers", "stage",
                   "--parallelism.pipeline_gradient_sync", "microbatch",
                   "--parallelism.fsdp_reshard_after_forward", "always", timeout=400)


# ----------------------------------------------------------------------------------------------- script parts

def script_part(spec: str) -> Part:
    """``script:PATH ARGS...``: PATH (a script of this tree) with ARGS and ``--out <its folder>``."""
    words = shlex.split(spec[len("script:"):])
    if not words or not (ROOT / words[0]).is_file() or not words[0].endswith(".py"):
        raise SystemExit(f"measure: part {spec!r}: expected script:scripts/<folder>/<name>.py [args], a Python file "
                         "of this tree")
    name = Path(words[0]).stem

    def run(r: Runner, folder: Path) -> None:
        r.run(name, Command(python(*words, "--out", str(folder)), log=folder / f"{name}.log",
                            timeout=env_int("SCRIPT_TIMEOUT", 280)))
        r.tail(folder / f"{name}.log", 12)

    return Part(name, f"{spec[len('script:'):]} --out <folder>", run)


def single_gpu_parts() -> list[Part]:
    return [
        Part("recipes", "k3_small, k31_small, k31_vl_small as shipped, 20 steps each from empty compile caches: "
                        "speed, memory, launch -> first step", recipes),
        Part("recipes_fp32_master", "the text recipes with fp32 weights and moments (bf16 compute)", recipes_fp32_master),
        Part("recipe_lora", "k31_vl_small with --lora.enable true", recipe_lora),
        Part("recipe_no_fla_prewarm", "k3_small with --kernels.prewarm_fla false (what the FLA prewarm saves)",
             recipe_no_fla_prewarm),
        Part("image_text_compile_modes", "k31_vl_small under default, with fp32 master weights, and eager fp32",
             image_text_compile_modes),
        Part("compile_granularity", "k3_small and k31_small with --compile.granularity block", compile_granularity),
        Part("first_step_cache_dir", "k3_small twice over one compile.cache_dir: the restart's first step",
             first_step_cache_dir),
        Part("first_step_prewarm_modules", "k3_small with --compile.prewarm_modules true", first_step_prewarm_modules),
        Part("loss_spread_k3_small", "two eager k3_small runs and an eager sdpa one, loss curves compared "
                                     "(with part recipes' k3_small when it ran first)", loss_spread_k3_small),
        Part("profile_k3_small", "the k3_small bf16 step under reduce-overhead, torch profiler over one step",
             profile_k3_small),
        Part("compile_modes_k31_small", "k31_small (fp32 master) eager, default, reduce-overhead, inductor",
             compile_modes_k31_small),
        Part("compile_modes_max_autotune", "k31_small eager against max-autotune (a run of its own: ~6.5-minute "
                                           "compile)", compile_modes_max_autotune),
        Part("numerics", "compiled vs eager k3_small on the same weights every step, beside an eager sdpa swap",
             numerics),
        Part("numerics_fp32_truth", "compiled and eager bf16 vs the fp32 truth (NUMERICS_STEPS, NUMERICS_TIMEOUT)",
             numerics_fp32_truth),
        Part("graph_breaks", "graph breaks per block type of k31_small on the GPU", graph_breaks),
        Part("cudnn_kda_gradients", "cuDNN KDA's raw gradients against the fp32 reference", cudnn_kda_gradients),
        Part("import_profile", "python -X importtime of the trainer and the backend modules", import_profile),
        Part("tests", "every GPU test file but the multi-GPU one, one pytest each (TEST_FILES, TESTS_TIMEOUT)", tests),
        Part("op_loss_optimizer", "linear cross-entropy backends; optimizer step and clip per dtype setting",
             op_loss_optimizer),
        Part("op_causal_attention", "causal_attention sdpa / flex / varlen at 100-4,000-token documents",
             op_causal_attention),
        Part("op_kda", "kda fla / cudnn at K3's shape (KDA_SHAPES, KDA_LAYOUTS); the op's overhead over FLA", op_kda),
        Part("op_fused", "sparse MLA, indexer, SiTU-GLU, AttnRes mix kernels against torch at K3 shapes", op_fused),
        Part("op_sparse_attention", "sparse_mla triton / cudnn / flash_mla and indexer_topk triton / cudnn",
             op_sparse_attention),
        Part("op_dsa_layer", "a K3.1 DSA layer against dense-masked MLA at 8K-32K tokens", op_dsa_layer),
        Part("op_cp_dsa_layer", "one rank of a context-parallel k31_small DSA layer at 32K tokens, CP 1 / 2 / 4, both "
                                "layouts",
             op_cp_dsa_layer),
        Part("op_moe_alignment", "the experts' row alignment: our gather against torchtitan's permutation",
             op_moe_alignment),
        Part("op_routed_combine", "the MoE's dispatch and combine rows at k31.toml's rank shape: plain torch indexing "
                                  "(eager, compiled) against the gather-sum kernels", op_routed_combine),
        Part("op_router_logits", "the MoE router's fp32 logits at k31.toml's shape: the fp32 matmul (eager, compiled) "
                                 "against the bf16 tensor-core op, and each one's error against fp64",
             op_router_logits),
        Part("op_short_conv", "the KDA short convolution at k31.toml's KDA shape: the formula (eager, compiled) "
                              "against the Triton kernels", op_short_conv),
        Part("op_situ_glu", "SiTU-GLU at the k31.toml rank's routed, shared and dense shapes: the formula (eager, "
                            "compiled) against the Triton kernels, and the kernels' tiles", op_situ_glu),
        Part("flash_mla_build", "build FlashMLA's sm90 sparse forward in the background (for op_sparse_attention "
                                "and the flash_mla tests)", flash_mla_build),
        Part("resume_exactness", "k3_small 20 steps straight (cold, warm) vs 10 + resume + 10 (warm, cold caches)",
             resume_exactness),
        Part("indexer_training", "K3 dense -> add indexer -> warm-up -> sparse stage beside a dense control: KL, "
                                 "recall, loss gap", indexer_training),
        Part("indexer_throughput", "k31_small as shipped with indexer.mode frozen / warmup / sparse: tokens/s",
             indexer_throughput),
        Part("rank_slice_k31", "one rank of k31.toml at 256 GPUs at full width: per layer kind, its schedule, peak "
                               "memory, profiles; writes the step-time table", rank_slice_k31),
        Part("rank_slice_hellaswag", "the same for k3_hellaswag.toml", rank_slice_hellaswag),
        Part("rank_slice_k31_compiled", "one rank of k31.toml compiled (--compile.mode default), all 12 layers of "
                                        "stage 0 with the buffer: per layer kind and the schedule's fit; writes "
                                        "the compiled entries into the step-time table", rank_slice_k31_compiled),
        Part("rank_slice_k31_fp8", "k31.toml's stage 0 compiled, bf16 against FP8 routed-expert GEMMs at full "
                                   "width: per layer kind, profiles, the schedule", rank_slice_k31_fp8),
        Part("rank_slice_k31_no_pp", "the layout the estimate recommends for k31.toml at 256 GPUs (no PP, "
                                     "EP128 hierarchical, its local work included), 4 layers compiled under full, "
                                     "none and mixers checkpointing into a copy of the step-time table, with "
                                     "full's profile and gradient-add cost, the routed_combine A/B and the flat "
                                     "dispatch beside; and the "
                                     "recipe's stage 0 layers without checkpointing",
             rank_slice_k31_no_pp),
        Part("rank_slice_before_after", "a code change's before/after on the rank slice: BEFORE_REV's tree (git "
             "worktree) against this one, the same rank_slice.py arguments (RANK_SLICE_ARGS; default the no-PP "
             "layout's 4 layers), side by side", rank_slice_before_after),
        Part("rank_slice_k31_checkpointing", "k31.toml's stage 0 compiled, full checkpointing against mixers "
                                             "(the token mixers' outputs kept): per layer kind, the schedule and "
                                             "its peak", rank_slice_k31_checkpointing),
        Part("loss_curves_fp8_experts", "k3_small 60 steps with FP8 routed-expert GEMMs between two bf16 runs",
             loss_curves_fp8_experts),
        Part("rank_slice_k31_compile", "k31.toml's stage 0 eager against --compile.mode default at full width: "
                                       "per layer kind, profiles, the schedule's time and peak memory",
             rank_slice_k31_compile),
    ]


GROUPS = {"ops": ["op_loss_optimizer", "op_causal_attention", "op_kda", "op_fused", "op_sparse_attention",
                  "op_dsa_layer", "op_cp_dsa_layer", "op_moe_alignment", "op_routed_combine",
                  "op_router_logits", "op_short_conv", "op_situ_glu"]}
