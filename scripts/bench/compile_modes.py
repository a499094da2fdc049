"""Training steps of one flavor under each [compile] mode, same seed and data: python scripts/bench/compile_modes.py --flavor k31_debug --modes none,default --out DIR

    python scripts/bench/compile_modes.py --flavor k31_debug --steps 3 --seq-len 32 --batch 2 \\
        --modes none,default --out outputs/ablate_k31_debug [-- --kernels.kda fla ...]

Each mode builds a fresh ``titan_kimi.trainer.Trainer`` from a recipe (``--config``, else
``train_configs/<flavor>.toml`` when it exists, else the defaults) with the shape and mode overrides, and
trains ``--steps`` steps. Arguments after ``--`` are more job-config overrides, applied to every mode.
Written to ``--out``: ``results.json`` (every number, the loss curves, the environment), ``results.md`` (the
table) and ``results.png`` (bar charts; needs matplotlib, or pass ``--no-plot``). With ``--append`` the modes
run now are merged into an existing ``results.json`` of the same setup, so a long mode list can be split over
several processes.

Columns: tokens/s and step time are medians over the steps after the first (use >= 5 steps: the packed
document count changes at step 2 and recompiles once). compile = first step minus the median step, cold by
default (``--cache fresh``: each mode compiles into an empty Inductor/Triton cache; ``--cache warm`` shows what
a rerun costs); without ``--warmup`` the first mode of a process also pays kernel autotuning and Inductor's
start-up. dynamo s = the compile_times() total (Dynamo tracing + Inductor, forward and backward, recompiles
included). Graphs and graph breaks come from torch._dynamo.utils.counters; recompiles = compiles of a frame
beyond its first. max |dloss| is against the ``none`` run of the same setup. Peak memory is
torch.cuda.max_memory_allocated on CUDA (reset per mode), the process's peak RSS on CPU (a high-water mark that
never goes down between modes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch._dynamo.convert_frame
from torch._dynamo.utils import compilation_time_metrics, counters

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lowerings.inductor.modes import compile_mode, compile_mode_names  # noqa: E402
from lowerings.inductor.passes import COUNTER  # noqa: E402
from titan_kimi.training.setup.kernels import configure_kernels  # noqa: E402
from titan_kimi.config import load_job_config  # noqa: E402
from titan_kimi.training.process.distributed import DistEnv  # noqa: E402
from titan_kimi.parallel.layout import resolve_layout  # noqa: E402
from titan_kimi.training.setup.build import model_args_from_config  # noqa: E402

SETUP_KEYS = ("flavor", "config", "steps", "seq_len", "batch", "n_layers", "overrides", "device", "cache",
              "lr_warmup_steps")


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes:
        raise ValueError(f"--modes {text!r} names no mode; valid: {compile_mode_names()}")
    for mode in modes:
        compile_mode(mode)  # ValueError naming the valid modes
    if len(set(modes)) != len(modes):
        raise ValueError(f"--modes {text!r} repeats a mode")
    return modes


def recipe_for(flavor: str, config: str | None) -> str | None:
    if config:
        if not Path(config).is_file():
            raise ValueError(f"--config {config!r} is not a file")
        return config
    path = ROOT / "train_configs" / f"{flavor}.toml"
    return str(path) if path.is_file() else None


def job_argv(opts: argparse.Namespace, mode: str, dump: Path) -> list[str]:
    argv = ["--job.config_file", opts.recipe] if opts.recipe else []
    argv += [
        "--model.flavor", opts.flavor, "--training.steps", str(opts.steps),
        "--training.seq_len", str(opts.seq_len), "--training.local_batch_size", str(opts.batch),
        "--training.global_batch_size", "-1", "--compile.mode", mode, "--job.dump_folder", str(dump),
        "--checkpoint.enable", "false", "--validation.enable", "false", "--metrics.progress", "off",
        # The recipe's warm-up may be longer than a short ablation; the schedule is the same for every mode.
        "--lr_scheduler.warmup_steps", str(min(opts.lr_warmup_steps, opts.steps)),
    ]
    return argv + list(opts.overrides)


def build_trainer(opts: argparse.Namespace, mode: str, dump: Path):
    from titan_kimi.trainer import Trainer

    cfg = load_job_config(job_argv(opts, mode, dump), environ={})
    args = model_args_from_config(cfg)
    if opts.n_layers:  # a shorter stack of the same flavor (layer pattern recomputed for n_layers)
        args = dataclasses.replace(args, n_layers=opts.n_layers, kda_layers=(), full_attn_layers=())
    configure_kernels(cfg.kernels, args)
    return Trainer(cfg, args, resolve_layout(cfg, 1, args), DistEnv(0, 1, 0))


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def warmup(opts: argparse.Namespace, device: torch.device) -> float:
    """Pay the one-off costs before the first measured mode: kernel autotuning (FLA, Triton) in one untimed
    eager step, and Inductor's start-up (compiler workers, headers) in a tiny compile."""
    t0 = time.perf_counter()
    trainer = build_trainer(opts, "none", opts.out / "runs" / "_warmup")
    trainer.train_step(iter(trainer.dataloader))
    trainer.close()
    del trainer
    tiny = torch.compile(lambda x: torch.tanh(x) * 2 + 1, backend="inductor", fullgraph=True)
    tiny(torch.randn(8, device=device, requires_grad=True)).sum().backward()
    torch._dynamo.reset()
    release(device)
    return time.perf_counter() - t0


