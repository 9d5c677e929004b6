"""Which clock the samples carry, how it maps to the wall clock, and the host's time-sync state.

Every sample and window mark is stamped with CLOCK_MONOTONIC (``t_mono_ns``): steady, but each
host's own, with an arbitrary origin. Putting the ranks of several nodes on one time base (a job
power waveform) needs each node's wall clock: ``wall = t_mono_ns + (wall - monotonic)``. The
manifest's ``clock`` records that offset at the start and at the close of the run (the two differ
by what NTP/PTP slewed or stepped the wall clock meanwhile), and the kernel's own view of how well
the wall clock is synchronized, read without privileges and without the network:

* ``adjtimex(2)`` with ``modes = 0`` (read only; any user may) gives the kernel clock state
  (``TIME_ERROR`` when unsynchronized), the ``STA_UNSYNC`` status bit, and ``maxerror`` /
  ``esterror`` (us): the kernel's bound on and estimate of the wall clock's error, which whatever
  disciplines the clock (ntpd, chronyd, systemd-timesyncd, phc2sys) keeps up to date;
* ``/dev/ptp*``: PTP hardware clocks on the host. The kernel does not say which daemon
  disciplines the clock, so ``source`` is inferred: ``ptp`` when the clock is synchronized and a
  PTP hardware clock exists, ``ntp`` when synchronized without one, ``none`` when the kernel says
  unsynchronized, ``unknown`` when the state could not be read (not Linux; a sandbox refusing the
  call).

Schema: docs/store.md (``manifest.json``, ``clock``).
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SAMPLE_CLOCK = "CLOCK_MONOTONIC"
"""The clock of every ``t_mono_ns`` (samples, window marks): ``time.monotonic_ns``."""

TIME_ERROR = 5
"""``adjtimex``'s return value when the kernel clock is not synchronized."""

STA_UNSYNC = 0x0040
"""``timex.status`` bit: the clock is not synchronized."""

_BRACKET_TRIES = 5


class _Timeval(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_usec", ctypes.c_long)]


class Timex(ctypes.Structure):
    """``struct timex`` (linux/timex.h, glibc's ``sys/timex.h``)."""

    _fields_ = [
        ("modes", ctypes.c_uint),
        ("offset", ctypes.c_long),
        ("freq", ctypes.c_long),
        ("maxerror", ctypes.c_long),
        ("esterror", ctypes.c_long),
        ("status", ctypes.c_int),
        ("constant", ctypes.c_long),
        ("precision", ctypes.c_long),
        ("tolerance", ctypes.c_long),
        ("time", _Timeval),
        ("tick", ctypes.c_long),
        ("ppsfreq", ctypes.c_long),
        ("jitter", ctypes.c_long),
        ("shift", ctypes.c_int),
        ("stabil", ctypes.c_long),
        ("jitcnt", ctypes.c_long),
        ("calcnt", ctypes.c_long),
        ("errcnt", ctypes.c_long),
        ("stbcnt", ctypes.c_long),
        ("tai", ctypes.c_int),
        ("_padding", ctypes.c_int * 11),
    ]


def read_timex() -> tuple[int, Timex] | None:
    """``adjtimex`` with ``modes = 0`` (reads, changes nothing; no privilege needed): the clock
    state it returns and the filled structure, or None where it cannot be called (not Linux, no
    libc symbol, the call refused)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.adjtimex
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.POINTER(Timex)]
    fn.restype = ctypes.c_int
    tx = Timex()
    state = int(fn(ctypes.byref(tx)))
    if state < 0:
        return None
    return state, tx


def ptp_devices(dev: Path = Path("/dev")) -> list[str]:
    """Names of the PTP hardware clocks under ``dev`` (``ptp0``, ...), sorted; [] if none or
    unreadable."""
    try:
        return sorted(p.name for p in dev.iterdir() if p.name.startswith("ptp") and p.name[3:].isdigit())
    except OSError:
        return []


def classify_sync(
    state: int | None, status: int, maxerror_us: int, esterror_us: int, ptp: list[str]
) -> dict[str, Any]:
    """The manifest's ``clock.sync`` from what ``adjtimex`` returned (``state`` None: it could not
    be read) and the PTP clocks present."""
    if state is None:
        return {
            "source": "unknown",
            "synchronized": None,
            "max_error_ns": None,
            "est_error_ns": None,
            "kernel_state": None,
            "ptp_devices": ptp,
        }
    synchronized = state != TIME_ERROR and not status & STA_UNSYNC
    return {
        "source": ("ptp" if ptp else "ntp") if synchronized else "none",
        "synchronized": synchronized,
        "max_error_ns": int(maxerror_us) * 1000,
        "est_error_ns": int(esterror_us) * 1000,
        "kernel_state": int(state),
        "ptp_devices": ptp,
    }


def sync_state(dev: Path = Path("/dev")) -> dict[str, Any]:
    """This host's time-sync state now (``clock.sync``; see the module doc)."""
    got = read_timex()
    ptp = ptp_devices(dev)
    if got is None:
        return classify_sync(None, 0, 0, 0, ptp)
    state, tx = got
    return classify_sync(state, tx.status, tx.maxerror, tx.esterror, ptp)


