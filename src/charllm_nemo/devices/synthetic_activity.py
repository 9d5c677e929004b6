"""What a synthetic device's model follows besides the window marks: a process's CPU use, the
level another process published, a process's resident memory (split from devices/synthetic.py,
which re-exports them)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_TICK_NS = 1_000_000_000 // (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
_PROC_REFRESH_NS = 100_000_000  # /proc CPU times tick every 10 ms: average over >= 100 ms
_RSS_REFRESH_NS = 200_000_000  # reading /proc costs ~20 us: refresh 5x a second, not per sample
_rss_cache: dict[str, tuple[int, int | None]] = {}


def _rss_bytes(statm: str = "/proc/self/statm") -> int | None:
    now = time.monotonic_ns()
    cached = _rss_cache.get(statm)
    if cached is not None and now - cached[0] < _RSS_REFRESH_NS:
        return cached[1]
    try:
        with open(statm, "rb") as f:
            value: int | None = int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        value = None
    _rss_cache[statm] = (now, value)
    return value


class CpuActivity:
    """CPU use since the last call, as a fraction of one core (0..1).

    ``pid=None``: this process (``time.process_time_ns``, ns resolution, every call). ``pid=N``:
    process N's user + system time from ``/proc/N/stat`` (the sampling process observing the
    training process). Those count in clock ticks (10 ms), so the level is refreshed at most
    every ``_PROC_REFRESH_NS`` and held in between; a process that is gone reads as idle.
    """

    def __init__(self, pid: int | None = None) -> None:
        self._stat = None if pid is None else f"/proc/{pid}/stat"
        self._last_cpu = 0
        self._last_cpu = self._cpu_ns()
        self._last_t = time.monotonic_ns()
        self._level = 0.0

    def _cpu_ns(self) -> int:
        if self._stat is None:
            return time.process_time_ns()
        try:
            with open(self._stat, "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            # after "(comm)": state is field 3, utime field 14 and stime field 15 (proc(5))
            return (int(fields[11]) + int(fields[12])) * _TICK_NS
        except (OSError, ValueError, IndexError):
            return self._last_cpu  # gone or unreadable: no new CPU time, i.e. idle

    def level(self, t_ns: int) -> float:
        dt = t_ns - self._last_t
        if dt <= 0 or (self._stat is not None and dt < _PROC_REFRESH_NS):
            return self._level if self._stat is not None else 0.0
        cpu = self._cpu_ns()
        frac = (cpu - self._last_cpu) / dt
        self._last_cpu, self._last_t = cpu, t_ns
        self._level = min(1.0, max(0.0, frac))
        return self._level


class SharedActivity:
    """Activity written by another process: the sampling process's side of window marks.

    In process mode (``telemetry.sampler=process``) the window marks happen in the training
    process and the synthetic device is read in the sampling process. The training process
    writes ``MarkActivity.level()`` into one float64 of the shared block on every mark; this
    reads it back through ``read_level()``. NaN means no mark has arrived yet: the level then
    comes from ``fallback`` (``auto``: the training process's CPU use; ``marks``: idle). With
    injected throttle windows the word is ``level + 2 * window`` (:meth:`MarkActivity.injected`).
    """

    def __init__(self, read_level: Callable[[], float], fallback: Callable[[int], float]) -> None:
        self._read = read_level
        self._fallback = fallback

    def level(self, t_ns: int) -> float:
        value = self._read()
        if value != value:
            return self._fallback(t_ns)
        return value - 2.0 * (value // 2.0) if value > 1.0 else value

    def injected(self, t_ns: int) -> int:
        """The injected throttle window the training process published (1 + its index; 0:
        none). The published word is ``level + 2 * window`` (level in [0, 1])."""
        value = self._read()
        return 0 if value != value or value <= 1.0 else int(value // 2.0)
