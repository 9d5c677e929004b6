"""Deadlines for the subprocesses tests start, scaled for the machine they run on.

A deadline only stops a test that hangs; it is never the verdict. Each is given for an idle
machine with room to spare and multiplied by ``CHARLLM_TEST_TIMEOUT_FACTOR`` (default 3: CI
shares its cores with other work; raise it further on a slow or crowded machine)."""

from __future__ import annotations

import os

FACTOR = float(os.environ.get("CHARLLM_TEST_TIMEOUT_FACTOR") or 3)


def deadline(seconds: float) -> float:
    """``seconds`` (enough on an idle machine) scaled by :data:`FACTOR`."""
    return seconds * FACTOR
