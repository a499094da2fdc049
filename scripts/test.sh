#!/usr/bin/env bash
# The CPU test suite on a fresh machine, install included (what CI runs): bash scripts/test.sh [pytest args]
# GPU tests are marked `gpu` and skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
PY=${PYTHON:-python3}
# Two workers (CI has 2 cores); tests sharing a session launch stay in one worker (tests/conftest.py).
exec "$PY" -m pytest -q -n 2 --dist loadgroup "$@"
