#!/usr/bin/env bash
# Create .venv and install miles with its test extras. Safe to re-run.
# torch is pinned to the CPU build 2.13.0 in pyproject.toml; nothing else is fetched at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
.venv/bin/miles --help > /dev/null
echo "miles installed in $(pwd)/.venv"
