#!/usr/bin/env bash
# The issue-4 validation on one H200 in one call (~8 minutes with the shipped FLA configs): GPU tests of the
# fused ops, kernel benchmarks at K3 shapes, the DSA layer against dense-masked MLA, and the compile-mode
# ablation on k31_small. Everything lands in $OUT (default /tmp/gpu_issue4); numbers go to docs/perf.md.
#   usage: OUT=/tmp/out bash scripts/gpu_issue4.sh
#          PARTS="max-autotune" OUT=/tmp/out bash scripts/gpu_issue4.sh   # one part per call: its compile is long
# PARTS (default "tests kernels dsa ablate kda"): any of tests, kernels, dsa, ablate, max-autotune, kda.
set -u
PARTS=${PARTS:-tests kernels dsa ablate kda}
want() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
for part in $PARTS; do
  case "$part" in tests|kernels|dsa|ablate|max-autotune|kda) ;;
    *) echo "gpu_issue4.sh: unknown part '$part'; valid: tests kernels dsa ablate max-autotune kda" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-/tmp/gpu_issue4}
mkdir -p "$OUT"
if [ -d .whl ]; then  # the lab's GPU machine has no network: wheels travel with the tree
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'cuda', torch.version.cuda)"
  git rev-parse HEAD 2>/dev/null; date -u; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
T0=$(date +%s)
# the device tool returns a handful of files per call: everything travels in one archive, refreshed after each
# step so that a call cut short by its time limit still brings back what finished
step() {
  echo "[$1] rc=$2 at $(( $(date +%s) - T0 ))s"
  (cd "$OUT" && tar czf all.tgz.part --exclude=all.tgz --exclude=all.tgz.part --exclude=ablate/runs . 2>/dev/null \
    && mv all.tgz.part all.tgz)
}

# (tests/test_kda_gpu.py runs last: its dense B=2 case has no shipped FLA configs and autotunes for minutes)
if want tests; then
timeout 170 python3 -m pytest -m gpu tests/test_triton_kernels.py \
  tests/test_sparse_mla_ws.py tests/test_topk_select.py tests/test_sparse_mla_plan.py tests/test_inductor_pass.py \
  tests/test_compile_modes.py -q -rs -rf --kernels-triton-autotune false > "$OUT/pytest_gpu.log" 2>&1
step pytest $?; tail -3 "$OUT/pytest_gpu.log"
fi

if want kernels; then
timeout 90 python3 scripts/bench_kernels.py --T 8192 --no-ref --out "$OUT/bench_kernels.json" > "$OUT/bench_kernels.md" 2>&1
step bench_kernels $?; grep -E "^\| (sparse_mla|indexer)" "$OUT/bench_kernels.md"
# the Triton-language sparse-MLA forward for comparison (the Gluon one is the default on Hopper)
timeout 40 python3 scripts/bench_kernels.py --T 8192 --ops sparse_mla --no-ref --no-sparse-mla-ws \
  --out "$OUT/bench_sparse_mla_triton.json" > "$OUT/bench_sparse_mla_triton.md" 2>&1
step bench_sparse_mla_triton $?; grep -E "^\| sparse_mla \| triton \| fwd" "$OUT/bench_sparse_mla_triton.md"
fi

if want dsa; then
timeout 100 python3 scripts/bench_dsa_layer.py --T 8192 16384 32768 --reps 3 --out "$OUT/dsa.json" > "$OUT/dsa.md" 2>&1
step dsa $?; grep -E "^\| [0-9]" "$OUT/dsa.md"
timeout 90 python3 scripts/bench_dsa_layer.py --T 32768 --reps 3 --compile --out "$OUT/dsa_compiled.json" > "$OUT/dsa_compiled.md" 2>&1
step dsa_compiled $?; grep -E "^\| [0-9]" "$OUT/dsa_compiled.md"
fi

if want ablate; then
timeout 280 python3 scripts/ablate_compile.py --flavor k31_small --seq-len 8192 \
  --batch 1 --steps 20 --lr-warmup-steps 5 --modes none,default,reduce-overhead,inductor --out "$OUT/ablate" \
  --cache warm --no-plot --warmup --profile -- --kernels.triton_autotune false > "$OUT/ablate.log" 2>&1
step ablate $?
rm -rf "$OUT/ablate/runs"; cat "$OUT/ablate/results.md" 2>/dev/null
fi

if want max-autotune; then  # its own process and eager baseline; pointwise autotuning takes minutes to compile
  timeout $(( 585 - ($(date +%s) - T0) )) python3 scripts/ablate_compile.py \
    --flavor k31_small --seq-len 8192 --batch 1 --steps 20 --lr-warmup-steps 5 --modes none,max-autotune \
    --out "$OUT/ablate_max_autotune" --cache warm --no-plot --warmup -- --kernels.triton_autotune false \
    > "$OUT/ablate_max_autotune.log" 2>&1
  step ablate_max_autotune $?
  rm -rf "$OUT/ablate_max_autotune/runs"; cat "$OUT/ablate_max_autotune/results.md" 2>/dev/null
fi

left=$(( 585 - ($(date +%s) - T0) ))
if want kda && [ "$left" -gt 30 ]; then
  timeout "$left" python3 -m pytest -m gpu tests/test_kda_gpu.py -q -rs > "$OUT/pytest_kda_gpu.log" 2>&1
  step pytest_kda $?; tail -3 "$OUT/pytest_kda_gpu.log"
fi
step done 0
