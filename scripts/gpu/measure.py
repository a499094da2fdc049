"""Every GPU measurement of titan_kimi, in named parts over one set-up: OUT=DIR PARTS="recipes tests" bash scripts/gpu/measure.sh

    OUT=/tmp/out PARTS="recipes ops" bash scripts/gpu/measure.sh          # or the parts as arguments
    PARTS='recipes "script:scripts/bench/foo.py --flavor k3_small"' bash scripts/gpu/measure.sh
    bash scripts/gpu/measure.sh --list                                    # the parts and what each measures
    PARTS=ops bash scripts/gpu/measure.sh --dry-run                       # what each part would run (any machine)

The set-up, once per run, for a GPU machine without network where the wheels travel with the tree: wheels in
``.whl/`` installed into /tmp/site (the CUDA header wheels into /tmp/cuda_headers, for cuDNN's NVRTC kernels);
wheels over one transfer's 64 MiB collected from ``.whl_parts/`` (scripts/tools/wheel_parts.sh); the CuTe-DSL wheels
of ``.whl_cute/`` unpacked once every part has arrived (never half a runtime); an earlier run's FlashMLA build in
/tmp/flash_site on the path; cuDNN's kernel cache in /tmp; ``env.txt`` with the GPU, driver and every version.
Each part writes into its own folder of the work folder (``WORK``, default /tmp/gpu_measure); after every command
the work folder is archived into ``$OUT/all.tgz``, so a run cut short still returns what finished (the GPU
machine hands back a few files of $OUT: all.tgz, env.txt, and for the layout parts summary.md and traces.tar).
Parts run in the order given; a part's own knobs (RECIPE_EXTRA, RECIPE_TIMEOUT, TEST_FILES, ...) are listed by
``--list``. docs/perf.md ("How to run the benchmarks") says which machine runs what.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

from layout_parts import layout_parts
from parts import GROUPS, Part, script_part, single_gpu_parts
from runner import ROOT, Runner

KNOBS = """knobs (environment):
  RECIPE_EXTRA     overrides appended to every recipe run        RECIPE_TIMEOUT  s per recipe run (280)
  TEST_FILES       test files of part tests (default: all GPU)   TESTS_TIMEOUT   s per test file (240)
  NUMERICS_STEPS   steps of numerics_fp32_truth (6)              NUMERICS_TIMEOUT s (400)
  KDA_SHAPES       op_kda's --shapes (k3)                        KDA_LAYOUTS     op_kda's --layouts (docs_padded)
  SCRIPT_TIMEOUT   s per script: part (280)                      NO_PP_RUNS      runs of rank_slice_k31_no_pp (all)
  BEFORE_REV, RANK_SLICE_ARGS: part rank_slice_before_after (the earlier commit; rank_slice.py's arguments)
  LAYOUT_STEPS, LAYOUT_COMPILE, LAYOUT_TIMEOUT, LAYOUT_RECIPE, LAYOUT_EXTRA, PRIOR, NGPUS,
  MEDIUM_AC, MEDIUM_TIMEOUT, MEDIUM_REF_TIMEOUT: the layout parts (scripts/gpu/layout_parts.py)"""


def all_parts() -> dict[str, Part]:
    return {p.name: p for p in single_gpu_parts() + layout_parts()}


def resolve(names: list[str]) -> list[Part]:
    """The parts asked for, groups expanded, in order; an unknown name stops the driver naming the valid ones."""
    known = all_parts()
    chosen: list[Part] = []
    for name in names:
        if name.startswith("script:"):
            chosen.append(script_part(name))
        elif name in GROUPS:
            chosen += [known[n] for n in GROUPS[name]]
        elif name in known:
            chosen.append(known[name])
        else:
            raise SystemExit(f"measure: unknown part {name!r}; valid: {', '.join([*known, *GROUPS])}, or "
                             "script:PATH [ARGS] (see --list)")
    return chosen


def sh(cmd: str, env: dict[str, str]) -> str:
    """A set-up shell command's output (stdout and stderr), whatever its exit status."""
    done = subprocess.run(cmd, shell=True, cwd=ROOT, env=env, capture_output=True, text=True)
    return (done.stdout + done.stderr).strip()


def set_up(dry_run: bool) -> tuple[dict[str, str], list[str]]:
    """Installs what travelled with the tree; returns the environment every part runs in and the set-up's notes."""
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               CUDNN_FRONTEND_CAKE_CACHE_DIR=os.environ.get("CUDNN_FRONTEND_CAKE_CACHE_DIR", "/tmp/cudnn_cake_cache"))
    py = shlex.quote(sys.executable)
    steps = []
    wheels = sorted(str(p.relative_to(ROOT)) for p in (ROOT / ".whl").glob("*.whl"))
    headers = [w for w in wheels if Path(w).name.startswith("nvidia_cuda_")]
    rest = [w for w in wheels if w not in headers]
    if rest:  # bytecode compiled at install, as a user's pip install does (a fresh machine's imports then compile nothing)
        steps.append(f"{py} -m pip install -q --no-index --no-deps --upgrade --target /tmp/site {shlex.join(rest)}")
    if headers:  # outside PYTHONPATH, so torch keeps loading its own CUDA runtime
        steps.append(f"{py} -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/cuda_headers "
                     f"{shlex.join(headers)}")
    for manifest in sorted((ROOT / ".whl_parts").glob("*/MANIFEST")):
        steps.append(f"bash scripts/tools/wheel_parts.sh collect {shlex.quote(manifest.parent.name)} /tmp/site")
    notes = []
    for step in steps:
        notes.append(f"set-up: {step}" if dry_run else f"set-up: {step}\n{sh(step, env)}".rstrip())
    complete = not any("carry the next one" in n for n in notes)
    cute = sorted((ROOT / ".whl_cute").glob("*.whl"))
    if cute and complete:  # unzipped, not pip-installed: pip --target --upgrade would replace the folder that
        # libs-cu13's parts were unpacked into; the wheels' files are disjoint and merge
        for wheel in cute:
            step = f"{py} -m zipfile -e {shlex.quote(str(wheel))} /tmp/site"
            notes.append(f"set-up: {step}" if dry_run else f"set-up: {step}\n{sh(step, env)}".rstrip())
    elif cute:
        notes.append("set-up: .whl_cute not unpacked: a wheel of .whl_parts is still missing parts")
    path = [str(ROOT), "/tmp/site"]
    dsl = Path("/tmp/site/nvidia_cutlass_dsl/dsl_packages")  # this run's unpacking or an earlier run's
    if complete and (dsl.is_dir() or (dry_run and cute)):  # the meta wheel's .pth is not read from --target
        path.append(str(dsl))
    if Path("/tmp/flash_site/flash_mla").is_dir() or dry_run:  # part flash_mla_build, this run or an earlier one
        path.append("/tmp/flash_site")
    env["PYTHONPATH"] = ":".join(path + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    if Path("/tmp/cuda_headers/nvidia/cu13").is_dir():
        env["CUDAToolkit_ROOT"] = "/tmp/cuda_headers/nvidia/cu13"
    return env, notes


VERSIONS = """
import importlib, importlib.metadata as md, torch
try:
    nccl = torch.cuda.nccl.version()
    nccl = '.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
except Exception as e:
    nccl = f'not available ({type(e).__name__})'
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', nccl)
for dist in ('triton', 'fla-core', 'liger-kernel', 'nvidia-cudnn-frontend', 'nvidia-cutlass-dsl', 'apache-tvm-ffi',
             'torchtitan'):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, 'not installed')
try:
    import cudnn; print('cudnn backend', cudnn.backend_version())
except Exception as e:
    print('cudnn backend: not importable', type(e).__name__)
for module in ('cutlass.cute', 'flash_mla'):
    try:
        importlib.import_module(module); print(module, 'importable')
    except Exception as e:
        print(module, 'not importable:', type(e).__name__)
"""


def write_env(r: Runner, notes: list[str]) -> None:
    """env.txt: the machine, the versions, the tree and the set-up's own output (also at the top of the log)."""
    parts = [sh("nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv", r.env),
             sh(f"{shlex.quote(sys.executable)} -c {shlex.quote(VERSIONS)}", r.env),
             sh("git log -1 --format='commit %H (%cd)'; echo \"uncommitted: $(git status --short | wc -l) paths\"", r.env),
             sh("nvidia-smi topo -m", r.env) if (r.gpu_count or 0) > 1 else "",
             sh("env | grep -E '^(NCCL|CUDA_VISIBLE)' | sort; date -u", r.env), *notes]
    text = "\n".join(p for p in parts if p) + "\n"
    for folder in (r.out, r.work):
        (folder / "env.txt").write_text(text, encoding="utf-8")
    print(text, flush=True)


def gpu_count(env: dict[str, str]) -> int | None:
    if os.environ.get("NGPUS", "").isdigit():
        return int(os.environ["NGPUS"])
    listed = sh("nvidia-smi -L", env)
    return sum(line.startswith("GPU ") for line in listed.splitlines()) if "GPU " in listed else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, epilog=KNOBS,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", help="parts to run, in order (default: $PARTS)")
    parser.add_argument("--list", action="store_true", help="print the parts and what each measures")
    parser.add_argument("--dry-run", action="store_true", help="print each part's commands; run and install nothing")
    opts = parser.parse_args(argv)
    os.chdir(ROOT)
    if opts.list:
        for part in all_parts().values():
            print(f"{part.name:28} {part.what}")
        for group, members in GROUPS.items():
            print(f"{group:28} = {' '.join(members)}")
        print(f"{'script:PATH [ARGS]':28} a script of this tree with ARGS and --out <its folder>\n\n{KNOBS}")
        return 0
    names = opts.parts or shlex.split(os.environ.get("PARTS", ""))
    if not names:
        parser.error("no parts: give them as arguments or in PARTS (--list shows them)")
    chosen = resolve(names)
    env, notes = set_up(opts.dry_run)
    out = Path(os.environ.get("OUT", "/tmp/gpu_measure_out"))
    work = Path(os.environ.get("WORK", "/tmp/gpu_measure"))
    r = Runner(out, work, env, opts.dry_run)
    r.gpu_count = gpu_count(env)
    if opts.dry_run:
        for note in notes:
            r.note(note)
    else:
        write_env(r, notes)
    for part in chosen:
        r.note(f"== part {part.name}: {part.what}")
        part.run(r, r.folder(part.name))
        r.note(f"== part {part.name} done at {r.elapsed()} s")
    r.archive()
    return 0


if __name__ == "__main__":
    sys.exit(main())
