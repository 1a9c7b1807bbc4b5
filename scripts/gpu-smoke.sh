#!/usr/bin/env bash
# On a CUDA machine, in one go: the tests marked `cuda`, the arithmetic job (SFT warm start, then GRPO)
# with the trainer on the GPU (bfloat16 compute, float32 master weights, NCCL), and the weight-sync
# benchmark. Short settings: it shows that the code paths run, not a result worth quoting.
# Each step's output lands in $OUT (default runs/gpu-smoke); the first failure stops the script.
#   scripts/gpu-smoke.sh [extra overrides for sft and train, e.g. --trainer.num_ranks 2]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/gpu-smoke}
mkdir -p "$OUT"
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu-smoke: torch sees no CUDA device")'
"$PY" -c 'import torch; print("gpu-smoke:", torch.__version__, torch.cuda.get_device_name(0))' | tee "$OUT/device.txt"

echo "== tests marked cuda" >&2
"$PY" -m pytest -q -m cuda tests/unit 2>&1 | tee "$OUT/pytest-cuda.log"

echo "== arithmetic job, trainer on cuda" >&2
OUT="$OUT/arithmetic" PRESET=tiny-qwen3 examples/arithmetic/run.sh \
    --trainer.device cuda --trainer.param_dtype bfloat16 --sft.steps 50 --loop.num_steps 5 "$@" \
    2>&1 | tee "$OUT/arithmetic.log"

echo "== weight-sync benchmark" >&2
"$PY" -m miles.cli bench sync --repeats 3 --steps 2 2>&1 | tee "$OUT/bench-sync.log"
echo "gpu-smoke: done; logs in $OUT" >&2
