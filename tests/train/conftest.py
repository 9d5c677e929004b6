"""Fixtures of the training tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture
def fake_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spawned ranks run tests/train/_fake_worker.py instead of the Megatron-Core loop."""
    monkeypatch.setenv("CHARLLM_WORKER_TARGET", "_fake_worker:run")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("CHARLLM_FAKE_MODE", "ok")
