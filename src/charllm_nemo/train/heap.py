"""Free heap pages given back to the kernel while a rank trains (issue 48).

A rank's resident memory grew by ~200-500 B a step for thousands of steps after every per-step
record of the telemetry was bounded, and as much with ``telemetry=off``: glibc's main arena
(the brk ``[heap]``) grows in ~0.2 MB steps while the bytes in use stay flat (``mallinfo2``:
``uordblks``), because a training step's transient tensors and Python objects come and go
between longer-lived ones and the holes they leave are not always the right size for the next
step's. Free pages inside those holes stay resident until ``malloc_trim`` hands them back;
glibc trims only the top of the heap by itself. :class:`HeapTrim` calls ``malloc_trim(0)``
at most once every :data:`TRIM_EVERY_S` seconds between steps: with it the ranks' resident
memory over thousands of steps is flat within the soak benchmark's noise (docs/benchmarks.md,
"bench/bench_soak.py"). Where the C library has no ``malloc_trim`` (musl, macOS) it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIM_EVERY_S = 60.0
"""Seconds between two trims at least. One trim of a tiny_gpt rank's ~150 MB heap took a few
milliseconds here (docs/benchmarks.md): once a minute is ~0.01 % of a rank's time."""


def libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim(pad)`` (returns 1 when memory was given back), or None where the C
    library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class HeapTrim:
    """Call :meth:`after_step` after every step; it trims the heap at most once every
    ``every_s`` seconds (the first time ``every_s`` after construction). ``trim`` and ``clock``
    (monotonic seconds) are there for tests. ``calls`` and ``seconds`` count the trims done and
    the time they took."""

    def __init__(
        self,
        every_s: float = TRIM_EVERY_S,
        *,
        trim: Callable[[int], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every_s = every_s
        self._trim = trim if trim is not None else libc_malloc_trim()
        self._clock = clock
        self._next = clock() + every_s
        self.calls = 0
        self.seconds = 0.0

    @property
    def available(self) -> bool:
        """Whether there is a ``malloc_trim`` to call (glibc)."""
        return self._trim is not None

    def after_step(self) -> bool:
        """Trim when the period has passed; whether it did."""
        if self._trim is None:
            return False
        now = self._clock()
        if now < self._next:
            return False
        t0 = time.perf_counter()
        self._trim(0)
        took = time.perf_counter() - t0
        self.calls += 1
        self.seconds += took
        self._next = self._clock() + self.every_s
        ms, total = took * 1e3, self.seconds * 1e3
        log.debug("malloc_trim: %.2f ms (%d trims, %.1f ms all told)", ms, self.calls, total)
        return True
