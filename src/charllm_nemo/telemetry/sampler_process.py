"""Sampling in a separate process, for rates a thread cannot hold (``telemetry.sampler``).

A thread sampler shares the GIL with the training thread; when that thread runs Python, the
sampler waits for the GIL for up to the switch interval (5 ms), which at 1 kHz is five periods.
bench/bench_sampler.py part b measures it (docs/benchmarks.md): with a core free the thread
meets 100 % of its deadlines at 100 Hz but ~55 % at 1 kHz, while this process meets
99.6-99.9 %. So the session samples in a thread up to :data:`PROCESS_ABOVE_HZ` and here above it.

:class:`ProcessSampler` has the interface of :class:`~charllm_nemo.telemetry.sampler.Sampler`.
The sampling process runs the same loop (:func:`~charllm_nemo.telemetry.sample_loop.run_sample_loop`)
on a backend it opens itself by name, and writes rows into a POSIX shared-memory ring that the
training process reads (made as ``multiprocessing.shared_memory`` makes its blocks, with its
``_posixshmem`` module; see "Lifetime" for why not its class). CLOCK_MONOTONIC is
system-wide, so the child's timestamps join with the parent's window marks as the thread's do.

Start: a fresh interpreter (``sys.executable -c ...``: fork + exec, never a bare fork, which is
unsafe once CUDA or torch threads exist). Not ``multiprocessing``'s spawn context: it re-imports
the parent's ``__main__`` module in the child, and a training script's ``import torch`` would
run there. The child imports the package's light modules and the backend's library only (no
torch, numpy or pyarrow); start-up until it samples (spawn + imports + backend open) is
~50 ms synthetic, ~75 ms NVML here (``ProcessSampler.startup`` has the parts).

Shared block (all int64 / float64, 8-byte aligned; ``q[i]`` = int64 slot i, ``d[i]`` = float64):

* header, 64 slots: magic, capacity, column counts, the **write counter** (rows written since
  start), state (starting / running / stopped / failed), the stop request, the child's pid,
  start-up timestamps, the stop code, then the health counters (samples, slots, on_time,
  deadlines_missed, late_max_ns, read_ns_total, read_ns_max, devices_lost, errors, ...),
  and one float64: the synthetic device's activity level (NaN = no window mark yet);
* a 1 KiB UTF-8 message: why the child stopped (a crash, a backend that would not open);
* the ring, column-major, ``capacity`` rows: int64 columns ``t_mono_ns``, ``t_wall_ns``,
  ``read_ns``, ``device_index`` and every int metric (null = INT_NULL, -1: every int metric is
  a counter, size or bitmask, all >= 0), then float64 columns, one per float metric (null =
  NaN). 64-bit counters stay int64 end to end: none goes through a float64.

Ordering: the child writes a row's columns into slot ``n % capacity``, then stores ``n + 1``
in the write counter; the parent loads the counter, then copies the rows below it, then loads
the counter again and drops (and counts in ``health.rows_lost``) any row the child may have
overwritten meanwhile (it lapped the reader: more than ``capacity`` rows behind). This relies on
aligned 8-byte stores and loads being single instructions (CPython's memoryview copies int64 /
float64 items with a fixed-size 8-byte memcpy, in practice one ``mov`` / ``ldr`` / ``str``), and
on the CPU keeping the child's stores, and the parent's loads, in program order, which x86-64
(TSO) guarantees. On a weakly ordered CPU (aarch64, e.g. Grace) nothing here issues a barrier
on either side, so a reader could in principle see the new counter before the last stores of
its row (the flusher reads rows up to 0.5 s old, but a live ``peek_rows`` reads the newest);
closing that needs a release store and an acquire load (a few lines of C), not done here.

Lifetime: the child stops when told (stop request + its stdin closed, which also wakes it from
its sleep), when the parent dies (EOF on stdin, or ``os.getppid()`` changing: checked every
slot) or when no device is left (health says which). On parent death it unlinks the block
itself; the parent unlinks it on ``stop()`` and at exit, also when the child crashed. Only
when both die by SIGKILL (a cgroup kill) can a block stay in /dev/shm
(``charllm-sampler-<parent pid>-<hex>``, 16 s of rows: ~3 MB per device at 1 kHz).
``multiprocessing.shared_memory.SharedMemory`` is not used because on Python < 3.13 it
registers every block with a resource-tracker process (one more process per rank, and in a
child that attaches, a tracker of its own that unlinks the block when the child exits); at a
parent's SIGKILL that tracker's clean-up races the child's and prints warnings.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import math
import mmap
import os
import pickle
import secrets
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.sample_loop import Row, SamplerHealth, run_sample_loop, validate_hz
from charllm_nemo.telemetry.schema import FLOAT_METRICS, INT_METRICS, INT_NULL, METRIC_INDEX, METRICS

log = logging.getLogger("charllm_nemo.sampler")

SAMPLER_MODES: tuple[str, ...] = ("auto", "thread", "process")
PROCESS_ABOVE_HZ = 200.0
"""``telemetry.sampler=auto`` samples in a separate process above this rate, in a thread up to it."""

RING_SECONDS = 16.0  # ring capacity in seconds of rows at the configured rate (at least MIN_CAPACITY)
MIN_CAPACITY = 4096


def resolve_sampler_mode(mode: str, hz: float) -> str:
    """``thread`` or ``process`` for ``telemetry.sampler`` = ``mode`` at ``hz``; ConfigError if unknown."""
    if mode not in SAMPLER_MODES:
        raise ConfigError(
            f"telemetry.sampler={mode!r} is not a sampler mode; use one of {', '.join(SAMPLER_MODES)} "
            f"(auto = a separate process above {PROCESS_ABOVE_HZ:g} Hz, a thread up to it)"
        )
    if mode == "auto":
        return "process" if hz > PROCESS_ABOVE_HZ else "thread"
    return mode


# -- the shared block ---------------------------------------------------------------------------

_MAGIC = 0x636C6D2D72696E67  # "clm-ring"
(_H_MAGIC, _H_CAPACITY, _H_N_INT, _H_N_FLOAT, _H_WRITE_COUNT, _H_STATE, _H_STOP, _H_PID) = range(8)
(_H_T_SPAWNED, _H_T_MAIN, _H_T_IMPORTED, _H_T_OPENED, _H_STOP_CODE, _H_MSG_LEN) = range(8, 14)
_H_HEALTH = 16
_HEALTH_FIELDS = (
    "started_mono_ns",
    "stopped_mono_ns",
    "samples",
    "slots",
    "on_time",
    "deadlines_missed",
    "late_max_ns",
    "read_ns_total",
    "read_ns_max",
    "devices_lost",
    "errors",
)
_D_ACTIVITY = 40  # float64 slot: the synthetic activity level the parent's marks set
_HEADER_SLOTS = 64
_MSG_OFFSET = _HEADER_SLOTS * 8
_MSG_SIZE = 1024
_COL0 = (_MSG_OFFSET + _MSG_SIZE) // 8  # first slot of the ring

STARTING, RUNNING, STOPPED, FAILED = 0, 1, 2, 3
_STOP_CODES = {"stopped": 1, "no devices left": 2, "crashed": 3, "parent exited": 4, "backend open failed": 5}

INT_COLUMNS: tuple[str, ...] = ("t_mono_ns", "t_wall_ns", "read_ns", "device_index", *INT_METRICS)
FLOAT_COLUMNS: tuple[str, ...] = FLOAT_METRICS
_INT_METRIC_POS = tuple(METRIC_INDEX[m] for m in INT_METRICS)
_FLOAT_METRIC_POS = tuple(METRIC_INDEX[m] for m in FLOAT_METRICS)
_N_INT, _N_FLOAT = len(INT_COLUMNS), len(FLOAT_COLUMNS)


# A memoryview cast to "d": typeshed's memoryview.__setitem__ accepts only ints, so it is Any here.
FloatView = Any


def block_size(capacity: int) -> int:
    """Bytes of the shared block for ``capacity`` rows."""
    return (_COL0 + (_N_INT + _N_FLOAT) * capacity) * 8


def _int_base(capacity: int, column: int) -> int:
    return _COL0 + column * capacity


def _float_base(capacity: int, column: int) -> int:
    return _COL0 + (_N_INT + column) * capacity


def _posixshmem() -> Any:
    # The C module multiprocessing.shared_memory is built on (it has no type stubs).
    return importlib.import_module("_posixshmem")


def _create(name: str, size: int) -> mmap.mmap:
    fd = _posixshmem().shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    except BaseException:
        _unlink(name)
        raise
    finally:
        os.close(fd)


def _attach(name: str) -> mmap.mmap:
    fd = _posixshmem().shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _posixshmem().shm_unlink("/" + name)


# -- the parent's side ----------------------------------------------------------------------------


class ProcessSampler:
    """Samples in a separate process at ``hz``; the interface of :class:`Sampler`.

    ``backend``, ``devices`` (host indices, None = all) and ``backend_options`` are what the
    child passes to :func:`~charllm_nemo.devices.factory.open_backend`; the options must be
    picklable. For ``synthetic``, activity ``marks`` / ``auto`` follows :meth:`publish_activity`
    (the session calls it on every window mark; ``auto`` = the training process's CPU use until
    the first mark) and ``cpu`` is the training process's CPU use. ``capacity``: ring rows
    (default: 16 s at ``hz`` for every device, at least 4096).
    """

    mode = "process"

    def __init__(
        self,
        backend: str,
        devices: Sequence[int] | None = None,
        backend_options: dict[str, Any] | None = None,
        hz: float = 100.0,
        source: str | None = None,
        *,
        capacity: int | None = None,
    ) -> None:
        self.hz = validate_hz(hz)
        self.period_ns = round(1e9 / self.hz)
        self.source = source or backend
        self.backend_name = backend
        self.devices = None if devices is None else [int(i) for i in devices]
        n_dev = len(self.devices) if self.devices is not None else 8
        self.capacity = capacity or max(MIN_CAPACITY, math.ceil(RING_SECONDS * self.hz * max(1, n_dev)))
        if self.capacity < 2:
            raise ConfigError(f"ProcessSampler capacity={self.capacity} must be >= 2 rows")
        self._options, self._shared_activity, self._observe_parent = _child_options(
            backend, dict(backend_options or {})
        )
        try:
            pickle.dumps(self._options)
        except Exception as exc:
            raise ConfigError(
                f"backend options {sorted(self._options)} cannot be sent to the sampling process ({exc}); "
                "use picklable options or telemetry.sampler=thread"
            ) from None
        self._lock = threading.RLock()
        self._mm: mmap.mmap | None = None
        self._name: str | None = None
        self._q: memoryview | None = None
        self._d: FloatView | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._read_idx = 0
        self._rows_lost = 0
        self._startup_ns = 0
        self._stopped = False
        self._tail: list[Row] = []
        self._final: SamplerHealth | None = None
        self._final_last_t = 0
        self._start_error: str | None = None
        self._owner_pid = 0
        self.startup: dict[str, float] = {}

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, wait_s: float = 5.0) -> None:
        """Create the block, start the sampling process and wait (up to ``wait_s``) until it
        samples. Never raises: if the block or the child fails, ``running`` is False and
        ``health.stop_reason`` says why (the session then samples in a thread)."""
        if self._proc is not None or self._stopped:
            return
        t0 = time.monotonic_ns()
        self._owner_pid = os.getpid()
        name = f"charllm-sampler-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            mm = _create(name, block_size(self.capacity))  # zero-filled: state STARTING, count 0
        except OSError as exc:
            log.error("telemetry: no shared memory for the sampling process (%s); training goes on", exc)
            self._start_error = f"no shared memory for the sampling process: {exc}"
            self._stopped = True
            return
        q = memoryview(mm).cast("q")
        d: FloatView = memoryview(mm).cast("d")
        q[_H_MAGIC], q[_H_CAPACITY], q[_H_N_INT], q[_H_N_FLOAT] = _MAGIC, self.capacity, _N_INT, _N_FLOAT
        d[_D_ACTIVITY] = math.nan
        self._mm, self._name, self._q, self._d = mm, name, q, d
        config = {
            "shm_name": name,
            "backend": self.backend_name,
            "devices": self.devices,
            "options": self._options,
            "shared_activity": self._shared_activity,
            "observe_parent": self._observe_parent,
            "hz": self.hz,
            "parent_pid": os.getpid(),
        }
        payload = pickle.dumps(config)
        env = dict(os.environ)
        # The child must import this very package, wherever the parent found it.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        q[_H_T_SPAWNED] = time.monotonic_ns()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD_CODE],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                env=env,
                close_fds=True,
            )
            assert self._proc.stdin is not None
            self._proc.stdin.write(struct.pack("<Q", len(payload)) + payload)
            self._proc.stdin.flush()
        except Exception as exc:
            log.error("telemetry sampling process could not start (%s); training goes on", exc)
            self._start_error = f"sampling process could not start: {exc!r}"
            if self._proc is not None:
                self._proc.kill()
            self.stop()
            return
        atexit.register(self._atexit)
        deadline = time.monotonic() + wait_s
        while q[_H_STATE] == STARTING and self._proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        self._startup_ns = time.monotonic_ns() - t0
        state = q[_H_STATE]
        self.startup = {
            "total_s": self._startup_ns / 1e9,
            "spawn_s": _span(q[_H_T_SPAWNED], q[_H_T_MAIN]),  # fork + exec + interpreter start
            "import_s": _span(q[_H_T_MAIN], q[_H_T_IMPORTED]),  # this package + the backend factory
            "open_s": _span(q[_H_T_IMPORTED], q[_H_T_OPENED]),
        }
        if state == RUNNING:
            log.info(
                "telemetry sampling process %d started in %.0f ms (spawn %.0f, imports %.0f, open %.0f)",
                self._proc.pid,
                self._startup_ns / 1e6,
                *(1e3 * self.startup[k] for k in ("spawn_s", "import_s", "open_s")),
            )
        elif state == STARTING and self._proc.poll() is None:
            log.warning("telemetry sampling process not ready after %.1f s; it keeps starting", wait_s)
        else:
            log.error(
                "telemetry sampling process failed to start: %s; training goes on",
                self.health.stop_reason,
            )

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the child (at most ``timeout_s``, then SIGKILL), keep the rows it left in the
        ring for :meth:`take_rows`, and unlink the block. Idempotent. A no-op in a process
        forked from the one that started it (its atexit must not stop the parent's sampler)."""
        if self._owner_pid and os.getpid() != self._owner_pid:
            return
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        proc, q = self._proc, self._q
        if q is not None:
            q[_H_STOP] = 1
        if proc is not None:
            try:
                if proc.stdin is not None:
                    proc.stdin.close()  # EOF wakes the child from its sleep
            except OSError:
                pass
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("sampling process %d did not stop in %.1f s; killed", proc.pid, timeout_s)
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(1.0)
        with self._lock:
            if self._q is not None:
                self._tail.extend(self._read(advance=True))
                self._final = self._snapshot()
                self._final_last_t = self._last_t_locked()
            self._release()
        atexit.unregister(self._atexit)

    def _atexit(self) -> None:
        self.stop(1.0)

    def _release(self) -> None:
        mm, self._mm = self._mm, None
        for view in (self._q, self._d):
            if view is not None:
                view.release()
        self._q = self._d = None
        if mm is not None:
            mm.close()
        if self._name is not None:
            _unlink(self._name)  # a no-op if the child unlinked it already
            self._name = None

    @property
    def running(self) -> bool:
        proc, q = self._proc, self._q
        if proc is None or q is None or self._stopped or proc.poll() is not None:
            return False
        try:
            return q[_H_STATE] in (STARTING, RUNNING)
        except ValueError:  # released by a concurrent stop()
            return False

    @property
    def pid(self) -> int | None:
        """The sampling process's pid (None before start)."""
        return None if self._proc is None else self._proc.pid

    @property
    def shm_name(self) -> str | None:
        """The shared block's name (None before start and after stop)."""
        return self._name

    # -- the training process's side of the synthetic activity ------------------------------
    def publish_activity(self, level: float) -> None:
        """Set the activity level a synthetic device in the child follows (cheap; never raises)."""
        d = self._d
        if d is not None:
            with contextlib.suppress(ValueError, TypeError):  # released by a concurrent stop()
                d[_D_ACTIVITY] = float(level)

    # -- data ------------------------------------------------------------------------------
    def take_rows(self) -> list[Row]:
        """Hand over the rows sampled since the last call (the store calls this)."""
        with self._lock:
            if self._q is None:
                rows, self._tail = self._tail, []
                return rows
            return self._read(advance=True)

    def peek_rows(self) -> list[Row]:
        """A copy of the rows not yet taken (for live figures); the rows stay queued."""
        with self._lock:
            if self._q is None:
                return list(self._tail)
            return self._read(advance=False)

    @property
    def last_t_mono_ns(self) -> int:
        """``t_mono_ns`` of the newest row the child has published (0 before the first)."""
        with self._lock:
            if self._q is None:
                return self._final_last_t
            return self._last_t_locked()

    def _last_t_locked(self) -> int:
        q = self._q
        assert q is not None
        w = q[_H_WRITE_COUNT]
        if w == 0:
            return 0
        value: int = q[_int_base(self.capacity, 0) + (w - 1) % self.capacity]
        return value

    @property
    def health(self) -> SamplerHealth:
        """The child's counters as of now (a fresh snapshot), plus rows lost and start-up time."""
        with self._lock:
            if self._final is not None:
                return self._final
            return self._snapshot()

    def _snapshot(self) -> SamplerHealth:
        h = SamplerHealth(hz=self.hz, rows_lost=self._rows_lost, startup_ns=self._startup_ns)
        q = self._q
        if q is None:
            h.stop_reason = self._start_error
            return h
        for i, field in enumerate(_HEALTH_FIELDS):
            setattr(h, field, q[_H_HEALTH + i])
        state = q[_H_STATE]
        if state in (STOPPED, FAILED):
            mm = self._mm
            assert mm is not None
            n = q[_H_MSG_LEN]
            h.stop_reason = mm[_MSG_OFFSET : _MSG_OFFSET + n].decode("utf-8", "replace")
        elif self._proc is not None and self._proc.poll() is not None:
            h.errors += 1
            h.stop_reason = f"sampling process exited unexpectedly (exit code {self._proc.returncode})"
        if self._start_error is not None:
            h.stop_reason = self._start_error
        return h

    def _read(self, advance: bool) -> list[Row]:
        """Rows between the read index and the write counter (called under the lock)."""
        q, d = self._q, self._d
        assert q is not None and d is not None
        cap = self.capacity
        end = q[_H_WRITE_COUNT]
        first = self._read_idx
        if end - first > cap:  # lapped: the oldest rows are gone
            if advance:
                self._rows_lost += end - cap - first
            first = end - cap
        rows = _copy_rows(q, d, cap, first, end)
        # The child may have written on while we copied: a row whose slot it reached since is
        # not the row we wanted. Slot of row i is reused by row i + cap; row `now` may be half-written.
        now = q[_H_WRITE_COUNT]
        oldest_safe = now - cap + 1
        if first < oldest_safe:
            drop = min(oldest_safe - first, len(rows))
            rows = rows[drop:]
            if advance:
                self._rows_lost += drop
        if advance:
            self._read_idx = end
        return rows


