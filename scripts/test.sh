#!/usr/bin/env bash
# Run the test suite. pytest's own exit code is returned, so "no tests collected" (5) fails.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q "$@"
