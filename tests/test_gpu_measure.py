"""scripts/gpu/measure.sh on CPU: every part's dry run names scripts and tests that exist, bad parts are refused
naming the valid ones, docs/perf.md documents every part, and every script opens with what it does and how to run it."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "scripts" / "gpu" / "measure.py"


def measure(*args: str, parts: str = "") -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PARTS": parts, "OUT": "/nonexistent/out", "WORK": "/nonexistent/work"}
    return subprocess.run([sys.executable, str(DRIVER), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def part_names() -> list[str]:
    listed = measure("--list")
    assert listed.returncode == 0, listed.stderr
    return [line.split()[0] for line in listed.stdout.splitlines()
            if line and not line.startswith(" ") and not line.startswith(("script:", "knobs"))]


def test_every_part_dry_runs_and_names_files_that_exist():
    names = part_names()
    assert {"recipes", "tests", "ops", "numerics", "profile_k3_small", "layout_fsdp_ep"} <= set(names)
    run = measure("--dry-run", *names, "script:scripts/bench/cp_memory_estimate.py --T 32768")
    assert run.returncode == 0, run.stderr
    commands = [line for line in run.stdout.splitlines() if line.startswith("[")]
    assert len(commands) > 60
    named = set(re.findall(r"\b((?:scripts|tests|train_configs)/[\w/.-]+\.(?:py|sh|toml))", run.stdout))
    missing = sorted(path for path in named if not (ROOT / path).is_file())
    assert not missing, missing
    assert "--out /nonexistent/work/cp_memory_estimate" in run.stdout  # a script part gets its folder as --out


def test_unknown_parts_and_bad_scripts_are_refused_naming_what_is_valid():
    run = measure("--dry-run", "recipes", "recipe")
    assert run.returncode != 0 and "unknown part 'recipe'" in run.stderr and "recipes" in run.stderr
    run = measure("--dry-run", "script:scripts/bench/no_such_benchmark.py")
    assert run.returncode != 0 and "a Python file of this tree" in run.stderr
    assert "no parts" in measure("--dry-run").stderr
    run = measure("--dry-run", "tests")
    assert run.returncode == 0
    bad = subprocess.run([sys.executable, str(DRIVER), "--dry-run", "recipes"], cwd=ROOT, capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", "RECIPE_TIMEOUT": "soon"}, timeout=60)
    assert bad.returncode != 0 and "RECIPE_TIMEOUT='soon'" in bad.stderr


def test_docs_perf_names_every_part():
    perf = (ROOT / "docs" / "perf.md").read_text(encoding="utf-8")
    assert [name for name in part_names() if f"`{name}`" not in perf] == []


def opening_line(path: Path) -> str:
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".py":
        return lines[0]
    return lines[1] if lines[0].startswith("#!") else lines[0]


def test_every_script_opens_with_what_it_does_and_how_to_run_it():
    tracked = subprocess.run(["git", "ls-files", "scripts"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    scripts = [ROOT / p for p in tracked] or [p for p in (ROOT / "scripts").rglob("*") if p.is_file()]
    assert len(scripts) > 30
    vague = [str(p.relative_to(ROOT)) for p in scripts
             if "scripts/" not in opening_line(p) and "not run on its own" not in opening_line(p)]
    assert vague == []
