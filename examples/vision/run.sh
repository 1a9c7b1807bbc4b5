#!/usr/bin/env bash
# A vision-language model learns to count: a tiny Qwen2.5-VL (tiny-qwen-vl, about 1M parameters)
# looks at 32x32 pictures of 1-4 dots, drawn on the spot (make_data.py), is warm-started with SFT,
# then improved with GRPO under the reward in reward.py. Prints eval accuracy before and after RL;
# everything lands under runs/vision/ (OUT). Extra arguments go to both `miles sft` and `miles train`.
set -euo pipefail
cd "$(dirname "$0")/../.."
MILES=${MILES:-.venv/bin/miles}
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/vision}
HERE=examples/vision
THREADS=(--trainer.num_threads "${OMP_NUM_THREADS:-1}" --rollout.engine.num_threads "${OMP_NUM_THREADS:-1}")
DATA=(--rollout.task.data.path "$OUT/data/train.parquet" --rollout.task.data.eval_path "$OUT/data/eval.parquet")
"$PYTHON" "$HERE/make_data.py" "$OUT/data"
"$MILES" init-model --preset "${PRESET:-tiny-qwen-vl}" --out "$OUT/base"
"$MILES" sft "$HERE/sft.toml" --model.path "$OUT/base" --sft.out "$OUT/sft-model" "${DATA[@]}" "${THREADS[@]}" "$@"
"$MILES" train "$HERE/grpo.toml" --model.path "$OUT/sft-model" --run.output_dir "$OUT" "${DATA[@]}" "${THREADS[@]}" "$@"
