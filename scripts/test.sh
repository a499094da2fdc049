#!/usr/bin/env bash
# The test command on a fresh machine: install with the test extras, then run the CPU test suite
# (GPU tests are marked `gpu` and skip without CUDA). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
PY=${PYTHON:-python3}
exec "$PY" -m pytest -q "$@"
