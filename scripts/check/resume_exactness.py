"""Resume exactness, straight vs stopped + resumed runs: python scripts/check/resume_exactness.py --out DIR [--smoke]

On the GPU it runs k3_small for 20 steps (about 6 minutes on one H200); --smoke runs the tiny k31_debug recipe on
a CPU to check the script. report.md and report.json land under --out.

Every run is the trainer's command line (``python -m titan_kimi.train``) in its own process, so a "cold" run
starts with an empty compile cache (``compile.cache_dir``) and a "warm" one finds the cache the first run filled.
The first half is its own run of N/2 steps, extended to N from its final save (the trainer's hardest resume: its
saved schedule differs from the longer run's); ``lr_scheduler.warmup_steps = N/2`` makes both schedules give
the same lr for the first N/2 steps, so the two halves together must equal the straight run.

Runs, in order (each one's log and metrics are kept under --out; checkpoints and caches live under --work and are
deleted as soon as no later run needs them):
  straight_cold   N steps, empty cache (fills it)
  first_half      N/2 steps, warm cache, saves step N/2 (model, optimizer, schedule, data position, RNG)
  resumed_warm    resumes step N/2 to N, warm cache
  straight_warm   N steps, warm cache: against straight_cold, the spread of the kernels themselves
  resumed_cold    resumes step N/2 to N again, with a new empty cache
A run still going when --budget-s is spent is stopped and the runs after it are skipped; the report says which.
More overrides for every run go after ``--`` (e.g. ``-- --compile.mode none``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_RECIPE = ["--job.config_file", "train_configs/k3_small.toml"]
# k31_debug at its smallest: seconds per step on a CPU.
SMOKE_RECIPE = ["--job.config_file", "train_configs/k31_debug.toml", "--training.seq_len", "32",
                "--training.local_batch_size", "2"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for report.md, report.json, logs, metrics")
    parser.add_argument("--work", type=Path, default=Path("/tmp/resume_exactness"),
                        help="scratch folder for checkpoints and compile caches (deleted at the end)")
    parser.add_argument("--steps", type=int, default=None, help="N (even; default 20, --smoke 4)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="wall-clock seconds for all runs")
    parser.add_argument("--smoke", action="store_true", help="the tiny CPU recipe (k31_debug), to check the script")
    parser.add_argument("overrides", nargs="*", help="after --: more --section.key value overrides for every run")
    opts = parser.parse_args(argv)
    opts.steps = opts.steps or (4 if opts.smoke else 20)
    if opts.steps < 2 or opts.steps % 2:
        parser.error(f"--steps {opts.steps}: must be an even number >= 2 (the run is split in two halves)")
    if opts.budget_s <= 0:
        parser.error(f"--budget-s {opts.budget_s}: must be > 0")
    return opts


def train(name: str, argv: list[str], opts: argparse.Namespace, deadline: float) -> dict:
    """One trainer process; returns its exit status, wall time and the steps its metrics.jsonl logged."""
    log, metrics = opts.out / "logs" / f"{name}.log", opts.work / name / "metrics.jsonl"
    timeout = deadline - time.monotonic()
    if timeout < 10:
        return {"rc": None, "skipped": "no time left in --budget-s"}
    start = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        try:
            rc = subprocess.run([sys.executable, "-m", "titan_kimi.train", *argv], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    steps = [{"step": r["step"], "loss": r["loss"], "grad_norm": r["grad_norm"], "lr": r["lr"],
              "step_time": r["step_time"]} for r in rows if "loss" in r and "step" in r]
    if metrics.is_file():
        shutil.copy(metrics, opts.out / "metrics" / f"{name}.jsonl")
    text = log.read_text(errors="replace")
    return {"rc": rc, "wall_s": round(time.monotonic() - start, 1), "steps": steps,
            "resumed": next((line.split("resumed from ", 1)[1] for line in text.splitlines()
                             if "resumed from " in line), None)}


def compare(a: list[dict], b: list[dict]) -> dict:
    """Step by step, the losses and grad norms of two runs: bit-identical or not, and the largest differences."""
    by_step = {row["step"]: row for row in b}
    pairs = [(row, by_step[row["step"]]) for row in a if row["step"] in by_step]
    if not pairs:
        return {"steps_compared": 0}
    first = next((x["step"] for x, y in pairs if x["loss"] != y["loss"] or x["grad_norm"] != y["grad_norm"]), None)
    out = {"steps_compared": len(pairs), "bit_identical": first is None, "first_different_step": first,
           "lr_identical": all(x["lr"] == y["lr"] for x, y in pairs)}
    for key in ("loss", "grad_norm"):
        diffs = [abs(x[key] - y[key]) for x, y in pairs]
        rels = [d / abs(y[key]) if y[key] else math.inf * bool(d) for d, (_, y) in zip(diffs, pairs)]
        out[f"max_abs_{key}"], out[f"max_rel_{key}"] = max(diffs), max(rels)
    return out


def environment() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                        check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = None
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    deadline = time.monotonic() + opts.budget_s
    for sub in ("logs", "metrics"):
        (opts.out / sub).mkdir(parents=True, exist_ok=True)
    shutil.rmtree(opts.work, ignore_errors=True)
    n, half = opts.steps, opts.steps // 2
    base = [*(SMOKE_RECIPE if opts.smoke else GPU_RECIPE), "--lr_scheduler.warmup_steps", str(half),
            "--metrics.log_freq", "1", "--metrics.progress", "off", *opts.overrides]
    cache = lambda name: ["--compile.cache_dir", str(opts.work / f"cache_{name}")]
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.folder", str(opts.work / "checkpoint")]
    saves_half = [*ckpt, "--checkpoint.interval", str(half)]  # its final save is due as an interval save: resumable
    resumes = [*ckpt, "--checkpoint.interval", str(n + 1)]  # its final save holds the model only (a third the size)
    plan = [
        ("straight_cold", [*base, *cache("a"), "--training.steps", str(n)]),
        ("first_half", [*base, *cache("a"), *saves_half, "--training.steps", str(half)]),
        ("resumed_warm", [*base, *cache("a"), *resumes, "--training.steps", str(n)]),
        ("straight_warm", [*base, *cache("a"), "--training.steps", str(n)]),
        ("resumed_cold", [*base, *cache("b"), *resumes, "--training.steps", str(n)]),
    ]
    runs: dict[str, dict] = {}
    for name, args in plan:
        if name.startswith("resumed") and runs.get("first_half", {}).get("rc") != 0:
            runs[name] = {"rc": None, "skipped": "first_half did not save its checkpoint"}
            continue
        runs[name] = train(name, [*args, "--job.dump_folder", str(opts.work / name)], opts, deadline)
        print(f"resume_exactness: {name}: rc {runs[name]['rc']}, {runs[name].get('wall_s')} s", flush=True)
        if name.startswith("resumed"):  # its final save (model only): the next resume needs step N/2 only
            shutil.rmtree(opts.work / "checkpoint" / f"step-{n}", ignore_errors=True)
    shutil.rmtree(opts.work, ignore_errors=True)

    steps = {name: run.get("steps", []) for name, run in runs.items()}
    halves = {name: [r for r in steps["first_half"] if r["step"] <= half] + [r for r in steps[name] if r["step"] > half]
              for name in ("resumed_warm", "resumed_cold")}
    comparisons = {
        "spread: straight_warm vs straight_cold": compare(steps["straight_warm"], steps["straight_cold"]),
        "first_half vs straight_cold": compare(steps["first_half"], steps["straight_cold"]),
        "resumed_warm vs straight_cold": compare(halves["resumed_warm"], steps["straight_cold"]),
        "resumed_warm vs straight_warm": compare(halves["resumed_warm"], steps["straight_warm"]),
        "resumed_cold vs straight_cold": compare(halves["resumed_cold"], steps["straight_cold"]),
        "resumed_cold vs straight_warm": compare(halves["resumed_cold"], steps["straight_warm"]),
    }
    complete = all(run.get("rc") == 0 and len(run.get("steps", [])) == (half if name == "first_half" else n)
                   for name, run in runs.items())
    report = {"steps": n, "resume_at": half, "recipe": base, "environment": environment(), "complete": complete,
              "runs": runs, "comparisons": comparisons}
    (opts.out / "report.json").write_text(json.dumps(report, indent=1))
    (opts.out / "report.md").write_text(markdown(report))
    print((opts.out / "report.md").read_text())
    return 0 if complete else 1


def markdown(report: dict) -> str:
    env, runs = report["environment"], report["runs"]
    lines = [f"# Resume exactness: {report['steps']} steps straight vs {report['resume_at']} + resume + "
             f"{report['steps'] - report['resume_at']}", "",
             f"commit {env.get('commit')}, {env['device']}, torch {env['torch']}, cuda {env.get('cuda')}, "
             f"triton {env.get('triton')}; recipe `{' '.join(report['recipe'])}`", "",
             "| run | exit | wall s | steps logged | resumed from |", "|---|---|---|---|---|"]
    for name, run in runs.items():
        lines.append(f"| {name} | {run.get('rc')}{' (' + run['skipped'] + ')' if 'skipped' in run else ''} | "
                     f"{run.get('wall_s', '')} | {len(run.get('steps', []))} | {run.get('resumed') or ''} |")
    lines += ["", "| comparison | steps | bit-identical | first different step | max rel loss | max rel grad norm |"
              " lr identical |", "|---|---|---|---|---|---|---|"]
    for name, c in report["comparisons"].items():
        if not c.get("steps_compared"):
            lines.append(f"| {name} | 0 | | | | | |")
            continue
        lines.append(f"| {name} | {c['steps_compared']} | {c['bit_identical']} | {c['first_different_step'] or ''} "
                     f"| {c['max_rel_loss']:.3e} | {c['max_rel_grad_norm']:.3e} | {c['lr_identical']} |")
    lines += ["", "Bit-identical straight runs (the spread row) mean the kernels are deterministic here, and then a "
              "resumed run must be bit-identical too; otherwise the resumed rows should differ by no more than the "
              "spread row does."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
