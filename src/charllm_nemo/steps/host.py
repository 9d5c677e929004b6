"""How much the host's CPUs held a rank back over its last step (docs/alerts.md, "Host contention").

A rank that arrives last at a collective with its device running like its peers' is slowed by
something else; on a shared or oversubscribed host that is most often the CPU: the training
thread waiting in the run queue (it cannot launch kernels or run CPU ops), other processes
keeping the cores busy, or a hypervisor taking them (steal). :class:`HostPressure` reads, at each
step's end, the Linux counters that say so, as deltas since its last read:

* ``run_delay_s``: this process's main thread's time waiting in the run queue
  (``/proc/self/schedstat``, field 2, ns; the training thread is the main thread);
* ``cpu_pressure_s``: time in which at least one task on the host waited for a CPU (PSI,
  ``/proc/pressure/cpu`` ``some total``, µs);
* ``cpu_steal_share``: the share of all CPUs' time the hypervisor took (``/proc/stat`` ``cpu``
  line: steal over the sum of its fields), over the last :data:`STEAL_EVERY_NS` or more: the
  kernel makes all of ``/proc/stat`` (every CPU's and interrupt's counts) for each read, the
  dearest of the four, so it is read at most that often and a shorter step gets the share of
  the span that ended last (a share, not a time: a span around the step says it);
* ``load_1m``: the one-minute load average (``/proc/loadavg``) over the CPUs this process may
  use, read at most every :data:`LOAD_EVERY_NS` (it moves over a minute).

These are system files, not the run's: read directly, each bounded to one small ``os.pread``
(the documented exception to the hardened read layer, which guards the run's own files). A
counter the kernel does not have (no PSI before Linux 4.20 or with ``psi=0``, no schedstat
without ``CONFIG_SCHEDSTATS``, not Linux) is NaN, never an error. A sample costs
~30-60 µs on a loaded 2-core VM (the files stay open between samples); most steps read two.
"""

from __future__ import annotations

import math
import os
import time

HOST_FIELDS: tuple[str, ...] = ("run_delay_s", "cpu_pressure_s", "cpu_steal_share", "load_1m")
"""What :meth:`HostPressure.sample` returns, in order (s, s, 0-1, runnable tasks per CPU)."""

STEAL_EVERY_NS = 100_000_000
"""``/proc/stat`` is read at most this often (ns): ``cpu_steal_share`` spans at least this long."""
LOAD_EVERY_NS = 1_000_000_000
"""``/proc/loadavg`` is read at most this often (ns)."""

_MAX_READ = 4096  # the first line of /proc/stat (the "cpu" total) fits in far less on any host


def _open(path: str) -> int | None:
    """A descriptor on a system file (kept: a pread of an open /proc file costs a few µs, an
    open and close several times that), None when it cannot be opened."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None


def _pread(fd: int | None) -> bytes | None:
    """The file's first ``_MAX_READ`` bytes, read afresh (the kernel regenerates a /proc file
    at offset 0), None when it cannot be read."""
    if fd is None:
        return None
    try:
        return os.pread(fd, _MAX_READ, 0)
    except OSError:
        return None


def parse_schedstat(data: bytes | None) -> float | None:
    """Run-queue wait (s) from ``/proc/<pid>/schedstat`` (``run_ns wait_ns timeslices``)."""
    try:
        return int(data.split()[1]) / 1e9 if data else None
    except (IndexError, ValueError):
        return None


def parse_psi_some_total(data: bytes | None) -> float | None:
    """``some total`` (s) from ``/proc/pressure/cpu``."""
    for line in (data or b"").splitlines():
        if line.startswith(b"some "):
            for part in line.split():
                if part.startswith(b"total="):
                    try:
                        return int(part[6:]) / 1e6
                    except ValueError:
                        return None
    return None


def parse_stat_cpu(data: bytes | None) -> tuple[int, int] | None:
    """(steal, total) ticks of the ``cpu`` line of ``/proc/stat`` (guest time is already in user)."""
    line = (data or b"").split(b"\n", 1)[0].split()
    if len(line) < 9 or line[0] != b"cpu":
        return None
    try:
        ticks = [int(x) for x in line[1:9]]  # user nice system idle iowait irq softirq steal
    except ValueError:
        return None
    return ticks[7], sum(ticks)


def parse_load_1m(data: bytes | None) -> float | None:
    try:
        return float(data.split()[0]) if data else None
    except (IndexError, ValueError):
        return None


def _cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class HostPressure:
    """The host's CPU contention since the last :meth:`sample` (module doc). The first sample
    measures from construction. Keeps four descriptors open until :meth:`close`. Not
    thread-safe: one per training thread."""

    def __init__(self, pid: int | None = None) -> None:
        schedstat = f"/proc/{'self' if pid is None else pid}/schedstat"
        paths = (schedstat, "/proc/pressure/cpu", "/proc/stat", "/proc/loadavg")
        self._fds: list[int | None] = [_open(p) for p in paths]
        self._cpus = _cpus()
        self._delay = parse_schedstat(_pread(self._fds[0]))
        self._psi = parse_psi_some_total(_pread(self._fds[1]))
        self._stat = parse_stat_cpu(_pread(self._fds[2]))
        self._stat_at = self._load_at = time.monotonic_ns()
        self._steal = math.nan
        self._load = math.nan
        self._load_at -= LOAD_EVERY_NS  # the first sample reads the load

    def sample(self) -> tuple[float, float, float, float]:
        """:data:`HOST_FIELDS` over the time since the last call (NaN where not known; the
        steal share and the load as of their last read: module doc)."""
        fds = self._fds
        nan = math.nan
        d0, d1 = self._delay, parse_schedstat(_pread(fds[0]))
        p0, p1 = self._psi, parse_psi_some_total(_pread(fds[1]))
        self._delay, self._psi = d1, p1
        delay = d1 - d0 if d0 is not None and d1 is not None and d1 >= d0 else nan
        psi = p1 - p0 if p0 is not None and p1 is not None and p1 >= p0 else nan
        now = time.monotonic_ns()
        if now - self._stat_at >= STEAL_EVERY_NS:
            s0, s1 = self._stat, parse_stat_cpu(_pread(fds[2]))
            self._stat, self._stat_at = s1, now
            steal = nan
            if s0 is not None and s1 is not None and s1[1] > s0[1]:
                steal = max(0.0, (s1[0] - s0[0]) / (s1[1] - s0[1]))
            self._steal = steal
        if now - self._load_at >= LOAD_EVERY_NS:
            load = parse_load_1m(_pread(fds[3]))
            self._load, self._load_at = (nan if load is None else load / self._cpus), now
        return delay, psi, self._steal, self._load

    def close(self) -> None:
        """Close the descriptors (a later sample reads NaN)."""
        fds, self._fds = self._fds, [None] * len(self._fds)
        self._steal = self._load = math.nan
        for fd in fds:
            if fd is not None:
                os.close(fd)

    def __del__(self) -> None:
        self.close()
