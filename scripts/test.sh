#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run lint, type checks and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test,megatron,analysis
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
pytest "$@"
