#!/usr/bin/env bash
# Multi-turn tool use end to end: build a tiny Qwen3, warm-start it on solved calculator episodes
# (mostly answered without the tool), then GRPO over real multi-turn episodes. Prints eval accuracy
# before and after RL, then the engine's prefix-cache hit rate on multi-turn rollouts of the result.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
MILES=${MILES:-.venv/bin/miles}
OUT=${OUT:-runs/tool_calc}
HERE=examples/tool_calc
"$MILES" init-model --preset tiny-qwen3 --out "$OUT/base"
"$PY" "$HERE/warm_start.py" --model "$OUT/base" --out "$OUT/sft-model"
"$MILES" train "$HERE/grpo.toml" --model.path "$OUT/sft-model" --run.output_dir "$OUT" "$@"
"$PY" "$HERE/cache_report.py" --model "$(ls -d "$OUT"/grpo*/checkpoints/step_* | sort -V | tail -1)"
