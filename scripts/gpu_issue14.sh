#!/usr/bin/env bash
# The issue-14 GPU items on one H200 in one call (a few minutes; FLA autotunes the context-parallel kernels at
# their first shapes): the context-parallel GPU tests (FLA's cp_context path of the KDA op against the one-rank
# result through a single-rank NCCL group; the Triton indexer's query runs; the whole model on one rank through
# the CP paths) and one rank's time and memory of a context-parallel k31_small DSA layer at 32K tokens.
# Everything lands in $OUT (default /tmp/gpu_issue14); numbers go to docs/context_parallel.md.
#   usage: OUT=/tmp/out bash scripts/gpu_issue14.sh
#          PARTS="bench" OUT=/tmp/out bash scripts/gpu_issue14.sh      # PARTS: any of tests, bench (default both)
set -u
PARTS=${PARTS:-tests bench}
want() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
for part in $PARTS; do
  case "$part" in tests|bench) ;;
    *) echo "gpu_issue14.sh: unknown part '$part'; valid: tests bench" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-/tmp/gpu_issue14}
mkdir -p "$OUT"
if [ -d .whl ]; then  # the lab's GPU machine has no network: wheels travel with the tree
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'cuda', torch.version.cuda)"
  git rev-parse HEAD 2>/dev/null; date -u; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
T0=$(date +%s)
step() { echo "[$1] rc=$2 at $(( $(date +%s) - T0 ))s"; }

if want bench; then  # first: seconds, and it does not depend on FLA's autotuning
  timeout 240 python3 scripts/bench_cp_dsa.py --no-autotune --T 32768 --cp 1 2 4 --layout zigzag \
    --reps 5 --out "$OUT/cp_dsa_zigzag.json" > "$OUT/cp_dsa_zigzag.md" 2>&1
  step bench_zigzag $?; cat "$OUT/cp_dsa_zigzag.md"
  timeout 120 python3 scripts/bench_cp_dsa.py --no-autotune --T 32768 --cp 2 4 --layout contiguous \
    --reps 5 --out "$OUT/cp_dsa_contiguous.json" > "$OUT/cp_dsa_contiguous.md" 2>&1
  step bench_contiguous $?; grep -E "^\| [0-9]" "$OUT/cp_dsa_contiguous.md"
fi

if want tests; then
  left=$(( 590 - ($(date +%s) - T0) ))
  timeout "$left" python3 -m pytest -m gpu tests/test_context_parallel_gpu.py -q -rs -rf > "$OUT/pytest_cp_gpu.log" 2>&1
  step pytest_cp_gpu $?; tail -15 "$OUT/pytest_cp_gpu.log"
fi
step done 0
