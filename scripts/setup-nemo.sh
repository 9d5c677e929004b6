#!/usr/bin/env bash
# Create .venv-nemo: nemo-toolkit[llm] 2.7.3 + megatron-core 0.16.1 + nemo_run on the CPU torch,
# and charllm-nemo (editable) for the NeMo / Lightning integration tests (tests/integrations).
# Idempotent: a stamp holding the hash of this script and constraints/nemo.txt skips a
# finished install; delete .venv-nemo to start again.
# Usage: scripts/setup-nemo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv-nemo
STAMP="$VENV/.charllm-setup-nemo"
want="$(cat "$0" constraints/nemo.txt | sha256sum | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "setup-nemo: $VENV is up to date"
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
# torch first, the CPU build on local disk, so nothing below pulls a CUDA build.
pip install -q -c constraints/nemo.txt torch
pip install -q -c constraints/nemo.txt "nemo-toolkit[llm]" megatron-core nemo_run
pip install -q -c constraints/nemo.txt -e ".[test]"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import lightning  # noqa: F401
import nemo.collections.llm  # noqa: F401
import nemo_run  # noqa: F401
for name in ("nemo-toolkit", "megatron-core", "lightning", "torch", "nemo_run"):
    print(f"setup-nemo: {name} {md.version(name)}")
PY
echo "$want" > "$STAMP"
