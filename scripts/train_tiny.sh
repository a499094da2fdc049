#!/usr/bin/env bash
# The main job on a fresh machine, install included: bash scripts/train_tiny.sh [--training.steps 10]
# It trains the tiny K3.1 (k31_debug) on the bundled sample text.
# Runs on CPU when there is no GPU. Extra arguments are passed to titan_kimi.train (e.g. --training.steps 10).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
exec "$PY" -m torch.distributed.run --nproc-per-node=1 -m titan_kimi.train \
  --job.config_file train_configs/k31_debug.toml "$@"
