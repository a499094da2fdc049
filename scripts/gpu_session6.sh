#!/usr/bin/env bash
# The sixth session's H200 validation in one call: GPU tests, the k31_small step before and after the
# parallelism refactor (same command, the previous commit's tree in .before/), the image-text recipe, and the
# context-parallel GPU checks. Everything lands in $OUT/all.tgz, refreshed after each step.
#   usage: OUT=/tmp/out PARTS="tests before_after vl cp" bash scripts/gpu_session6.sh
set -u
PARTS=${PARTS:-tests before_after vl cp}
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
  timeout 240 python3 -m pytest -m gpu tests/test_moe_gpu.py tests/test_triton_kernels.py tests/test_sparse_mla_ws.py \
    tests/test_topk_select.py tests/test_sparse_mla_plan.py tests/test_inductor_pass.py tests/test_compile_modes.py \
    -q -rs -rf > "$OUT/pytest_gpu.log" 2>&1
  step pytest $?; tail -3 "$OUT/pytest_gpu.log"
fi
if want before_after; then
  k31_small .before before_eager
  k31_small . after_eager
fi