def wall_minus_monotonic() -> tuple[int, int, int]:
    """``(wall - monotonic, uncertainty, monotonic)`` in ns: the wall clock read between two
    monotonic reads, the narrowest of a few brackets; the uncertainty is half its width, the
    monotonic time its middle."""
    best: tuple[int, int, int] | None = None
    for _ in range(_BRACKET_TRIES):
        m0 = time.monotonic_ns()
        w = time.time_ns()
        m1 = time.monotonic_ns()
        mid = (m0 + m1) // 2
        if best is None or m1 - m0 < best[1]:
            best = (w - mid, m1 - m0, mid)
    assert best is not None
    return best[0], (best[1] + 1) // 2, best[2]


def clock_at_start(dev: Path = Path("/dev")) -> dict[str, Any]:
    """The manifest's ``clock`` at the start of a run (the ``_end`` fields null until close)."""
    offset, uncertainty, mono = wall_minus_monotonic()
    return {
        "sample_clock": SAMPLE_CLOCK,
        "wall_minus_monotonic_ns_start": offset,
        "wall_minus_monotonic_ns_end": None,
        "measured_mono_ns_start": mono,
        "measured_mono_ns_end": None,
        "measure_uncertainty_ns": uncertainty,
        "sync": sync_state(dev),
        "sync_end": None,
    }


def clock_at_end(clock: dict[str, Any], dev: Path = Path("/dev")) -> dict[str, Any]:
    """``clock`` (as :func:`clock_at_start` made it) with the close's offset and sync state; the
    uncertainty becomes the larger of the two measurements'. Measured in the process that closes
    the manifest: the training process, or its telemetry process when training died (the same
    host's clocks either way)."""
    offset, uncertainty, mono = wall_minus_monotonic()
    before = clock.get("measure_uncertainty_ns")
    return {
        **clock,
        "wall_minus_monotonic_ns_end": offset,
        "measured_mono_ns_end": mono,
        "measure_uncertainty_ns": max(uncertainty, before) if isinstance(before, int) else uncertainty,
        "sync_end": sync_state(dev),
    }


def wall_ns(t_mono_ns: int, clock: dict[str, Any]) -> int:
    """The wall-clock time of a monotonic stamp of this host: the offset interpolated linearly
    between the start's and the end's measurement (the start's alone while the run has no end)."""
    o0 = clock["wall_minus_monotonic_ns_start"]
    o1 = clock.get("wall_minus_monotonic_ns_end")
    m0 = clock.get("measured_mono_ns_start")
    m1 = clock.get("measured_mono_ns_end")
    if o1 is None or m0 is None or m1 is None or m1 <= m0:
        return int(t_mono_ns + o0)
    frac = min(max((t_mono_ns - m0) / (m1 - m0), 0.0), 1.0)
    return int(t_mono_ns + o0 + round(frac * (o1 - o0)))


def alignment_bound_ns(clocks: Sequence[tuple[str, Mapping[str, Any]]]) -> int | None:
    """A bound on how far apart two ranks' samples of the same instant can be placed once each is
    mapped to the wall clock (:func:`wall_ns`), from each rank's ``(host, clock)``: 0 when every
    rank is on one host (they share one CLOCK_MONOTONIC: no mapping needed); otherwise, per host,
    the kernel's maximum error of its wall clock (the larger of start and end) plus the offset's
    measurement uncertainty, and the bound is the sum of the two largest (the worst pair of hosts).
    None when a host's clock is not known to be synchronized (``sync.synchronized`` not true, or
    no maximum error): then there is no bound."""
    if len({host for host, _ in clocks}) <= 1:
        return 0
    per_host: dict[str, int] = {}
    for host, clock in clocks:
        errors = []
        for key in ("sync", "sync_end"):
            sync = clock.get(key)
            if sync is None and key == "sync_end":
                continue
            if not isinstance(sync, Mapping) or sync.get("synchronized") is not True:
                return None
            err = sync.get("max_error_ns")
            if not isinstance(err, int):
                return None
            errors.append(err)
        unc = clock.get("measure_uncertainty_ns")
        e = max(errors) + (unc if isinstance(unc, int) else 0)
        per_host[host] = max(per_host.get(host, 0), e)
    worst = sorted(per_host.values(), reverse=True)
    return worst[0] + worst[1]


__all__ = [
    "SAMPLE_CLOCK",
    "STA_UNSYNC",
    "TIME_ERROR",
    "Timex",
    "alignment_bound_ns",
    "classify_sync",
    "clock_at_end",
    "clock_at_start",
    "ptp_devices",
    "read_timex",
    "sync_state",
    "wall_minus_monotonic",
    "wall_ns",
]
