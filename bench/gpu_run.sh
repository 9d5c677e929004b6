#!/usr/bin/env bash
# What runs on the lent GPU machine: install the carried wheels, then bench/gpu_check.py.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv || true
python3 bench/gpu_check.py --mode gpu --out "${OUT:-/tmp/gpucheck}" "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
