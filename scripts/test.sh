#!/usr/bin/env bash
# Run the test suite. pytest's own exit code is returned, so "no tests collected" (5) fails.
# Tests run in MILES_TEST_WORKERS processes (default 2), each test file whole in one of them: most tests
# wait on one process at a time (engine, then trainer), so two files at once keep two cores busy.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q -n "${MILES_TEST_WORKERS:-2}" --dist loadfile --durations=25 "$@"
