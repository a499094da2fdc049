#!/usr/bin/env bash
# Installs titan_kimi and its dependencies into the current Python, idempotent: bash scripts/install.sh [test|gpu]
# torch: an existing install is kept; otherwise torch 2.13.0 (on a CPU-only machine pip takes the local CPU build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=${1:-}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".${extras:+[$extras]}"
