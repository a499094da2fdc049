#!/usr/bin/env bash
# The CPU test suite on a fresh machine, install included (what CI runs): bash scripts/test.sh [pytest args]
# GPU tests are marked `gpu` and skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
PY=${PYTHON:-python3}
# Two workers for CI's 2 cores; tests/conftest.py keeps the readers of each once-per-run launch in one worker.
exec "$PY" -m pytest -q -n 2 --dist loadgroup "$@"
