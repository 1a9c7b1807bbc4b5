#!/usr/bin/env bash
# Multi-turn tool use end to end: build a small Qwen3 (about 3M parameters), warm-start it on solved
# calculator episodes (most answered without the tool, which it does poorly), then GRPO over real
# multi-turn episodes, where calling the tool pays. Prints eval accuracy before and after RL, then
# the engine's prefix-cache hit rate on multi-turn rollouts of the result.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
MILES=${MILES:-.venv/bin/miles}
OUT=${OUT:-runs/tool_calc}
HERE=examples/tool_calc
"$MILES" init-model --preset small-qwen3 --out "$OUT/base"
"$PY" "$HERE/warm_start.py" --model "$OUT/base" --out "$OUT/sft-model"
"$MILES" train "$HERE/grpo.toml" --model.path "$OUT/sft-model" --run.output_dir "$OUT" "$@"
"$PY" "$HERE/cache_report.py" --model "$(ls -d "$OUT"/grpo*/checkpoints/step_* | sort -V | tail -1)"
