#!/usr/bin/env bash
# Bring your own task: a small Qwen3 model learns the digit sum of three-digit numbers from the
# dataset in this folder (train.jsonl, eval.jsonl), warm-started with SFT, then improved with GRPO
# under the reward in reward.py. Prints eval accuracy before and after RL; everything lands under
# runs/own_task/ (OUT). Extra arguments go to both `miles sft` and `miles train`.
set -euo pipefail
cd "$(dirname "$0")/../.."
MILES=${MILES:-.venv/bin/miles}
OUT=${OUT:-runs/own_task}
HERE=examples/own_task
"$MILES" init-model --preset "${PRESET:-small-qwen3}" --out "$OUT/base"
"$MILES" sft "$HERE/sft.toml" --model.path "$OUT/base" --sft.out "$OUT/sft-model" "$@"
"$MILES" train "$HERE/grpo.toml" --model.path "$OUT/sft-model" --run.output_dir "$OUT" "$@"
