#!/usr/bin/env bash
# On a machine with one CUDA GPU, in one go (at most GPU_CHECK_BUDGET_S, 470 s by default), ending in one
# JSON line:
#   1. the GPU: name, memory, measured device-copy bandwidth;
#   2. the tests marked `cuda` (engine and trainer on the GPU against transformers and the CPU path, the
#      fast decode's CUDA graphs against its eager forward for every bucket, weight pushes from and into
#      GPU memory; those needing two GPUs skip on one);
#      then the Megatron backend on the GPU against FSDP there (tests/unit/trainer/backends/test_megatron.py);
#   3. `miles bench gpu` on the Qwen3-0.6B shape: engine decode (fast path) against transformers.generate()
#      at batch 64 and 256 x 256 new tokens, each step against the memory floor and taken apart
#      (attention, matmuls, sampling, launch gaps), and miles' trainer step against a plain bf16 loop;
#   4. the main job unchanged (examples/arithmetic/run.sh: device auto = cuda): wall time, eval before/after,
#      the warm start's steps and held-out accuracy along the way, the RL steps done and their median times;
#   5. a Qwen3-0.6B-shaped RL run (64 prompts x 8 samples x 128 new tokens, 3 steps, engine and trainer
#      colocated on the GPU), each step's rollout/train/push seconds and the share of it the GPU was busy.
# Each part has a time limit, cut to what is left of the budget, and its log in $OUT; a part that fails
# is reported, the others still run; a part with under 20 s of budget left is skipped (rc "skipped").
#   bash .gpu/setup.sh && . /tmp/gpu-env.sh && scripts/gpu-check.sh      (on a GPU machine; see .gpu/)
#   GPU_CHECK_SMALL=1 scripts/gpu-check.sh                                (plumbing only, on CPU)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MILES=${MILES:-.venv/bin/miles}
OUT=${OUT:-runs/gpu-check}
SMALL=${GPU_CHECK_SMALL:-0}
BUDGET=${GPU_CHECK_BUDGET_S:-470}  # the whole check's seconds (8 minutes with the setup's margin)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MILES PY
rm -rf "$OUT" && mkdir -p "$OUT"
CHECK=(scripts/gpu/check.py)
sections="{"
part() {  # part NAME LIMIT_S CMD...: run with a time limit, log to $OUT/NAME.log, note rc and seconds
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS left=$((BUDGET - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    echo "== $name skipped: ${left}s of the ${BUDGET}s budget left" >&2
    sections+="\"$name\": {\"rc\": \"skipped\", \"s\": 0},"
    echo "${sections%,}}" > "$OUT/sections.json"
    return
  fi
  echo "== $name (limit ${limit}s)" >&2
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  sections+="\"$name\": {\"rc\": $rc, \"s\": $((SECONDS - t0))},"
  [ $rc -eq 0 ] || { echo "== $name failed (rc $rc); last lines:" >&2; tail -n 15 "$OUT/$name.log" >&2; }
  if [ $rc -ge 124 ] && [ "$SMALL" != 1 ]; then  # timed out: Ray's daemons outlive their driver and hold the GPU
    pkill -9 -f 'raylet|gcs_server|default_worker.py|ray::' 2>/dev/null; sleep 2
  fi
  # The report so far after every part, so a check cut short still says what it measured.
  echo "${sections%,}}" > "$OUT/sections.json"
  "$PY" "${CHECK[@]}" report "$OUT" > "$OUT/gpu-check.json" 2>> "$OUT/report.log"
  if [ -n "${GPU_CHECK_COPY_TO:-}" ]; then  # e.g. a device call's $OUT: the JSON and every part's log tail
    cp "$OUT/gpu-check.json" "$GPU_CHECK_COPY_TO/"
    { echo "== $name rc $rc"; tail -n 60 "$OUT/$name.log"; } >> "$GPU_CHECK_COPY_TO/parts.log"
  fi
}

part probe 60 "$PY" "${CHECK[@]}" probe "$OUT/device.json"
cat "$OUT/device.json" >&2; echo >&2

if [ "$SMALL" = 1 ]; then
  part pytest-cuda 120 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests/unit/trainer/test_device.py \
      tests/unit/engine/test_decode_graphs.py
else  # the files with tests marked cuda (collecting all of tests/unit needs packages a GPU image may lack),
  # among them tests/unit/sync/test_broadcast_backend.py (the broadcast transport from and into GPU memory)
  part pytest-cuda 120 "$PY" -m pytest -q -m cuda -p no:cacheprovider $(grep -rl "mark.cuda" tests/unit | grep -v megatron)
fi
# The Megatron backend on the GPU (megatron-core from scripts/gpu/bundle-megatron.sh; skipped without it).
part megatron 90 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests/unit/trainer/backends/test_megatron.py

# The 0.6B shape, built on the GPU: the bench's model and the RL run's.
if [ "$SMALL" = 1 ]; then
  PRESET=tiny-qwen3; RL_ARGS=(--rollout.prompts_per_step 4 --rollout.max_new_tokens 8 --loop.num_steps 2)
  DEV=cpu; BENCH_ARGS=(--batches 2,4 --new-tokens 8)
else
  PRESET=qwen3-0.6b-shape; RL_ARGS=(); DEV=cuda; BENCH_ARGS=()
fi
part build-model 60 "$PY" "${CHECK[@]}" build-model "$PRESET" "$OUT/rl-model"
part bench-gpu 150 "$MILES" bench gpu --device "$DEV" --only decode,trainer --model "$OUT/rl-model" "${BENCH_ARGS[@]}"

# The main job exactly as the README runs it (small: fewer steps, for the plumbing).
ARITH_ARGS=()
[ "$SMALL" = 1 ] && ARITH_ARGS=(--sft.steps 20 --loop.num_steps 2 --eval.num_prompts 16 --metrics.progress plain)
t0=$SECONDS
part arithmetic 180 env OUT="$OUT/arithmetic" examples/arithmetic/run.sh "${ARITH_ARGS[@]}"
echo "{\"wall_s\": $((SECONDS - t0))}" > "$OUT/arithmetic-time.json"

part rl 200 "$PY" "${CHECK[@]}" watch "$OUT/rl-watch.json" "$OUT/rl/qwen3-0.6b-rl/metrics.jsonl" -- \
    "$MILES" train scripts/gpu/qwen3-0.6b-rl.toml --model.path "$OUT/rl-model" --run.output_dir "$OUT/rl" \
    --metrics.progress plain "${RL_ARGS[@]}"

cat "$OUT/gpu-check.json"
