#!/usr/bin/env bash
# The one GPU check (see tools/gpu_check.py). On the device machine: carry .whl/ with the
# megatron-core wheel and what the image lacks (einops, psutil, tensorboard), e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl megatron-core==0.19.2 einops psutil
# then run:  bash tools/gpu_check.sh      (results in $OUT/gpu_check.json)
set -euo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
exec timeout 470 python3 tools/gpu_check.py
