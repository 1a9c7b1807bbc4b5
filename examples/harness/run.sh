#!/usr/bin/env bash
# An agent program trained end to end: build a small Qwen3 (about 3M parameters), warm-start it on
# solved episodes of examples/harness/agent.py (most answered without the calculator, which it does
# poorly), then GRPO with `miles train`, running the agent once per sample (in the rollout process)
# against a session of the run. Eval accuracy (the agent's own reward, greedy) is logged before,
# during and after RL.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
MILES=${MILES:-.venv/bin/miles}
OUT=${OUT:-runs/harness}
HERE=examples/harness
"$MILES" init-model --preset small-qwen3 --out "$OUT/base"
"$PY" "$HERE/warm_start.py" --model "$OUT/base" --out "$OUT/sft-model"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$MILES" train "$HERE/grpo.toml" --model.path "$OUT/sft-model" \
    --run.output_dir "$OUT" "$@"
