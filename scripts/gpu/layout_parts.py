"""The multi-GPU parts of scripts/gpu/measure.sh (not run on its own: --list shows them).

k31_small (and k31_medium) under each parallel layout against a one-GPU run of the same global batch;
docs/parallelism.md says which machines run them.

Every run trains 20 steps (``LAYOUT_STEPS``) eager (``LAYOUT_COMPILE``, default none: CUDA graphs under NCCL
and under the profiler are untried) with the last step profiled (NCCL share, CUDA busy time, per-rank peak),
into ``layouts/runs/<name>/``. ``layouts/runs/layouts.tsv`` names each run and what it is compared with, and
``scripts/gpu/summarize_layout_runs.py`` turns the runs found into ``layouts/summary.md`` (also ``$OUT/summary.md``)
after every layout part; ``PRIOR=DIR`` (an unpacked all.tgz of an earlier run of the driver, carried in an
ignored folder) adds its runs first, so one table compares with references run there. 8,192 tokens per GPU per step:
a 2-GPU layout trains 16,384 tokens per step, against a one-GPU run of the same sequences in the same order.
``LAYOUT_RECIPE`` and ``LAYOUT_EXTRA`` (overrides after every run's own) exist for a CPU smoke test of the
plumbing, e.g. ``LAYOUT_RECIPE=train_configs/k31_debug.toml LAYOUT_EXTRA="--training.seq_len 64"``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import tarfile
from pathlib import Path

from parts import Part
from runner import Command, Runner, env_int, python

# name, reference ("-" for a reference run), GPUs, what: written whole every time, so runs not made show as "not run"
MANIFEST = [
    ("ref_b1", "-", 1, "the recipe, 1 x 8,192"),
    ("ref_b2", "-", 1, "2 x 8,192, accumulation 2"),
    ("ref_pp_s4k", "-", 1, "k31_small_pp, 4 x 4,096"),
    ("ref_s16k", "-", 1, "1 x 16,384"),
    ("fsdp2", "ref_b2", 2, "FSDP2 dp_shard 2, 1 x 8,192 per GPU"),
    ("fsdp2_ep2", "ref_b2", 2, "FSDP2 + EP2, 1 x 8,192 per GPU"),
    ("pp2_1f1b", "ref_b2", 2, "PP2 1F1B, 2 microbatches of 8,192, stages 12 + 4 layers"),
    ("pp2_zbv", "ref_pp_s4k", 2, "PP2 ZBVZeroBubble, k31_small_pp, 4 microbatches of 4,096, 4 stages"),
    ("cp2", "ref_s16k", 2, "CP2 zigzag, 2 x 8,192 tokens of one 16,384 sequence"),
    ("med_ref4", "-", 1, "k31_medium, full activation checkpointing, 4 x 8,192, accumulation 4"),
    ("med_ref8", "-", 1, "k31_medium, full activation checkpointing, 8 x 8,192, accumulation 8"),
    ("med4_fsdp4", "med_ref4", 4, "k31_medium FSDP2 dp_shard 4, 1 x 8,192 per GPU, AC every 2nd block"),
    ("med4_pp2_ep2", "med4_fsdp4", 4, "k31_medium PP2 1F1B x dp_shard 2 x EP2, 2 microbatches of 8,192, AC every 2nd block"),
    ("med4_pp2_ep2", "med_ref4", 4, "the same run against one GPU"),
    ("med8_fsdp8", "med_ref8", 8, "k31_medium FSDP2 dp_shard 8, 1 x 8,192 per GPU, AC every 2nd block"),
    ("med8_pp2_ep4", "med8_fsdp8", 8, "k31_medium PP2 1F1B x dp_shard 4 x EP4, 2 microbatches of 8,192, AC every 2nd block"),
    ("med8_pp2_ep4", "med_ref8", 8, "the same run against one GPU"),
]
MEDIUM = ["--model.flavor", "k31_medium", "--training.seq_len", "8192"]


def runs_folder(r: Runner) -> Path:
    """``layouts/runs`` with the manifest, and an earlier run's layout runs (``PRIOR``) not made here."""
    folder = r.folder("layouts") / "runs"
    if r.dry_run:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    prior = Path(os.environ["PRIOR"]) / "layouts" / "runs" if os.environ.get("PRIOR") else None
    if prior is not None:
        if not prior.is_dir():
            raise SystemExit(f"measure: PRIOR={os.environ['PRIOR']!r} has no layouts/runs folder (an unpacked all.tgz "
                             "of an earlier run of the driver has one)")
        for run in prior.iterdir():
            if run.is_dir() and not (folder / run.name).exists():
                shutil.copytree(run, folder / run.name)
    (folder / "layouts.tsv").write_text("".join(f"{n}\t{ref}\t{g}\t{what}\n" for n, ref, g, what in MANIFEST))
    return folder


