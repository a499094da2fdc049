"""One rank's share of a recipe and layout, timed: python scripts/bench/rank_slice.py --config RECIPE --out DIR
(per layer kind, and its whole schedule with peak memory), e.g.
python scripts/bench/rank_slice.py --config train_configs/k31.toml --world-size 256 --out DIR [--parts ...]
[--stage N] [--loads balanced zipf:0.3] [config overrides such as --parallelism.pipeline_parallel_degree 4].

Builds exactly what pipeline rank ``--stage``'s owner holds (the busiest stage by model FLOPs by default) at the
recipe's widths: its stages' layers, one EP rank's local experts (the rows it would receive under ``--loads``
instead of the all-to-all; under ``expert_parallel_dispatch = hierarchical`` with that dispatch's own local work,
over nodes of ``expert_parallel_node_size``, else ``step_time.gpus_per_node``), the recipe's dtype, activation checkpointing, compile and kernels, microbatches of
the recipe's length and row layout (``--rows``; by default the recipe's dataset: padded MedPix rows with one
image, padded HellaSwag rows, packed text). Communication is left out (the step-time estimate adds it).

Parts (``--parts``, in this order; results are written after each one, so a run cut short keeps what finished):
  tune_fla  FLA's autotune of the KDA kernels at this run's shapes (GPU only), dumped with the shipped configs
            into DIR/fla_configs/<GPU>/ (copy into lowerings/kernels/fla_configs/ to ship them); later parts of
            the same run use them.
  layers    each layer kind of the built stages at the recipe's microbatch: the block with its checkpointing,
            its attention and FFN apart; the MoE under every --loads; the vision tower per image; head + loss
            (the last stage's norm and head built alone when the rank holds none); one optimizer step per
            parameter.
  gradients the block kinds twice, back to back: each backward adding its gradients into the ones held from the
            previous run (as the layers part times them), then making them anew, as FSDP training does when it
            reduces every microbatch (or has one): what the add costs. Not in the step-time table.
  profile   each layer kind (block, attention, FFN) under torch's profiler, forward and backward apart: device
            kernel time by category (GEMMs, KDA, Triton, Inductor-fused, eager elementwise, memory) and the
            device's idle time, top kernels (DIR/profile.md, DIR/profile.json).
  dsa       the DSA attention (indexer + sparse MLA) on rows of one document of each --dsa-rows length.
  gemm      the routed experts' GEMMs alone under every load: grouped_mm (what runs), one mm per expert, and one
            dense GEMM chain of the same FLOPs (the floor).
  table     the block kinds again at --table-tokens tokens per microbatch (one document per row).
  stage     the rank's schedule over its microbatches (every stage's forward / backward per microbatch, the
            step's span) and its peak memory with the FSDP shards and Adam moments allocated beside.
Writes DIR/rank_slice.json and DIR/rank_slice.md, and merges the entries into the step-time table
(--table, default DIR/step_time_h200.json; copy it to titan_kimi/parallel/step_time_h200.json to ship it).
A/B in one run: ``--variants NAME="OVERRIDES" ...`` (e.g. eager="" compile="--compile.mode default"
sparse_cudnn="--kernels.sparse_mla cudnn") rebuilds the slice once per variant after the parts above, runs
``--variant-parts`` (default layers) with the variant's config overrides added, and writes DIR/variants.md
(forward + backward ms per item and the speed-up over the first variant) and DIR/variants/NAME/. Variants do
not go into the step-time table. A variant that fails is reported and the next one runs.
On a CPU, a smoke run: a debug flavor and a small layout through the same overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("tune_fla", "layers", "gradients", "profile", "dsa", "gemm", "table", "stage")
VARIANT_PARTS = ("layers", "gradients", "profile", "gemm", "stage")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the recipe (a TOML under train_configs/ or a path)")
    parser.add_argument("--world-size", type=int, required=True, help="GPUs of the layout (job.world_size)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the results")
    parser.add_argument("--parts", nargs="*", default=list(PARTS), choices=PARTS,
                        help="what to run (none: only the --variants)")
    parser.add_argument("--stage", type=int, default=-1, help="pipeline stage to build; -1 = the busiest")
    parser.add_argument("--loads", nargs="+", default=["balanced", "zipf:0.3"],
                        help="expert loads of the MoE entries: balanced, zipf:<exponent>, file:<counts.json>")
    parser.add_argument("--rows", default="", help="row layout (padded:<valid>, packed:<documents>, "
                        "medpix:<text tokens>:<H>x<W>); default: the recipe's dataset")
    parser.add_argument("--max-layers", type=int, default=0, help="build at most this many layers per stage "
                        "(0 = all); the rest are timed by their kind")
    parser.add_argument("--dsa-rows", type=int, nargs="*", default=[4096, 8192], help="row lengths of the dsa part")
    parser.add_argument("--table-tokens", type=int, nargs="*", default=[512, 1024, 2048, 8192],
                        help="tokens per microbatch of the table part")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before each measurement")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median)")
    parser.add_argument("--steps", type=int, default=2, help="schedule runs of the stage part (the last reported)")
    parser.add_argument("--table", type=Path, default=None, help="step-time table to merge into "
                        "(default DIR/step_time_h200.json)")
    parser.add_argument("--tune-timeout", type=int, default=360, help="seconds the FLA tuning may take")
    parser.add_argument("--tune-tokens", type=int, nargs="*", default=[],
                        help="tokens per KDA call to tune FLA at (default: this run's microbatch)")
    parser.add_argument("--variants", nargs="*", default=[], help='A/B variants: NAME="config overrides"')
    parser.add_argument("--variant-parts", nargs="+", default=["layers"], choices=VARIANT_PARTS,
                        help="parts each variant runs")
    opts, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("--") and "." not in o]
    if bad:
        parser.error(f"unknown options {bad}; config overrides look like --section.key value")
    if not opts.parts and not opts.variants:
        parser.error("--parts is empty and there are no --variants: nothing to run")
    if opts.warmup < 0 or opts.repeats < 1 or opts.steps < 1 or opts.max_layers < 0:
        parser.error("--warmup >= 0, --repeats >= 1, --steps >= 1 and --max-layers >= 0")
    for v in opts.variants:
        name, sep, _ = v.partition("=")
        if not sep or not name.isidentifier():
            parser.error(f"--variants {v!r}: expected NAME=\"--section.key value ...\" with NAME a word")
    opts.command = "python scripts/bench/rank_slice.py " + " ".join(shlex.quote(a) for a in argv)
    return opts, overrides


def log(msg: str) -> None:
    print(f"[rank_slice {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prepare_fla_dir(out: Path) -> Path | None:
    """Before anything imports fla: point FLA at DIR/fla_configs/<GPU>, seeded with the shipped configs."""
    import torch

    if not torch.cuda.is_available() or "FLA_CONFIG_DIR" in os.environ or "FLA_CACHE_MODE" in os.environ:
        return None
    from lowerings.kernels.fla_config_cache import CONFIG_ROOT, SHIPPED_MODE, sanitize_gpu_name

    name = sanitize_gpu_name(torch.cuda.get_device_name(0))
    target = out / "fla_configs" / name
    target.mkdir(parents=True, exist_ok=True)
    if (CONFIG_ROOT / name).is_dir():
        for f in (CONFIG_ROOT / name).glob("*.json"):
            shutil.copy(f, target / f.name)
    os.environ["FLA_CONFIG_DIR"], os.environ["FLA_CACHE_MODE"] = str(target), SHIPPED_MODE
    return target


def tune_fla(target: Path, heads: int, head_dim: int, tokens: list[int], timeout: int) -> dict:
    """FLA's autotune at this run's KDA shape in a fresh process (``tune_fla_configs.py``), merged into target."""
    script = next(iter(sorted((ROOT / "scripts").rglob("tune_fla_configs.py"))), None)
    if script is None:
        return {"status": "scripts/**/tune_fla_configs.py not found"}
    cmd = [sys.executable, str(script), "--heads", str(heads), "--dim", str(head_dim), "--seq-lens", *map(str, tokens),
           "--varlen-docs", "2", "--out", str(target), "--no-check"]
    env = {k: v for k, v in os.environ.items() if k not in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR")}
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, cwd=ROOT, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"status": f"timed out after {timeout} s", "command": " ".join(cmd)}
    print(done.stdout[-4000:], done.stderr[-2000:], flush=True)
    return {"status": "ok" if done.returncode == 0 else f"exit {done.returncode}", "seconds": time.perf_counter() - start,
            "command": " ".join(cmd)}


def main(argv: list[str]) -> int:
    opts, overrides = parse_args(argv)
    opts.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    fla_dir = prepare_fla_dir(opts.out) if "tune_fla" in opts.parts else None
    from titan_kimi.parallel.rank_slice.bench import RankSliceBench

    bench = RankSliceBench(opts, overrides, log) if opts.parts else None
    report = bench.report if bench is not None else {}
    for part in [p for p in PARTS if p in opts.parts]:
        log(f"part {part}")
        start = time.perf_counter()
        if part == "tune_fla":
            if fla_dir is None:
                report["tune_fla"] = {"status": "skipped: no CUDA device, or FLA_CONFIG_DIR / FLA_CACHE_MODE set"}
            elif not bench.kda_shape:
                report["tune_fla"] = {"status": "skipped: no KDA layer in the built stages"}
            else:
                heads, dim, tokens = bench.kda_shape
                report["tune_fla"] = tune_fla(fla_dir, heads, dim, opts.tune_tokens or [tokens], opts.tune_timeout)
                report["tune_fla"]["configs"] = str(fla_dir)
        else:
            try:
                getattr(bench, f"run_{part}")()
            except Exception as err:  # e.g. out of memory: record it, free what it held, run the next part
                log(f"part {part} failed: {type(err).__name__}: {str(err)[:500]}")
                report[part] = {"error": f"{type(err).__name__}: {str(err)[:2000]}"}
                bench.free_cached()
        report.setdefault("part_seconds", {})[part] = round(time.perf_counter() - start, 1)
        bench.write()
        log(f"part {part} done in {time.perf_counter() - start:.1f} s")
    if opts.variants:
        run_variants(bench, opts, overrides)
    return 0


def run_variants(bench, opts, overrides: list[str]) -> None:
    """Each variant's slice built in turn (the previous one freed), its parts run, the A/B written."""
    import copy

    from titan_kimi.parallel.rank_slice.bench import RankSliceBench
    from titan_kimi.parallel.rank_slice.report import variants_report

    if bench is not None:
        bench.release()
    reports = {}
    for spec in opts.variants:
        name, _, extra = spec.partition("=")
        sub_opts = copy.copy(opts)
        sub_opts.out = opts.out / "variants" / name
        sub_opts.parts = list(opts.variant_parts)
        log(f"variant {name}: {extra or '(the recipe as it is)'}")
        try:
            sub = RankSliceBench(sub_opts, [*overrides, *shlex.split(extra)], log)
            sub.report["meta"]["variant"] = extra
            for part in [p for p in VARIANT_PARTS if p in sub_opts.parts]:
                getattr(sub, f"run_{part}")()
                sub.write(table=False)
            reports[name] = sub.report
            sub.release()
        except Exception as err:  # a variant that cannot run (a backend missing here) must not stop the others
            log(f"variant {name} failed: {type(err).__name__}: {err}")
            reports[name] = {"meta": {"overrides": extra}, "error": f"{type(err).__name__}: {err}"}
        (opts.out / "variants.md").write_text(variants_report(
            {n: r for n, r in reports.items() if "error" not in r})
            + "".join(f"\n{n} failed: {r['error']}\n" for n, r in reports.items() if "error" in r))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
