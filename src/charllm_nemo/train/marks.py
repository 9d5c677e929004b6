"""Moved to :mod:`charllm_nemo.steps.marks` (the framework-free per-step API); these names stay
importable from here for existing code."""

from charllm_nemo.steps.marks import (
    GRAD_SYNC_TIMERS,
    P2P_TIMERS,
    StepMarker,
    StepTiming,
    schedule_order,
)

__all__ = [
    "GRAD_SYNC_TIMERS",
    "P2P_TIMERS",
    "StepMarker",
    "StepTiming",
    "schedule_order",
]
