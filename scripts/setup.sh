#!/usr/bin/env bash
# Create .venv and install charllm-nemo with what the tests and the CPU demo need.
# Usage: scripts/setup.sh [EXTRAS]   (default EXTRAS: test,megatron,sweep,analysis)
# On a GPU cluster, install your CUDA torch first and use: pip install -e '.[nvidia,megatron]'
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-test,megatron,sweep,analysis}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if [[ "$EXTRAS" == *megatron* ]]; then
  # torch first, pinned to the CPU build, so megatron-core's unpinned torch is already satisfied.
  python -m pip install -q -c constraints/cpu.txt torch
fi
python -m pip install -q -c constraints/cpu.txt -e ".[$EXTRAS]"
echo "setup: $(python -c 'import charllm_nemo; print("charllm-nemo", charllm_nemo.__version__)') in .venv"