def train(r: Runner, name: str, gpus: int, devices: str, *overrides: str, timeout_var: str = "LAYOUT_TIMEOUT",
          timeout: int = 280) -> Command:
    """One layout run's command (``devices``: CUDA_VISIBLE_DEVICES)."""
    runs = runs_folder(r)
    if not r.dry_run:
        shutil.rmtree(runs / name, ignore_errors=True)
    common = ["--job.config_file", os.environ.get("LAYOUT_RECIPE", "train_configs/k31_small.toml"),
              "--training.steps", str(env_int("LAYOUT_STEPS", 20)), "--metrics.log_freq", "1",
              "--compile.mode", os.environ.get("LAYOUT_COMPILE", "none"), "--profiling.enable", "true",
              "--profiling.steps", "-1"]
    return Command(python("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", "-m",
                          "titan_kimi.train", *common, "--job.dump_folder", str(runs / name), *overrides,
                          *shlex.split(os.environ.get("LAYOUT_EXTRA", ""))),
                   log=runs / f"{name}.log", timeout=env_int(timeout_var, timeout),
                   env={"CUDA_VISIBLE_DEVICES": devices})


def needs_gpus(r: Runner, part: str, n: int) -> bool:
    if r.gpu_count is not None and r.gpu_count < n:
        r.note(f"[{part}] skipped: {r.gpu_count} GPU(s) here, it needs {n}")
        return False
    return True


def summarize(r: Runner) -> None:
    folder = r.work / "layouts"
    r.run("layout_summary", Command(python("scripts/gpu/summarize_layout_runs.py", str(folder / "runs")),
                                    log=folder / "summary.md", timeout=60))
    if not r.dry_run and (folder / "summary.md").is_file():
        shutil.copy(folder / "summary.md", r.out / "summary.md")
        r.tail(folder / "summary.md", 30)
        pack_traces(r)


