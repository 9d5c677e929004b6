#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run lint, type checks and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test,megatron
. .venv/bin/activate
ruff check src tests bench scripts
ruff format --check src tests bench scripts
mypy
pytest "$@"
