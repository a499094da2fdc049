"""One markdown table of the layout runs, each against its reference: python scripts/gpu/summarize_layout_runs.py RUNS_DIR

    python3 scripts/gpu/summarize_layout_runs.py RUNS_FOLDER [--manifest RUNS_FOLDER/layouts.tsv]

The manifest has one tab-separated line per run: ``name  reference  gpus  what``; a reference run has ``-`` as its
reference. A reference may itself be a multi-GPU run (k31_medium's FSDP run for its PP x EP x FSDP run on the
same machine), and a run may have several lines, one per reference it is compared with. Each run is
``RUNS_FOLDER/<name>/`` with the trainer's ``metrics.jsonl`` (its profile records from [profiling]). Speed is the
median over the steps after the first, leaving out profiled steps (the profiler's overhead); peak memory is the
largest over ranks (the profile records), else rank 0's. The loss tolerance is docs/perf.md's for bf16 over 20
steps: step 1 within 2e-3 relative, mean |dloss| within 0.11.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

STEP1_REL_TOL = 2e-3
MEAN_ABS_TOL = 0.11


@dataclass
class Run:
    name: str
    reference: str  # "" for a reference run
    gpus: int
    what: str
    steps: dict[int, dict]  # step -> its metrics row
    profiles: dict[int, list[dict]]  # step -> per-rank profile summaries


def read_manifest(path: Path) -> list[tuple[str, str, int, str]]:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) != 4 or not parts[2].isdigit():
            raise ValueError(f"{path}:{number}: {line!r}; valid: name<TAB>reference|-<TAB>gpus<TAB>what")
        name, reference, gpus, what = parts
        rows.append((name, "" if reference == "-" else reference, int(gpus), what))
    return rows


def read_run(folder: Path, name: str, reference: str, gpus: int, what: str) -> Run | None:
    metrics = folder / name / "metrics.jsonl"
    if not metrics.is_file():
        return None
    steps, profiles = {}, {}
    for line in metrics.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if "profile" in row:
            profiles[row["step"]] = row["profile"]
        elif "loss" in row:
            steps[row["step"]] = row  # a rerun appending to the file: the last row of a step wins
    return Run(name, reference, gpus, what, steps, profiles)


def speed(run: Run) -> tuple[float, float]:
    """Median tokens/s per GPU and MFU over the steps after the first, profiled steps left out."""
    rows = [r for s, r in sorted(run.steps.items()) if s != min(run.steps) and s not in run.profiles]
    rows = rows or list(run.steps.values())
    return (statistics.median(r["tokens_per_sec_per_device"] for r in rows),
            statistics.median(r["mfu"] for r in rows))


def peak_gib(run: Run) -> float:
    per_rank = [p.get("peak_mem_gib", 0.0) for ranks in run.profiles.values() for p in ranks]
    return max([*per_rank, *(r["peak_mem_gib"] for r in run.steps.values())])


def comm_share(run: Run) -> str:
    """Mean over ranks (max over ranks) of the last profiled step's communication share."""
    if not run.profiles:
        return "—"
    shares = [p["comm_share"] for p in run.profiles[max(run.profiles)]]
    return f"{100 * statistics.mean(shares):.1f}% ({100 * max(shares):.1f}%)"


@dataclass(frozen=True)
class LossDiff:
    steps: int
    step1_rel: float
    max_abs: float
    mean_abs: float

    @property
    def within(self) -> bool:
        return self.step1_rel <= STEP1_REL_TOL and self.mean_abs <= MEAN_ABS_TOL


def loss_diff(run: Run, reference: Run) -> LossDiff | None:
    common = sorted(set(run.steps) & set(reference.steps))
    if not common:
        return None
    diffs = [abs(run.steps[s]["loss"] - reference.steps[s]["loss"]) for s in common]
    first = common[0]
    return LossDiff(len(common), diffs[0] / abs(reference.steps[first]["loss"]), max(diffs),
                    statistics.mean(diffs))


HEADER = ("| layout | GPUs | compared with | tokens/s per GPU | MFU | peak GiB (max rank) | comm share, mean (max) "
          "rank | steps | step-1 rel dloss | max abs dloss | mean abs dloss | within bf16 tolerance |")


def table(folder: Path, manifest: list[tuple[str, str, int, str]]) -> str:
    runs = {name: read_run(folder, name, ref, gpus, what) for name, ref, gpus, what in manifest}
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for name, ref, gpus, what in manifest:
        run = runs[name]
        label = f"{name} ({what})"
        if run is None or not run.steps:
            lines.append(f"| {label} | {gpus} | {ref or '—'} | not run (no metrics.jsonl) |" + " |" * 8)
            continue
        tps, mfu = speed(run)
        cells = [label, str(gpus), ref or "— (reference)", f"{tps:,.0f}", f"{100 * mfu:.1f}%",
                 f"{peak_gib(run):.1f}", comm_share(run)]
        base = runs.get(ref) if ref else None
        diff = loss_diff(run, base) if base is not None else None
        if ref and diff is None:
            cells += [str(len(run.steps)), f"reference {ref} not run", "", "", "no comparison"]
        elif diff is None:
            cells += [str(len(run.steps)), "", "", "", ""]
        else:
            cells += [str(diff.steps), f"{diff.step1_rel:.1e}", f"{diff.max_abs:.3f}", f"{diff.mean_abs:.3f}",
                      "yes" if diff.within else "**no**"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the runs folder (one subfolder per run)")
    parser.add_argument("--manifest", type=Path, default=None, help="default: FOLDER/layouts.tsv")
    args = parser.parse_args(argv)
    manifest = read_manifest(args.manifest or args.folder / "layouts.tsv")
    print(table(args.folder, manifest))
    print(f"\nTolerance (docs/perf.md, bf16, 20 steps): step 1 within {STEP1_REL_TOL:g} relative, mean |dloss| "
          f"within {MEAN_ABS_TOL:g}. Speed: median over steps after the first, profiled steps left out.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
