#!/usr/bin/env bash
# Run the test suite. pytest's own exit code is returned, so "no tests collected" (5) fails.
# Tests run in MILES_TEST_WORKERS processes (default 2), each test file whole in one of them: most tests
# wait on one process at a time (engine, then trainer), so two files at once keep two cores busy.
# By default the tests marked `slow` are left out (further variants of paths the suite already runs end
# to end, and whole-benchmark smokes); MILES_TESTS=all runs them too, MILES_TESTS=slow only them.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The live-SGLang tests (tests/e2e/test_sglang_live.py) need SGLang's own venv; returns at once when it is there.
./scripts/install-sglang.sh
case "${MILES_TESTS:-default}" in
    default) select=(-m "not slow") ;;
    all) select=() ;;
    slow) select=(-m slow) ;;
    *) echo "MILES_TESTS=${MILES_TESTS}: use default, all or slow" >&2; exit 2 ;;
esac
exec .venv/bin/python -m pytest -q -n "${MILES_TEST_WORKERS:-2}" --dist loadfile --durations=25 "${select[@]}" "$@"