def _span(a: int, b: int) -> float:
    return (b - a) / 1e9 if a and b else math.nan


def _copy_rows(q: memoryview, d: FloatView, cap: int, first: int, end: int) -> list[Row]:
    n = end - first
    if n <= 0:
        return []
    lo = first % cap
    split = min(n, cap - lo)

    def column(view: Any, base: int) -> list[Any]:
        values: list[Any] = view[base + lo : base + lo + split].tolist()
        if split < n:
            values += view[base : base + n - split].tolist()
        return values

    t_mono, t_wall, read_ns, dev = (column(q, _int_base(cap, c)) for c in range(4))
    metrics: list[list[Any]] = [[]] * len(METRICS)
    for j, pos in enumerate(_INT_METRIC_POS):
        metrics[pos] = [None if v == INT_NULL else v for v in column(q, _int_base(cap, 4 + j))]
    for j, pos in enumerate(_FLOAT_METRIC_POS):
        metrics[pos] = [None if v != v else v for v in column(d, _float_base(cap, j))]
    readings = list(zip(*metrics, strict=True))
    return list(zip(t_mono, t_wall, read_ns, dev, readings, strict=True))


def _child_options(backend: str, options: dict[str, Any]) -> tuple[dict[str, Any], str | None, bool]:
    """What the child passes to open_backend; for synthetic, how its activity crosses over:
    (options, shared-activity fallback or None, whether to observe the parent process)."""
    if backend != "synthetic":
        return options, None, False
    activity = options.pop("activity", "auto")
    if activity in ("marks", "auto"):
        return options, str(activity), True
    if activity == "cpu":
        return {**options, "activity": "cpu"}, None, True
    if isinstance(activity, (int, float)) and not isinstance(activity, bool):
        return {**options, "activity": float(activity)}, None, True
    raise ConfigError(
        f"synthetic activity={activity!r} cannot cross into the sampling process; use 'auto', 'marks', "
        "'cpu' or a number in [0, 1], or telemetry.sampler=thread"
    )