def pack_traces(r: Runner) -> None:
    """Rank 0's chrome trace of each run, newest first, while the archive stays under 15 MB (one returned file)."""
    traces = sorted((r.work / "layouts" / "runs").glob("*/profiles/step-*/rank0.trace.json.gz"),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    kept, size = [], 0
    for trace in traces:
        if size + trace.stat().st_size > 15_000_000:
            break
        kept.append(trace)
        size += trace.stat().st_size
    if kept:
        with tarfile.open(r.out / "traces.tar", "w") as tar:
            for trace in kept:
                tar.add(trace, arcname=str(trace.relative_to(r.work)))


def layout_refs(r: Runner, folder: Path) -> None:
    """The four one-GPU references, two at a time on GPUs 0 and 1."""
    if not needs_gpus(r, "layout_refs", 2):
        return
    r.run_side_by_side([("ref_b2", train(r, "ref_b2", 1, "0", "--training.global_batch_size", "2")),
                        ("ref_s16k", train(r, "ref_s16k", 1, "1", "--training.seq_len", "16384"))])
    r.run_side_by_side([("ref_pp_s4k", train(r, "ref_pp_s4k", 1, "0", "--model.flavor", "k31_small_pp",
                                             "--training.seq_len", "4096", "--training.local_batch_size", "4")),
                        ("ref_b1", train(r, "ref_b1", 1, "1"))])
    summarize(r)


def layout_fsdp_ep(r: Runner, folder: Path) -> None:
    if not needs_gpus(r, "layout_fsdp_ep", 2):
        return
    r.run("fsdp2", train(r, "fsdp2", 2, "0,1", "--parallelism.data_parallel_shard_degree", "2"))
    r.run("fsdp2_ep2", train(r, "fsdp2_ep2", 2, "0,1", "--parallelism.expert_parallel_degree", "2"))
    summarize(r)


def layout_pp(r: Runner, folder: Path) -> None:
    if not needs_gpus(r, "layout_pp", 2):
        return
    r.run("pp2_1f1b", train(r, "pp2_1f1b", 2, "0,1", "--parallelism.pipeline_parallel_degree", "2",
                            "--parallelism.pipeline_parallel_schedule", "1F1B", "--training.local_batch_size", "2"))
    r.run("pp2_zbv", train(r, "pp2_zbv", 2, "0,1", "--model.flavor", "k31_small_pp",
                           "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                           "ZBVZeroBubble", "--training.seq_len", "4096", "--training.local_batch_size", "4"))
    summarize(r)


def layout_cp(r: Runner, folder: Path) -> None:
    if not needs_gpus(r, "layout_cp", 2):
        return
    r.run("cp2", train(r, "cp2", 2, "0,1", "--parallelism.context_parallel_degree", "2",
                       "--parallelism.context_parallel_layout", "zigzag", "--training.seq_len", "16384"))
    summarize(r)


def layout_medium(r: Runner, folder: Path) -> None:
    """k31_medium at the largest PP x EP x FSDP degrees of this machine (4 or 8 GPUs), then FSDP alone.

    24 layers in two 12-layer AttnRes blocks: PP at most 2; 96 experts: EP divides 96 and dp_shard x cp, so with
    PP2 the rest is dp_shard = EP = N/2. Both runs checkpoint every second block (``MEDIUM_AC``, default
    "selective 2"; "none" for none): a first multi-GPU run cannot afford an OOM (docs/parallelism.md has the
    estimates).
    """
    n = 8 if (r.gpu_count or 8) >= 8 else 4
    if not needs_gpus(r, "layout_medium", 4):
        return
    mode, _, option = os.environ.get("MEDIUM_AC", "selective 2").partition(" ")
    ac = ["--activation_checkpoint.mode", mode] + (["--activation_checkpoint.selective_ac_option", option] if option else [])
    devices = ",".join(str(i) for i in range(n))
    name = f"med{n}_pp2_ep{n // 2}"
    r.run(name, train(r, name, n, devices, *MEDIUM, *ac, "--parallelism.pipeline_parallel_degree", "2",
                      "--parallelism.pipeline_parallel_schedule", "1F1B", "--parallelism.expert_parallel_degree",
                      str(n // 2), "--training.local_batch_size", "2", timeout_var="MEDIUM_TIMEOUT", timeout=270))
    r.run(f"med{n}_fsdp{n}", train(r, f"med{n}_fsdp{n}", n, devices, *MEDIUM, *ac,
                                   "--parallelism.data_parallel_shard_degree", str(n), "--training.local_batch_size",
                                   "1", timeout_var="MEDIUM_TIMEOUT", timeout=270))
    summarize(r)


def layout_medium_ref(r: Runner, folder: Path) -> None:
    """k31_medium's one-GPU references of 4 and 8 x 8,192 tokens (full activation checkpointing), side by side
    on GPUs 0 and 1 where there are two."""
    ref = [*MEDIUM, "--activation_checkpoint.mode", "full", "--training.local_batch_size", "1"]
    second = "1" if (r.gpu_count or 2) >= 2 else "0"
    runs = [(f"med_ref{k}", train(r, f"med_ref{k}", 1, device, *ref, "--training.global_batch_size", str(k),
                                  timeout_var="MEDIUM_REF_TIMEOUT", timeout=540)) for k, device in ((4, "0"), (8, second))]
    if second == "1":
        r.run_side_by_side(runs)
    else:
        for label, command in runs:
            r.run(label, command)
    summarize(r)


def layout_tests(r: Runner, folder: Path) -> None:
    """tests/test_multi_gpu.py: the EP all-to-all, PP hand-offs and CP layers on 2 NCCL ranks against one GPU."""
    if not needs_gpus(r, "layout_tests", 2):
        return
    log = folder / "test_multi_gpu.log"
    r.run("test_multi_gpu", Command(python("-m", "pytest", "-m", "gpu", "tests/test_multi_gpu.py", "-q", "-rs", "-rf",
                                           "--kernels-triton-autotune", "false"),
                                    log=log, timeout=300, interrupt=True))
    r.tail(log, 5)


def layout_collectives(r: Runner, folder: Path) -> None:
    """scripts/bench/collectives.py over every GPU of the machine: the step-time model's collectives measured."""
    if not needs_gpus(r, "layout_collectives", 2):
        return
    gpus = r.gpu_count or 2
    log = folder / "collectives.log"
    r.run("collectives", Command(python("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
                                        "scripts/bench/collectives.py", "--out", str(folder)),
                                 log=log, timeout=300, interrupt=True))
    r.tail(log, 12)


def layout_parts() -> list[Part]:
    return [
        Part("layout_refs", "2+ GPUs: the one-GPU references of the 2-GPU layouts, two at a time", layout_refs),
        Part("layout_fsdp_ep", "2 GPUs: FSDP2, then FSDP2 + EP2", layout_fsdp_ep),
        Part("layout_pp", "2 GPUs: PP2 1F1B and PP2 ZBVZeroBubble", layout_pp),
        Part("layout_cp", "2 GPUs: CP2 zigzag at 16,384 tokens", layout_cp),
        Part("layout_tests", "2 GPUs: tests/test_multi_gpu.py", layout_tests),
        Part("layout_collectives", "2+ GPUs: all-gather, reduce-scatter, all-to-all over every GPU against the "
                                   "step-time model's bandwidths", layout_collectives),
        Part("layout_medium", "4 or 8 GPUs: k31_medium PP2 x EP x FSDP, then FSDP alone (MEDIUM_AC, MEDIUM_TIMEOUT)",
             layout_medium),
        Part("layout_medium_ref", "k31_medium's one-GPU references (MEDIUM_REF_TIMEOUT)", layout_medium_ref),
    ]
