#!/usr/bin/env bash
# Create SGLang's own virtualenv (default .sglang-venv; MILES_SGLANG_VENV names another) for the runs
# and tests that start live SGLang servers. SGLang pins a torch of its own (2.14.1) that differs from
# miles' CPU build (2.13.0), so it cannot share .venv. Safe to re-run: it returns at once when the venv
# already imports the pinned release.
#
# What is installed: sglang==0.5.23 without its dependencies, then its declared requirements minus the
# CUDA-only ones (kernels, CUDA bindings, flash attention): on the CPU SGLang falls back to PyTorch, and
# the one kernel package it imports unconditionally (`sgl_kernel`) is replaced at launch by miles'
# stand-in (miles/sglang/cpu_standin/sgl_kernel). On a GPU machine install sglang with pip as its
# documentation says and point miles at that python (rollout.engine.sglang.python or MILES_SGLANG_PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG_VERSION=0.5.23
VENV=${MILES_SGLANG_VENV:-.sglang-venv}
PYTHON=${PYTHON:-python3}
# Requirements that need CUDA at import or build time; none of them is imported on SGLang's CPU path.
CUDA_ONLY='^(cuda-python|flashinfer.*|flash-attn.*|flash_attn.*|nvidia-.*|sgl-deep.*|sglang-kernel|sgl-kernel|tilelang|quack.*|humming|timm|kernels|torch|torchvision|torchaudio)$'

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$SGLANG_VERSION" <<'PY' 2>/dev/null
import sys, importlib.metadata as md
assert md.version("sglang") == sys.argv[1]
import torch, transformers, fastapi, uvicorn  # noqa: F401  (the launch path's heavy imports)
PY
then
  echo "sglang $SGLANG_VERSION already installed in $VENV"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
# SGLang's declared requirements (no extras), with markers evaluated for this python, less CUDA-only ones.
"$VENV/bin/python" - "$CUDA_ONLY" > "$VENV/sglang-requirements.txt" <<'PY'
import re, sys, importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
skip = re.compile(sys.argv[1], re.I)
for line in md.requires("sglang") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if skip.match(req.name):
        continue
    print(str(req).split(";")[0].strip())
PY
"${PIP[@]}" "torch==2.14.1" "torchvision==0.29.1" -r "$VENV/sglang-requirements.txt"
"$VENV/bin/python" -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"
echo "sglang $SGLANG_VERSION installed in $(pwd)/$VENV"