# -- the child's side -----------------------------------------------------------------------------

_CHILD_CODE = (
    "import time; t = time.monotonic_ns()\n"
    "from charllm_nemo.telemetry.sampler_process import child_main; child_main(t)"
)


class _RingWriter:
    """Writes rows into the ring, then publishes the write counter (the child's ``emit``)."""

    def __init__(self, q: memoryview, d: FloatView, cap: int) -> None:
        self.q, self.d, self.cap = q, d, cap
        self.n = 0
        self.bases = tuple(_int_base(cap, c) for c in range(4))
        self.ints = tuple((_int_base(cap, 4 + j), pos) for j, pos in enumerate(_INT_METRIC_POS))
        self.floats = tuple((_float_base(cap, j), pos) for j, pos in enumerate(_FLOAT_METRIC_POS))
        self.warned = False

    def emit(self, row: Row) -> None:
        t0, tw, dt, idx, reading = row
        q, d = self.q, self.d
        slot = self.n % self.cap
        b0, b1, b2, b3 = self.bases
        q[b0 + slot] = t0
        q[b1 + slot] = tw
        q[b2 + slot] = dt
        q[b3 + slot] = idx
        try:
            for base, pos in self.ints:
                v = reading[pos]
                q[base + slot] = INT_NULL if v is None else v
            for base, pos in self.floats:
                v = reading[pos]
                d[base + slot] = math.nan if v is None else v
        except (TypeError, ValueError, OverflowError):
            self._coerce(reading, slot)
        self.n += 1
        q[_H_WRITE_COUNT] = self.n  # publish only after the whole row is in place

    def _coerce(self, reading: tuple[Any, ...], slot: int) -> None:
        """A backend returned a value of the wrong type: convert what converts, null the rest."""
        for base, pos in self.ints:
            try:
                self.q[base + slot] = INT_NULL if reading[pos] is None else int(reading[pos])
            except (TypeError, ValueError, OverflowError):
                self.q[base + slot] = INT_NULL
                self._warn(pos, reading[pos])
        for base, pos in self.floats:
            try:
                self.d[base + slot] = math.nan if reading[pos] is None else float(reading[pos])
            except (TypeError, ValueError, OverflowError):
                self.d[base + slot] = math.nan
                self._warn(pos, reading[pos])

    def _warn(self, pos: int, value: Any) -> None:
        if not self.warned:
            self.warned = True
            name = METRICS[pos].name
            log.error("metric %s: value %r does not fit its column; recorded as null", name, value)


