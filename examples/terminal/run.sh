#!/usr/bin/env bash
# Terminal tasks end to end: build a tiny Qwen3, score the reference commands, the untrained model and
# a short warm start (run.py), then GRPO with `miles train` over real episodes whose commands run in a
# rootless sandbox (user namespaces and bubblewrap; no privilege needed). Eval success (greedy, and
# 8 sampled episodes per task) is logged before, during and after RL in $OUT/grpo*/metrics.jsonl.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
MILES=${MILES:-.venv/bin/miles}
OUT=${OUT:-runs/terminal}
"$PY" examples/terminal/run.py --out "$OUT" --steps "${WARM_START_STEPS:-40}"
"$MILES" train examples/terminal/grpo.toml --model.path "$OUT/sft-model" --run.output_dir "$OUT" "$@"
