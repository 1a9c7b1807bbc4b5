#!/usr/bin/env bash
# The main job: build a small Qwen3 model (about 3M parameters), warm-start it with SFT until it solves
# half of the held-out problems, then improve it with GRPO.
# Prints eval accuracy before and after RL; everything lands under runs/arithmetic/.
# SFT computes with OMP_NUM_THREADS threads (default 1). GRPO runs colocated: the engine and the trainer
# take turns on every core (threads 0 = auto, or OMP_NUM_THREADS) and keep their memory between turns.
set -euo pipefail
cd "$(dirname "$0")/../.."
MILES=${MILES:-.venv/bin/miles}
OUT=${OUT:-runs/arithmetic}
HERE=examples/arithmetic
THREADS=(--trainer.num_threads "${OMP_NUM_THREADS:-1}" --rollout.engine.num_threads "${OMP_NUM_THREADS:-1}")
TURNS=(--placement.mode colocated --placement.release_memory ""
       --trainer.num_threads "${OMP_NUM_THREADS:-0}" --rollout.engine.num_threads "${OMP_NUM_THREADS:-0}")
"$MILES" init-model --preset "${PRESET:-small-qwen3}" --out "$OUT/base"
"$MILES" sft "$HERE/sft.toml" --model.path "$OUT/base" --sft.out "$OUT/sft-model" "${THREADS[@]}" "$@"
"$MILES" train "$HERE/grpo.toml" --model.path "$OUT/sft-model" --run.output_dir "$OUT" "${TURNS[@]}" "$@"
