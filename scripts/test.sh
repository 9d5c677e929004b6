#!/usr/bin/env bash
# Set up (scripts/setup.sh, scripts/setup-nemo.sh) and run lint, type checks and the test suite:
# the main suite in .venv (with a local SLURM for the sweep tests), then the NeMo 2 / Lightning
# integration tests in .venv-nemo.
# CHARLLM_REQUIRE_NEMO=1: an integration test whose framework or download is missing fails
# instead of skipping (tests/integrations/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test,megatron,sweep,analysis
scripts/setup-nemo.sh
export CHARLLM_REQUIRE_NEMO=1
# Megatron-Bridge's wheel for tests/integrations/test_bridge.py, which reads its callbacks.py
# (Bridge itself needs Python >= 3.12 and CUDA): fetched here, at set-up, never by a test.
BRIDGE_VERSION=0.6.2  # = BRIDGE_VERSION in tests/integrations/test_bridge.py
if ! ls .cache/megatron-bridge/megatron_bridge-"$BRIDGE_VERSION"-*.whl >/dev/null 2>&1; then
  .venv/bin/python -m pip download --no-deps --quiet --python-version 3.12 --only-binary=:all: \
    "megatron-bridge==$BRIDGE_VERSION" -d .cache/megatron-bridge
fi
NEMO_TESTS=tests/integrations/test_nemo_callback.py
. .venv/bin/activate

# --- A headless browser for the report test (tests/analysis/test_report.py) -----------------
# Debian's chromium, installed once (idempotent, quiet); the test fails rather than skips here.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
export CHARLLM_REQUIRE_BROWSER=1
# ----------------------------------------------------------------------------------------------

# --- A Prometheus server for tests/telemetry/test_export_prometheus.py (docs/export.md) ---------
# Debian's prometheus, installed once; the test starts it on 127.0.0.1 itself and fails, not skips.
if ! command -v prometheus >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
export CHARLLM_REQUIRE_PROMETHEUS=1

ruff check src tests bench scripts
ruff format --check src tests bench scripts
mypy

# --- a real single-node SLURM for tests/sweep/test_slurm_sweeps.py (docs/sweeps.md) ------------
# Installs slurm-wlm and munge with apt if missing and starts slurmctld, slurmd and munged as root
# (idempotent); the tests find it through SLURM_CONF and the sacct stand-in on PATH. Not root:
# those tests are skipped, and say so.
if [ "$(id -u)" = 0 ]; then
  scripts/local-slurm.sh start
  eval "$(scripts/local-slurm.sh env)"
else
  echo "test.sh: not root: no local SLURM; tests/sweep/test_slurm_sweeps.py will be skipped" >&2
fi
# ---------------------------------------------------------------------------------------------

# The NeMo tests run in .venv-nemo, the rest here.
pytest --ignore="$NEMO_TESTS" "$@"
deactivate
.venv-nemo/bin/pytest -q "$NEMO_TESTS"
