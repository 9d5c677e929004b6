#!/usr/bin/env bash
# Set up (scripts/setup.sh, scripts/setup-nemo.sh) and run lint, type checks and the test suite:
# the main suite in .venv, then the NeMo 2 / Lightning integration tests in .venv-nemo.
# CHARLLM_REQUIRE_NEMO=1: an integration test whose framework or download is missing fails
# instead of skipping (tests/integrations/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test,megatron,analysis
scripts/setup-nemo.sh
export CHARLLM_REQUIRE_NEMO=1
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

ruff check src tests bench scripts
ruff format --check src tests bench scripts
mypy
# The NeMo tests run in .venv-nemo, the rest here.
pytest --ignore="$NEMO_TESTS" "$@"
deactivate
.venv-nemo/bin/pytest -q "$NEMO_TESTS"
