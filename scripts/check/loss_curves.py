"""Pairwise loss-curve differences between training runs: python scripts/check/loss_curves.py RUN/metrics.jsonl RUN/metrics.jsonl ...

Each argument is a trainer's metrics.jsonl or a results.json of scripts/bench/compile_modes.py.

For every pair of runs (each results.json's runs, named ``<folder>/<mode>``): mean and max |dloss| over the common
steps and step 1's relative difference, the quantities of docs/perf.md's compile tolerance (step 1 within 2e-3
relative, mean |dloss| <= 0.11, set from fp32-master eager-vs-eager spread). Two eager runs of one setting give
that setting's run-to-run spread, against which a compiled or re-kerneled run is judged.

    python3 scripts/check/loss_curves.py out/eager_a/results.json out/eager_b/results.json out/flex/results.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path


def jsonl_losses(path: Path) -> list[float]:
    """The training losses of the trainer's metrics.jsonl in step order; of its last run when runs appended to
    one file (a record of step 1 starts a run)."""
    losses: list[float] = []
    for line in path.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if "loss" not in record:  # validation and profile records
            continue
        if record["step"] == 1:
            losses = []
        losses.append(float(record["loss"]))
    return losses


def load_curves(paths: list[Path]) -> dict[str, list[float]]:
    """``{"<folder>/<mode>": losses}`` for every run with losses in the given results.json files, and
    ``{"<folder>": losses}`` for a trainer's metrics.jsonl (``"<folder>/<stem>"`` for a renamed copy)."""
    curves: dict[str, list[float]] = {}
    for path in paths:
        if path.suffix == ".jsonl":
            if losses := jsonl_losses(path):
                name = path.parent.name if path.name == "metrics.jsonl" else f"{path.parent.name}/{path.stem}"
                curves[name] = losses
            continue
        for run in json.loads(path.read_text())["runs"]:
            if run.get("losses"):
                curves[f"{path.parent.name}/{run['mode']}"] = [float(x) for x in run["losses"]]
    if len(curves) < 2:
        raise ValueError(f"need at least two runs with losses; found {sorted(curves)} in {[str(p) for p in paths]}")
    return curves


def differences(a: list[float], b: list[float]) -> dict[str, float]:
    """mean / max |a - b| over the common steps, and step 1's |a - b| / |b|."""
    steps = min(len(a), len(b))
    if steps == 0:
        raise ValueError("a loss curve is empty")
    d = [abs(x - y) for x, y in zip(a[:steps], b[:steps])]
    return {"steps": steps, "mean_abs_dloss": sum(d) / steps, "max_abs_dloss": max(d),
            "max_step": d.index(max(d)) + 1, "step1_rel_dloss": d[0] / abs(b[0]) if b[0] else float("inf")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="results.json files of scripts/bench/compile_modes.py or the trainer's metrics.jsonl files")
    parser.add_argument("--out", type=Path, help="write the table as JSON here")
    opts = parser.parse_args(argv)
    curves = load_curves(opts.results)
    rows = [{"a": a, "b": b, **differences(curves[a], curves[b])} for a, b in itertools.combinations(curves, 2)]
    print("| run a | run b | steps | mean \\|dloss\\| | max \\|dloss\\| (step) | step-1 rel dloss |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['a']} | {r['b']} | {r['steps']} | {r['mean_abs_dloss']:.3f} | {r['max_abs_dloss']:.3f} "
              f"({r['max_step']}) | {r['step1_rel_dloss']:.1e} |")
    if opts.out:
        opts.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
