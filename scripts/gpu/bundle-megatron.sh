#!/usr/bin/env bash
# Add megatron-core (the pinned release, the GPU image's Python 3.12) to the .gpu bundle that
# ../shared/tools/gpu-bundle.sh makes, so a GPU check runs the Megatron backend there too:
#   ../shared/tools/gpu-bundle.sh && scripts/gpu/bundle-megatron.sh     (once, in the project root)
# .gpu/setup.sh installs every wheel under .gpu/whl on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -d .gpu/whl ] || { echo "bundle-megatron: run ../shared/tools/gpu-bundle.sh first (.gpu/whl is missing)" >&2; exit 1; }
VERSION=$(.venv/bin/python -c "from miles.trainer.backends.megatron.cpu_adapter import PINNED; print(PINNED)")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any \
    -d .gpu/whl "megatron-core==$VERSION" 2>&1 | grep -v "is ignored" || true
ls .gpu/whl | grep -q "^megatron_core-$VERSION-" || { echo "bundle-megatron: no wheel of megatron-core $VERSION" >&2; exit 1; }
echo "bundle-megatron: megatron-core $VERSION in .gpu/whl"