def _read_config(fd: int) -> dict[str, Any]:
    def exactly(n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            chunk = os.read(fd, n - got)
            if not chunk:
                raise EOFError("the training process closed the pipe before sending the configuration")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    (size,) = struct.unpack("<Q", exactly(8))
    config: dict[str, Any] = pickle.loads(exactly(size))
    return config


def child_main(t_main: int = 0) -> None:
    """Entry point of the sampling process (``sys.executable -c``); the config arrives on stdin.
    ``t_main``: CLOCK_MONOTONIC when the interpreter began running our code (before imports)."""
    t_main = t_main or time.monotonic_ns()
    # The job's Ctrl-C / SIGTERM goes to every process of the group: the parent decides when this
    # one stops (it flushes first), and this one stops on its own if the parent dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.WARNING, format="charllm-nemo sampling process %(process)d: %(levelname)s %(message)s"
    )
    # The parent opened the same backend and has already said everything about it.
    logging.getLogger("charllm_nemo.devices").setLevel(logging.ERROR)
    config = _read_config(0)
    mm = _attach(config["shm_name"])
    q = memoryview(mm).cast("q")
    d: FloatView = memoryview(mm).cast("d")
    q[_H_PID] = os.getpid()
    q[_H_T_MAIN] = t_main
    parent_gone = [False]
    state, reason = FAILED, "crashed"
    try:
        state, reason = _sample(config, q, d, parent_gone)
    except BaseException as exc:  # report it in the block, whatever it was
        reason = f"crashed: {exc!r}"
        log.exception("telemetry sampling process crashed")
    finally:
        msg = reason.encode("utf-8", "replace")[:_MSG_SIZE]
        mm[_MSG_OFFSET : _MSG_OFFSET + len(msg)] = msg
        q[_H_MSG_LEN] = len(msg)
        q[_H_STOP_CODE] = _STOP_CODES.get(reason.split(":", 1)[0], 3)
        q[_H_STATE] = state
        if parent_gone[0] or os.getppid() != config["parent_pid"]:
            _unlink(config["shm_name"])
        q.release()
        d.release()
        mm.close()


