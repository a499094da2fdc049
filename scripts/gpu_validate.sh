#!/usr/bin/env bash
# One-call GPU validation on an H200 (the lab's device machine): GPU tests, the zero-graph-break check at
# k31_small shapes, and a short k31_small training run. Logs and metrics land in $OUT.
#   usage: OUT=/tmp/gpu_out bash scripts/gpu_validate.sh [train_steps]
set -u
OUT=${OUT:-/tmp/gpu_out}
STEPS=${1:-20}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'cuda', torch.version.cuda)"
  git rev-parse HEAD 2>/dev/null || true
  date -u
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

timeout 220 python3 -m pytest -m gpu tests/test_kda_gpu.py tests/test_triton_kernels.py -q -rs > "$OUT/pytest_gpu.log" 2>&1
echo "pytest_gpu rc=$?"; tail -5 "$OUT/pytest_gpu.log"

timeout 300 torchrun --nproc-per-node=1 -m titan_kimi.train --job.config_file train_configs/k31_small.toml \
  --training.steps "$STEPS" --metrics.log_freq 1 --job.dump_folder /tmp/k31_small > "$OUT/k31_small.log" 2>&1
echo "k31_small rc=$?"; grep -E "kernels:|step |summary|Error" "$OUT/k31_small.log" | tail -25
cp /tmp/k31_small/metrics.jsonl "$OUT/k31_small_metrics.jsonl" 2>/dev/null

timeout 60 python3 scripts/check_graph_breaks.py --flavor k31_small --device cuda --dtype bfloat16 --seq-len 1024 \
  > "$OUT/graph_breaks.log" 2>&1
echo "graph_breaks rc=$?"; cat "$OUT/graph_breaks.log" | grep -v Warn | tail -8
