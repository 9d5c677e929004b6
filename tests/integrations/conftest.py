"""The integration tests need their frameworks (NeMo 2.7.3, lightning) from ``.venv-nemo``
(scripts/setup-nemo.sh). In the main ``.venv`` they are skipped; with ``CHARLLM_REQUIRE_NEMO=1``
(scripts/test.sh sets it for the ``.venv-nemo`` run) a missing framework fails instead."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require(module: str) -> ModuleType:
    """Import ``module``; skip without it, or fail when CHARLLM_REQUIRE_NEMO=1."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("CHARLLM_REQUIRE_NEMO") == "1":
            pytest.fail(f"{module} is not importable ({exc}); run scripts/setup-nemo.sh and use .venv-nemo")
        pytest.skip(f"{module} is not installed (scripts/setup-nemo.sh makes .venv-nemo)")


def require_or_skip(reason: str) -> None:
    """Skip with ``reason``, or fail when CHARLLM_REQUIRE_NEMO=1 (CI must run it)."""
    if os.environ.get("CHARLLM_REQUIRE_NEMO") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


from tests.sinks.conftest import wandb_env  # noqa: E402, F401  (offline, keyless W&B for log_to="wandb")
