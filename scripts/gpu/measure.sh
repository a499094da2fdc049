#!/usr/bin/env bash
# Every GPU measurement in named parts over one set-up: OUT=DIR PARTS="recipes tests" bash scripts/gpu/measure.sh [--list | --dry-run]
# (the driver is scripts/gpu/measure.py; docs/perf.md, "How to run the benchmarks", says which machine runs what)
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python3 scripts/gpu/measure.py "$@"
