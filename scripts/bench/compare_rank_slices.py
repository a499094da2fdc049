"""Rank-slice runs side by side (two trees, two machines, any runs of scripts/bench/rank_slice.py):
python scripts/bench/compare_rank_slices.py NAME=DIR NAME=DIR [...] --out DIR

Reads each DIR/rank_slice.json and writes DIR/variants.md (--out): forward + backward ms per item and the speed-up
over the first run, as rank_slice.py's --variants does for config overrides (a code change cannot be one).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from titan_kimi.parallel.rank_slice.report import variants_report  # noqa: E402


def named_run(text: str) -> tuple[str, Path]:
    name, sep, folder = text.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=DIR")
    report = Path(folder) / "rank_slice.json"
    if not report.is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: no {report}")
    return name, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=named_run, help="NAME=DIR of a rank_slice.py run, the base first")
    parser.add_argument("--out", type=Path, required=True, help="folder for variants.md")
    opts = parser.parse_args(argv)
    names = [name for name, _ in opts.runs]
    if len(set(names)) != len(names):
        parser.error(f"run names {names} repeat one")
    reports = {}
    for name, path in opts.runs:
        report = json.loads(path.read_text())
        report.setdefault("meta", {})["variant"] = str(path.parent)
        reports[name] = report
    opts.out.mkdir(parents=True, exist_ok=True)
    text = variants_report(reports)
    (opts.out / "variants.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