def _sample(config: dict[str, Any], q: memoryview, d: FloatView, parent_gone: list[bool]) -> tuple[int, str]:
    from charllm_nemo.devices.factory import open_backend

    q[_H_T_IMPORTED] = time.monotonic_ns()
    parent = int(config["parent_pid"])
    options = dict(config["options"])
    if config["observe_parent"]:
        options["observe_pid"] = parent
    if config["shared_activity"] is not None:
        from charllm_nemo.devices.synthetic import CpuActivity, SharedActivity

        fallback: Callable[[int], float] = (
            CpuActivity(parent).level if config["shared_activity"] == "auto" else (lambda _t: 0.0)
        )
        options["activity"] = SharedActivity(lambda: d[_D_ACTIVITY], fallback).level
    try:
        backend = open_backend(config["backend"], config["devices"], **options)
    except Exception as exc:
        log.error("cannot open backend %r: %s", config["backend"], exc)
        return FAILED, f"backend open failed: {exc}"
    q[_H_T_OPENED] = time.monotonic_ns()
    health = SamplerHealth(hz=float(config["hz"]))
    writer = _RingWriter(q, d, int(q[_H_CAPACITY]))
    stdin_readable = [False]

    def publish() -> None:
        for i, field in enumerate(_HEALTH_FIELDS):
            q[_H_HEALTH + i] = getattr(health, field)

    def should_stop() -> bool:
        publish()
        if q[_H_STOP] or stdin_readable[0]:
            if not q[_H_STOP]:
                parent_gone[0] = True  # EOF without a stop request: the parent died
            return True
        if os.getppid() != parent:
            parent_gone[0] = True
            return True
        return False

    def sleep(seconds: float) -> None:
        # Sleep on stdin: a stop (the parent closes it) or the parent's death (EOF) wakes us at once.
        readable, _, _ = select.select([0], [], [], seconds)
        if readable:
            stdin_readable[0] = True

    q[_H_STATE] = RUNNING
    try:
        run_sample_loop(backend.devices, round(1e9 / health.hz), health, writer.emit, should_stop, sleep)
    finally:
        publish()
        try:
            backend.close()
        except Exception:
            log.exception("backend close failed")
    if parent_gone[0]:
        log.warning("the training process is gone: sampling stopped")
        return STOPPED, "parent exited"
    return STOPPED, health.stop_reason or "stopped"