def recompiles() -> int:
    # Compiles per Dynamo frame beyond the first (a guard failed); reset by torch._dynamo.reset().
    per_frame = getattr(torch._dynamo.convert_frame, "FRAME_COMPILE_COUNTER", {})
    return sum(max(0, n - 1) for n in per_frame.values())


def dynamo_seconds() -> float:
    # Top-level Dynamo frames (tracing + the Inductor forward compile) plus the lazily compiled backward.
    keys = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")
    return sum(sum(compilation_time_metrics.get(k, [])) for k in keys)


def inductor_caches(kind: str) -> contextlib.AbstractContextManager:
    """``fresh``: a new, empty Inductor/Triton cache for the mode (cold compile times, nothing reused from the
    modes before it: they share most kernels); ``warm``: whatever caches the environment has."""
    if kind == "warm":
        return contextlib.nullcontext()
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache  # renamed in torch 2.8
    return fresh()


def profile_step(trainer, device: torch.device, path: Path) -> None:
    """One more training step under torch.profiler (after the measured ones, compiled and warm): the kernels
    by total device time, to see where a mode spends its step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        trainer.train_step(iter(trainer.dataloader))
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=50, max_name_column_width=80) + "\n")
    print(f"[ablate] profile of one step -> {path}", flush=True)


def run_mode(opts: argparse.Namespace, mode: str, device: torch.device) -> dict[str, Any]:
    torch._dynamo.reset()
    counters.clear()
    release(device)
    row: dict[str, Any] = {"mode": mode, "cache": opts.cache}
    t0 = time.perf_counter()
    try:
        with inductor_caches(opts.cache):
            trainer = build_trainer(opts, mode, opts.out / "runs" / mode)
            try:
                trainer.train()
                history = list(trainer.metrics.history)
                if opts.profile:
                    profile_step(trainer, device, opts.out / f"profile_{mode}.txt")
            finally:
                trainer.close()
                del trainer
    except Exception as err:  # one failing mode must not hide the others' numbers
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:500]
        row["traceback"] = traceback.format_exc(limit=20)
        print(f"[ablate] {mode}: FAILED {row['error']}", flush=True)
        return row
    finally:
        row["wall_s"] = time.perf_counter() - t0
    times = [m.step_time for m in history]
    steady = times[1:] or times
    row.update(
        step_time_s=statistics.median(steady),
        first_step_s=times[0],
        tokens_per_s=statistics.median([m.tokens_per_sec for m in history[1:]] or [history[0].tokens_per_sec]),
        peak_mem_gib=max(m.peak_mem_gib for m in history),
        losses=[m.loss for m in history],
        graphs=int(counters["stats"]["unique_graphs"]),
        graph_breaks=int(sum(counters["graph_break"].values())),
        recompiles=recompiles(),
        dynamo_s=dynamo_seconds(),
        situ_glu_rewrites=int(counters[COUNTER]["situ_glu_rewrites"]),
    )
    row["compile_s"] = max(0.0, row["first_step_s"] - row["step_time_s"])
    release(device)
    print(f"[ablate] {mode}: step {row['step_time_s']:.4f}s tok/s {row['tokens_per_s']:.1f} "
          f"compile {row['compile_s']:.1f}s graphs {row['graphs']} breaks {row['graph_breaks']}", flush=True)
    return row


def add_loss_diffs(runs: list[dict[str, Any]]) -> None:
    eager = next((r for r in runs if r["mode"] == "none" and "losses" in r), None)
    for r in runs:
        if eager is None or "losses" not in r:
            r["max_abs_dloss"] = None
            continue
        pairs = list(zip(r["losses"], eager["losses"]))
        r["max_abs_dloss"] = max(abs(a - b) for a, b in pairs)
        r["mean_abs_dloss"] = sum(abs(a - b) for a, b in pairs) / len(pairs)  # the tolerance docs/perf.md states
        # relative: the curves fall by >10x, so one absolute bound says little about the late steps
        r["max_rel_dloss"] = max(abs(a - b) / abs(b) for a, b in pairs if b)
        r["step1_rel_dloss"] = abs(pairs[0][0] - pairs[0][1]) / abs(pairs[0][1]) if pairs[0][1] else None


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


COLUMNS = ("mode", "tokens/s", "speed-up", "step s", "first step s", "compile s", "dynamo s", "peak GiB", "graphs",
           "breaks", "recompiles", "SiTU-GLU rewrites", "max \\|dloss\\| vs eager", "mean \\|dloss\\|",
           "max rel dloss", "step-1 rel dloss")


def markdown(setup: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    memory = "torch.cuda.max_memory_allocated" if setup["device"].startswith("cuda") else "peak RSS of the process"
    lines = [
        f"Compile-mode ablation: `{setup['flavor']}`"
        + (f" ({setup['n_layers']} layers)" if setup["n_layers"] else "")
        + f", {setup['steps']} steps of {setup['batch']} x {setup['seq_len']} tokens on {setup['device_name']}"
        f" (torch {setup['torch']}, triton {setup['triton']}); LR warm-up {setup.get('lr_warmup_steps', 0)} steps;"
        f" {setup.get('cache', 'fresh')} Inductor caches; peak GiB = {memory}; speed-up = tokens/s over `none`.", "",
        "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS),
    ]
    eager_tps = next((r["tokens_per_s"] for r in runs if r["mode"] == "none" and "error" not in r), None)
    for r in runs:
        if "error" in r:
            lines.append(f"| {r['mode']} | failed: {r['error'].replace('|', '/')} |" + " |" * (len(COLUMNS) - 2))
            continue
        speedup = r["tokens_per_s"] / eager_tps if eager_tps and r.get("tokens_per_s") else None
        cells = [r["mode"], _fmt(r["tokens_per_s"], ",.0f"), _fmt(speedup, ".2f") + ("x" if speedup else ""),
                 _fmt(r["step_time_s"], ".4f"),
                 _fmt(r["first_step_s"], ".2f"), _fmt(r["compile_s"], ".2f"), _fmt(r["dynamo_s"], ".2f"),
                 _fmt(r["peak_mem_gib"], ".2f"), str(r["graphs"]), str(r["graph_breaks"]), str(r["recompiles"]),
                 str(r["situ_glu_rewrites"]), _fmt(r["max_abs_dloss"], ".3g"), _fmt(r.get("mean_abs_dloss"), ".3g"),
                 _fmt(r.get("max_rel_dloss"), ".3g"), _fmt(r.get("step1_rel_dloss"), ".2g")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(path: Path, setup: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError(
            f"the bar chart needs matplotlib ({err}); install it (`pip install matplotlib`) or pass --no-plot"
        ) from err
    ok = [r for r in runs if "error" not in r]
    names = [r["mode"] for r in ok]
    panels = (("tokens_per_s", "tokens/s (median)"), ("step_time_s", "step time, s (median)"),
              ("compile_s", "compile time, s (first step - median)"), ("peak_mem_gib", "peak memory, GiB"))
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (key, title) in zip(axes.flat, panels):
        values = [r[key] for r in ok]
        bars = ax.bar(names, values, color="#4c72b0")
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(f"{setup['flavor']}: {setup['steps']} steps x {setup['batch']} x {setup['seq_len']} tokens "
                 f"on {setup['device_name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge_previous(out: Path, setup: dict[str, Any], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    path = out / "results.json"
    if not path.is_file():
        return runs
    previous = json.loads(path.read_text())
    differ = [k for k in SETUP_KEYS if previous["setup"].get(k) != setup.get(k)]
    if differ:
        raise ValueError(f"--append: {path} was made with another setup ({', '.join(differ)} differ); "
                         f"use another --out or drop --append")
    fresh = {r["mode"] for r in runs}
    return [r for r in previous["runs"] if r["mode"] not in fresh] + runs


def environment(device: torch.device) -> dict[str, Any]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    return {
        "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="k31_debug")
    parser.add_argument("--config", default=None, help="recipe TOML (default train_configs/<flavor>.toml)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--n-layers", type=int, default=0, help="train a shorter stack of the flavor (0 = all)")
    parser.add_argument("--modes", default=",".join(compile_mode_names()))
    parser.add_argument("--out", type=Path, default=None, help="output folder (required unless --replot)")
    parser.add_argument("--replot", type=Path, default=None, metavar="DIR",
                        help="only rewrite DIR/results.md and DIR/results.png from DIR/results.json (e.g. off the GPU)")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                        help="first an untimed eager step and a tiny compile, so kernel autotuning and Inductor "
                             "start-up are not charged to the first mode (default: on with CUDA)")
    parser.add_argument("--cache", choices=("fresh", "warm"), default="fresh",
                        help="Inductor/Triton caches per mode: fresh = empty (cold compile), warm = the environment's")
    parser.add_argument("--dump-fla-configs", type=Path, default=None, metavar="DIR",
                        help="after the warm-up, write FLA's tuned kernel configs here (lowerings/kernels/fla_config_cache.py)")
    parser.add_argument("--profile", action="store_true",
                        help="after each mode's steps, profile one more step into OUT/profile_<mode>.txt")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG (which needs matplotlib)")
    parser.add_argument("--append", action="store_true", help="merge into an existing results.json")
    parser.add_argument("--lr-warmup-steps", type=int, default=0,
                        help="LR warm-up steps (capped at --steps; the same for every mode)")
    split = argv.index("--") if "--" in argv else len(argv)  # after "--": job-config overrides
    opts = parser.parse_args(argv[:split])
    opts.overrides = argv[split + 1:]
    if opts.replot is None and opts.out is None:
        parser.error("--out is required (or --replot DIR)")
    if opts.steps < 2:
        parser.error(f"--steps {opts.steps}: need at least 2 (the first step is compile + warm-up)")
    for name in ("seq_len", "batch"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if opts.n_layers < 0:
        parser.error("--n-layers must be >= 0")
    opts.mode_list = parse_modes(opts.modes)
    opts.recipe = recipe_for(opts.flavor, opts.config)
    return opts


def replot(folder: Path, plot_png: bool = True) -> int:
    """Rewrite results.md (and results.png) from an existing results.json."""
    path = folder / "results.json"
    if not path.is_file():
        raise ValueError(f"--replot {folder}: no results.json there")
    data = json.loads(path.read_text())
    add_loss_diffs(data["runs"])
    table = markdown(data["setup"], data["runs"])
    (folder / "results.md").write_text(table)
    print(table)
    if plot_png:
        plot(folder / "results.png", data["setup"], data["runs"])
    return 0


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    if opts.replot is not None:
        return replot(opts.replot, plot_png=not opts.no_plot)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    opts.out.mkdir(parents=True, exist_ok=True)
    setup = {
        "flavor": opts.flavor, "config": opts.recipe, "steps": opts.steps, "seq_len": opts.seq_len,
        "batch": opts.batch, "n_layers": opts.n_layers, "overrides": opts.overrides, "device": str(device),
        "cache": opts.cache, "lr_warmup_steps": opts.lr_warmup_steps,
        "modes": opts.mode_list, **environment(device),
    }
    if opts.warmup if opts.warmup is not None else device.type == "cuda":
        setup["warmup_s"] = warmup(opts, device)
        print(f"[ablate] eager warm-up step (kernel autotuning): {setup['warmup_s']:.1f}s", flush=True)
    if opts.dump_fla_configs is not None and "fla" in sys.modules:
        from lowerings.kernels.fla_config_cache import dump_fla_configs

        n = dump_fla_configs(opts.dump_fla_configs)
        print(f"[ablate] wrote {n} FLA config entries to {opts.dump_fla_configs}", flush=True)
    # Eager first: it is the loss reference, and it runs without any compile state around.
    order = sorted(opts.mode_list, key=lambda m: m != "none")
    runs = [run_mode(opts, mode, device) for mode in order]
    torch._dynamo.reset()
    if opts.append:
        runs = merge_previous(opts.out, setup, runs)
    add_loss_diffs(runs)
    (opts.out / "results.json").write_text(json.dumps({"setup": setup, "runs": runs}, indent=2) + "\n")
    table = markdown(setup, runs)
    (opts.out / "results.md").write_text(table)
    print(table)
    if not opts.no_plot:
        plot(opts.out / "results.png", setup, runs)
    failed = [r["mode"] for r in runs if "error" in r]
    if failed:
        print(f"[ablate] failed modes: {failed} (see results.json for tracebacks)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
