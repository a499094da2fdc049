#!/usr/bin/env bash
# The sixth session's H200 validation: GPU tests, the k31_small step before and after the parallelism
# refactor (same command; the previous session's tree, `git archive 02d5e8f`, unpacked in .before/), the
# image-text recipe with and without LoRA, and the context-parallel GPU checks. Everything lands in
# $OUT/all.tgz, refreshed after each step, so a call cut short still returns what finished.
#   usage: OUT=/tmp/out PARTS="tests before_after" bash scripts/gpu_session6.sh
# PARTS (default all): tests new_tests before_after after_before moe vl cp kda
#   new_tests: only this session's GPU tests; after_before: the same comparison in the other order
set -u
PARTS=${PARTS:-tests before_after vl cp kda}
want() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
OUT=${OUT:-/tmp/gpu_session6}
mkdir -p "$OUT"
if [ -d .whl ]; then  # the GPU machine has no network: wheels travel with the tree
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'cuda', torch.version.cuda)"
  git rev-parse HEAD 2>/dev/null; date -u; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
T0=$(date +%s)
step() {
  echo "[$1] rc=$2 at $(( $(date +%s) - T0 ))s"
  (cd "$OUT" && tar czf all.tgz.part --exclude=all.tgz --exclude=all.tgz.part . 2>/dev/null && mv all.tgz.part all.tgz)
}
k31_small() {  # $1 = tree, $2 = name, rest = overrides
  local tree=$1 name=$2; shift 2
  (cd "$tree" && PYTHONPATH=$PWD:/tmp/site timeout 280 python3 -m torch.distributed.run --nproc-per-node=1 \
    -m titan_kimi.train --job.config_file train_configs/k31_small.toml --training.steps 20 --metrics.log_freq 1 \
    --job.dump_folder "/tmp/$name" "$@" > "$OUT/$name.log" 2>&1)
  local rc=$?
  cp "/tmp/$name/metrics.jsonl" "$OUT/$name.jsonl" 2>/dev/null
  step "$name" $rc; grep -E "summary|Error" "$OUT/$name.log" | tail -3
}

if want tests; then
  timeout 240 python3 -m pytest -m gpu --kernels-triton-autotune false tests/test_moe_gpu.py \
    tests/test_triton_kernels.py tests/test_sparse_mla_ws.py tests/test_topk_select.py tests/test_sparse_mla_plan.py \
    tests/test_inductor_pass.py tests/test_compile_modes.py tests/test_vision_lora_gpu.py \
    -q -rs -rf > "$OUT/pytest_gpu.log" 2>&1
  step pytest $?; tail -3 "$OUT/pytest_gpu.log"
fi
if want new_tests; then
  timeout 200 python3 -m pytest -m gpu --kernels-triton-autotune false tests/test_moe_gpu.py \
    tests/test_vision_lora_gpu.py -q -rs -rf > "$OUT/pytest_new_gpu.log" 2>&1
  step pytest_new $?; tail -3 "$OUT/pytest_new_gpu.log"
fi
if want before_after; then
  k31_small .before before_eager
  k31_small . after_eager
fi
if want after_before; then
  k31_small . after_eager_2
  k31_small .before before_eager_2
fi
if want moe; then
  timeout 120 python3 scripts/bench_moe_alignment.py > "$OUT/bench_moe_alignment.md" 2>&1
  step bench_moe $?; cat "$OUT/bench_moe_alignment.md"
fi
if want vl; then
  timeout 280 python3 -m torch.distributed.run --nproc-per-node=1 -m titan_kimi.train \
    --job.config_file train_configs/k31_vl_small.toml --job.dump_folder /tmp/vl > "$OUT/vl.log" 2>&1
  step vl $?; grep -E "summary|Error" "$OUT/vl.log" | tail -3; cp /tmp/vl/metrics.jsonl "$OUT/vl.jsonl" 2>/dev/null
  timeout 200 python3 -m torch.distributed.run --nproc-per-node=1 -m titan_kimi.train \
    --job.config_file train_configs/k31_vl_small.toml --lora.enable true --training.steps 12 \
    --job.dump_folder /tmp/vl_lora > "$OUT/vl_lora.log" 2>&1
  step vl_lora $?; grep -E "summary|Error|adapter" "$OUT/vl_lora.log" | tail -3
  cp /tmp/vl_lora/metrics.jsonl "$OUT/vl_lora.jsonl" 2>/dev/null
fi
if want cp; then
  timeout 240 python3 scripts/bench_cp_dsa.py --no-autotune --T 32768 --cp 1 2 4 --layout zigzag --reps 5 \
    --out "$OUT/cp_dsa_zigzag.json" > "$OUT/cp_dsa_zigzag.md" 2>&1
  step bench_cp_zigzag $?; cat "$OUT/cp_dsa_zigzag.md" | tail -12
  timeout 240 python3 -m pytest -m gpu tests/test_context_parallel_gpu.py -q -rs -rf > "$OUT/pytest_cp_gpu.log" 2>&1
  step pytest_cp_gpu $?; tail -5 "$OUT/pytest_cp_gpu.log"
fi
if want kda; then  # last: its dense B=2 case has no shipped FLA configs and autotunes for minutes
  left=$(( 590 - ($(date +%s) - T0) ))
  timeout "$left" python3 -m pytest -m gpu tests/test_kda_gpu.py -q -rs -rf > "$OUT/pytest_kda_gpu.log" 2>&1
  step pytest_kda_gpu $?; tail -3 "$OUT/pytest_kda_gpu.log"
fi
step done 0
