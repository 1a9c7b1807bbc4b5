#!/usr/bin/env bash
# Routing replay (R3) on a mixture-of-experts model: build the tiny Qwen3-MoE preset (8 experts,
# top-2; PRESET=tiny-deepseek-v3 for DeepSeek-V3's architecture: MLA, a dense first layer, sigmoid
# group-limited routing with a shared expert, docs/models.md), warm-start it on arithmetic with SFT, then GRPO with a bfloat16 engine, a float32 trainer
# and the engine's routed experts replayed in the trainer. Watch train/r3_mismatch_rate (how often
# the trainer's router disagrees with the engine's) and train/rollout_logprob_abs_diff in
# runs/moe_r3/grpo/metrics.jsonl; rerun with --trainer.routing_replay false to compare.
set -euo pipefail
cd "$(dirname "$0")/../.."
MILES=${MILES:-.venv/bin/miles}
OUT=${OUT:-runs/moe_r3}
PRESET=${PRESET:-tiny-qwen3-moe}
"$MILES" init-model --preset "$PRESET" --out "$OUT/base"
"$MILES" sft examples/arithmetic/sft.toml --model.path "$OUT/base" --sft.out "$OUT/sft-model" --sft.steps 300
"$MILES" train examples/arithmetic/grpo.toml --model.path "$OUT/sft-model" --run.output_dir "$OUT" \
    --loop.num_steps 20 --eval.every_steps 10 --rollout.engine.dtype bfloat16 --sync.dtype bfloat16 \
    --rollout.return_routed_experts true --trainer.routing_replay true "$@"
