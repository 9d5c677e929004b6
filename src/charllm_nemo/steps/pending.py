"""When a step's telemetry figures are reported: a few steps after it, the same on every rank.

A step's figures are computed by the telemetry process from samples taken after the step
ended, so they are read a step or more later, and travel in that later step's one per-rank
vector (charllm_nemo.steps.report). Steps shorter than :data:`FIGURES_BATCH_S` are read a few
steps late and their figures computed several at a time (:class:`PendingSteps`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Generic, TypeVar


def late_wait(t_end_mono_ns: int, period_ns: float) -> float:
    """How long a step may wait for the figures of a step that ended at ``t_end_mono_ns``
    (seconds). They are due once two sampling periods have passed since (a sample past the end,
    then the telemetry process's answer); ready by then unless that process is starved of CPU
    (every core busy with training), and then waiting up to two more periods (at most 50 ms)
    beats dropping them. Not yet due (a step shorter than two periods): 0, no wait; they are
    dropped."""
    if time.monotonic_ns() - t_end_mono_ns < 2 * period_ns:
        return 0.0
    return min(2 * period_ns / 1e9, 0.05)


def final_wait(hz: float) -> float:
    """How long, in all, training waits for its last steps' figures (seconds): once per run, so
    generously (a loaded node, a CI machine with every core busy, can keep a telemetry process
    from the CPU for hundreds of ms): 5 sampling periods, at least 2 s, at most 5 s. A
    telemetry process that answers in time costs nothing of it; one that has died, nothing
    either (the wait ends when the sampler stops)."""
    return min(max(2.0, 5.0 / max(hz, 1e-3)), 5.0)


FIGURES_BATCH_S = 0.1
"""The least step time one computation of live figures should cover (s). The telemetry
process's cost for a request is nearly all per call (numpy over a few samples: about the same
for one window as for eight), so steps shorter than this are reported ceil(FIGURES_BATCH_S /
step time) steps late (at most :data:`MAX_FIGURES_LAG`) and their figures computed that many at
a time."""
MAX_FIGURES_LAG = 8

T = TypeVar("T")
Pending = tuple[T, int, int]  # a step's report and its window (t_begin, t_end ns)


class PendingSteps(Generic[T]):
    """The steps whose figures have not been reported yet, oldest first, and how many steps late
    they are reported (``lag``). Every rank holds the same steps and the same lag (it comes from
    the step time all ranks agree on and never decreases), so every rank's vector carries the
    figures of the same step."""

    def __init__(self, max_lag: int = MAX_FIGURES_LAG, ready_s: float = 0.0) -> None:
        self.steps: deque[tuple[T, int, int]] = deque()
        self.lag = 1
        self.batch = 1  # the steps whose figures are computed together (request_figures' batch)
        self.max_lag = max_lag
        # How much later than the samples past a window's end its figures can be ready (s): 0
        # where every sample can answer them; about two counter periods where the backend reads
        # its counters apart (NVML, telemetry.counter_hz). The lag then leaves that many seconds
        # of steps between a batch's last window and the step that reads the batch's first.
        self.ready_s = ready_s

    def due(self) -> tuple[T, int, int] | None:
        """The step whose figures this step's vector carries (None while fewer than ``lag``
        steps wait)."""
        return self.steps.popleft() if len(self.steps) >= self.lag else None

    def wait_s(self, due: tuple[T, int, int], period_ns: float) -> float:
        """How long to wait for ``due``'s figures (:func:`late_wait`): they are computed with those
        of the steps after it up to the newest waiting, so they are due once that one's are."""
        return late_wait(self.steps[-1][2] if self.steps else due[2], period_ns)

    def add(self, step: tuple[T, int, int], step_time_s: float) -> None:
        """A step that ended, with the step time all ranks agree on (the maximum, s)."""
        self.steps.append(step)
        if step_time_s > 0 and math.isfinite(step_time_s):
            batch = math.ceil(FIGURES_BATCH_S / step_time_s)
            slack = math.ceil(self.ready_s / step_time_s)
            self.lag = max(self.lag, min(self.max_lag, batch + slack))
            self.batch = max(self.batch, 1, min(batch, self.lag - slack))
