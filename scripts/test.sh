#!/usr/bin/env bash
# Set up (scripts/setup.sh, scripts/setup-nemo.sh) and run lint, type checks and the test suite:
# the main suite in .venv, then the NeMo 2 / Lightning integration tests in .venv-nemo.
# CHARLLM_REQUIRE_NEMO=1: an integration test whose framework or download is missing fails
# instead of skipping (tests/integrations/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test,megatron
scripts/setup-nemo.sh
export CHARLLM_REQUIRE_NEMO=1
NEMO_TESTS=tests/integrations/test_nemo_callback.py
. .venv/bin/activate
ruff check src tests bench scripts
ruff format --check src tests bench scripts
mypy
# The NeMo tests run in .venv-nemo, the rest here.
pytest --ignore="$NEMO_TESTS" "$@"
deactivate
.venv-nemo/bin/pytest -q "$NEMO_TESTS"
