#!/usr/bin/env bash
# Terminal tasks end to end in the sandbox (needs root for the sandbox's namespaces; refuses otherwise).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PY:-.venv/bin/python}" examples/terminal/run.py "$@"
