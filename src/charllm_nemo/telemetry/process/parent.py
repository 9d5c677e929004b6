"""Telemetry in a separate process: the training process's handle on it (``telemetry.sampler``).

Why a process. A thread sampler shares the GIL with the training thread: each sample and each
flush makes the training thread wait for the GIL, and when that thread runs Python the sampler
waits up to the switch interval (5 ms), five periods at 1 kHz. bench/bench_sampler.py part b
measures it (docs/benchmarks.md): with a core free the thread meets ~55 % of its deadlines at
1 kHz where the telemetry process meets 98.7-99.4 % (with its collector storing beside the
sampling loop; 99.4-99.9 % without); bench/bench_train_telemetry.py measures what training
pays. So a session samples, stores and computes its live figures in a **telemetry process**
(telemetry/process/child.py), and the training process only writes window records into
shared memory and reads figures back (``telemetry.sampler=auto`` or ``process``; ``thread``
keeps everything in the training process).

:class:`ProcessSampler` is the process engine's handle (telemetry/process/engine.py): ``start``,
``stop``, ``health`` as a :class:`~charllm_nemo.telemetry.sampler.Sampler` has them; the
telemetry process writes the rank's segments itself (``store``), and this class adds the mark
ring (:attr:`ProcessSampler.marks`, the WindowRecorder's sink), figure requests, the store's
counts and a copy of what the sample ring holds for live figures (:meth:`ProcessSampler.peek_rows`).
There is no mode without a store: the rows never come back to the training process but for
live figures (a bare mode that handed them over was used only by tests and a benchmark, and was
removed; docs/architecture.md).
The shared block's layout and ordering rules are in telemetry/process/ring.py. CLOCK_MONOTONIC is
system-wide, so the child's timestamps join with the parent's window marks as a thread's do.

Start: a fresh interpreter (``sys.executable -c ...``: fork + exec, never a bare fork, which is
unsafe once CUDA or torch threads exist). Not ``multiprocessing``'s spawn context: it re-imports
the parent's ``__main__`` module in the child, and a training script's ``import torch`` would
run there. The child imports the package's light modules and the backend's library before it
samples (no torch), then numpy, pyarrow and a warm-up of the Parquet writer for its collector
(telemetry/process/child.py); ``ProcessSampler.startup`` has the parts of the start-up, until it
samples (docs/benchmarks.md, part b, has the figures).

Lifetime: see telemetry/process/child.py. The parent unlinks the block on ``stop()`` and at
exit, also when the child crashed; a child whose parent died unlinks it itself. Only when both
die by SIGKILL (a cgroup kill) can a block stay in /dev/shm (``charllm-sampler-<parent
pid>-<hex>``); the next sampling process this user starts on the node removes it
(``shm.sweep_stale``). ``multiprocessing.shared_memory.SharedMemory`` is not used because on
Python < 3.13 it registers every block with a resource-tracker process (one more process per
rank, and in a child that attaches, a tracker of its own that unlinks the block when the child
exits); at a parent's SIGKILL that tracker's clean-up races the child's and prints warnings.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import math
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from charllm_nemo.devices.factory import process_plan
from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.process import mark_ring
from charllm_nemo.telemetry.process import ring as shm
from charllm_nemo.telemetry.process.mark_ring import MarkWriter
from charllm_nemo.telemetry.process.ring import (
    D_ACTIVITY,
    D_EXPORT_RATES,
    FAILED,
    H_STATE,
    H_STOP,
    H_SVC_STATE,
    H_T_IMPORTED,
    H_T_MAIN,
    H_T_OPENED,
    H_T_SPAWNED,
    HEALTH_FIELDS,
    RUNNING,
    STARTING,
    STOPPED,
    SVC_DONE,
    Block,
    Layout,
)
from charllm_nemo.telemetry.sample_loop import (
    DEFAULT_COUNTER_HZ,
    DEFAULT_HZ,
    Row,
    SamplerHealth,
    counter_every,
    health_counts,
    validate_hz,
)
from charllm_nemo.telemetry.schema import METRICS
from charllm_nemo.telemetry.session_options import ProcessOptions

_H_DEADLINES_MISSED = shm.H_HEALTH + shm.HEALTH_FIELDS.index("deadlines_missed")
_H_DEVICES_LOST = shm.H_HEALTH + shm.HEALTH_FIELDS.index("devices_lost")
_N_NULLS = len(METRICS)  # one null count per schema metric (SamplerHealth.nulls)

log = logging.getLogger("charllm_nemo.sampler")

RING_SECONDS = 16.0  # ring capacity in seconds of rows at the configured rate (at least MIN_CAPACITY)
MIN_CAPACITY = 4096
MARK_CAPACITY = 16384  # window records in flight (~40 s of a Megatron-Core loop's marks at 400 / s)
FIGURE_SLOTS = 64  # figure requests answered and not yet read


class ProcessSampler:
    """Samples and stores in a separate process at ``hz`` (the telemetry process).

    ``backend``, ``devices`` (host indices, None = all) and ``backend_options`` are what the
    child passes to :func:`~charllm_nemo.devices.factory.open_backend`; the options must be
    picklable. For ``synthetic``, activity ``marks`` / ``auto`` follows the level set through
    :meth:`activity_publisher` (the session hands it to the device's mark listener, which calls
    it whenever a window mark changes the level; ``auto`` = the training process's CPU use until
    the first mark) and ``cpu`` is the training process's CPU use. ``capacity``: ring rows
    (default: 16 s at ``hz`` for every device, at least 4096). ``store`` (required): ``rank_dir``,
    ``flush_interval_s`` (s), ``live_window_s`` (s): the child writes that rank's segments and
    answers figure requests (see the module doc). ``process``: the child's nice value and its
    collector thread's policy, ``idle`` or ``normal`` (``auto`` is resolved by
    :func:`resolve_collector_sched` first); None: the defaults (telemetry/session_options.py
    ``ProcessOptions``). ``counter_hz``: as for :class:`~charllm_nemo.telemetry.sampler.Sampler`.
    """

    mode = "process"

    def __init__(
        self,
        backend: str,
        devices: Sequence[int] | None = None,
        backend_options: dict[str, Any] | None = None,
        hz: float = DEFAULT_HZ,
        *,
        capacity: int | None = None,
        store: dict[str, Any],
        process: ProcessOptions | None = None,
        counter_hz: float | None = DEFAULT_COUNTER_HZ,
    ) -> None:
        self.hz = validate_hz(hz)
        self.counter_every = counter_every(self.hz, counter_hz)
        settings = ProcessOptions() if process is None else process
        if settings.collector_sched == "auto":
            raise ConfigError("ProcessSampler takes collector_sched idle or normal; resolve auto first")
        self.nice = settings.nice
        self.collector_sched = settings.collector_sched
        self.period_ns = round(1e9 / self.hz)
        self.source = backend
        self.backend_name = backend
        self.devices = None if devices is None else [int(i) for i in devices]
        n_dev = len(self.devices) if self.devices is not None else 8
        capacity = capacity or max(MIN_CAPACITY, math.ceil(RING_SECONDS * self.hz * max(1, n_dev)))
        if capacity < 2:
            raise ConfigError(f"ProcessSampler capacity={capacity} must be >= 2 rows")
        missing = {"rank_dir", "flush_interval_s", "live_window_s"} - set(store)
        if missing:
            raise ConfigError(f"ProcessSampler store lacks {sorted(missing)}; pass every one of them")
        self.store = {**store, "rank_dir": str(store["rank_dir"]), "source": self.source}
        self.layout = Layout(
            capacity,
            mark_capacity=MARK_CAPACITY,
            fig_slots=FIGURE_SLOTS,
            n_devices=max(1, n_dev),
            n_fig_columns=len(mark_ring.figure_columns()),
        )
        self.capacity = capacity
        plan = process_plan(backend, dict(backend_options or {}))
        self._options, self._shared_activity, self._observe_parent = (
            plan.options,
            plan.shared_activity,
            plan.observe_parent,
        )
        try:
            pickle.dumps(self._options)
        except Exception as exc:
            raise ConfigError(
                f"backend options {sorted(self._options)} cannot be sent to the sampling process ({exc}); "
                "use picklable options or telemetry.sampler=thread"
            ) from None
        self._lock = threading.RLock()
        self._block: Block | None = None
        self._name: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.marks: MarkWriter | None = None
        # The record codes' strings (the session's WindowRecorder name table), for a salvage.
        self.names: list[str] | None = None
        self._startup_ns = 0
        self._stopped = False
        self._final: SamplerHealth | None = None
        self._final_store: dict[str, Any] | None = None
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
        stale = shm.sweep_stale()
        if stale:
            log.warning(
                "telemetry: removed %d shared-memory block(s) of runs killed with SIGKILL: %s",
                len(stale),
                ", ".join(stale),
            )
        name = shm.block_name(os.getpid())
        try:
            block = shm.create(name, self.layout)  # zero-filled: state STARTING, counters 0
        except OSError as exc:
            log.error("telemetry: no shared memory for the sampling process (%s); training goes on", exc)
            self._start_error = f"no shared memory for the sampling process: {exc}"
            self._stopped = True
            return
        self._block, self._name = block, name
        self.marks = MarkWriter(block)
        config = {
            "shm_name": name,
            "layout": asdict(self.layout),
            "backend": self.backend_name,
            "devices": self.devices,
            "options": self._options,
            "shared_activity": self._shared_activity,
            "observe_parent": self._observe_parent,
            "hz": self.hz,
            "counter_every": self.counter_every,
            "parent_pid": os.getpid(),
            "store": self.store,
            "nice": self.nice,
            "collector_sched": self.collector_sched,
        }
        payload = pickle.dumps(config)
        env = dict(os.environ)
        # The child must import this very package, wherever the parent found it.
        root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        q = block.q
        q[H_T_SPAWNED] = time.monotonic_ns()
        try:
            from charllm_nemo.telemetry.process import child as telemetry_process

            env |= telemetry_process.arrow_pool_env(env)
            self._proc = subprocess.Popen(
                [sys.executable, "-c", telemetry_process.CHILD_CODE],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                env=env,
                close_fds=True,
            )
            assert self._proc.stdin is not None
            self._proc.stdin.write(len(payload).to_bytes(8, "little") + payload)
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
        while q[H_STATE] == STARTING and self._proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        self._startup_ns = time.monotonic_ns() - t0
        state = q[H_STATE]
        self.startup = {
            "total_s": self._startup_ns / 1e9,
            "spawn_s": _span(q[H_T_SPAWNED], q[H_T_MAIN]),  # fork + exec + interpreter start
            "import_s": _span(q[H_T_MAIN], q[H_T_IMPORTED]),  # this package + the backend factory
            "open_s": _span(q[H_T_IMPORTED], q[H_T_OPENED]),
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

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop the child (within ``timeout_s`` s, then SIGKILL; default 30 s: it flushes last),
        keep its health and :meth:`store_counts`, salvage what it did not store, and unlink the
        block. Idempotent. A no-op in a process forked from the one that started it
        (its atexit must not stop the parent's sampler)."""
        if self._owner_pid and os.getpid() != self._owner_pid:
            return
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if timeout_s is None:
            timeout_s = 30.0
        proc, block = self._proc, self._block
        if block is not None:
            block.q[H_STOP] = 1
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
            if self._block is not None:
                self._final = self._snapshot()
                self._final_store = self._store_counts_locked()
                q = self._block.q
                # Records marked after the telemetry process's last take (it finished early) are
                # the user's windows too: stored here, never dropped uncounted.
                left = q[shm.H_MARK_WRITE] > q[shm.H_MARKS_FLUSHED]
                if not self._final_store["done"] or left:
                    self._salvage()
            self._release()
        atexit.unregister(self._atexit)

    def _salvage(self) -> None:
        """The telemetry process died or could not store: write what the rings still hold that
        it had not written (the last 16 s of samples at most, every window record not yet
        stored), from this process, numbering segments on from where it stopped."""
        assert self._block is not None and self._final_store is not None
        names = self.names
        if names is None:
            return
        try:
            from charllm_nemo.telemetry.process.collector import salvage

            counts = salvage(self._block, Path(self.store["rank_dir"]), source=self.source, names=names)
        except Exception:
            log.exception("telemetry: salvaging what the telemetry process left failed")
            return
        finished = bool(self._final_store["done"])
        self._final_store.update(counts)
        self._final_store["salvaged"] = True
        if finished:  # it finished, and windows were marked after its last take
            log.warning("telemetry: stored the window records marked after the telemetry process stopped")
            return
        log.warning(
            "telemetry process did not finish its store (%s); the training process wrote what the "
            "shared rings still held",
            self._final.stop_reason if self._final is not None else "?",
        )

    def _atexit(self) -> None:
        self.stop(10.0)

    def _release(self) -> None:
        block, self._block = self._block, None
        self.marks = None
        if block is not None:
            block.close()
        if self._name is not None:
            shm.unlink(self._name)  # a no-op if the child unlinked it already
            self._name = None

    @property
    def running(self) -> bool:
        proc, block = self._proc, self._block
        if proc is None or block is None or self._stopped or proc.poll() is not None:
            return False
        try:
            return block.q[H_STATE] in (STARTING, RUNNING)
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

    # -- the training process's side of a modelled device's activity --------------------------
    def activity_publisher(self) -> Callable[[float], object]:
        """What the backend's ActivityInput ``on_change`` gets (devices/base.py): it sets the
        activity level the devices in the child read (devices/factory.py's ``open_in_process``:
        the block's float view's ``__setitem__`` bound to that word). Once the block is released
        (stop) it raises ValueError, and the input stops publishing."""
        block = self._block
        if block is None:
            raise RuntimeError("activity_publisher() before start() or after stop()")
        return functools.partial(block.d.__setitem__, D_ACTIVITY)

    def publish_rates(self, tokens_per_step: float, flops_per_step: float, peak_flops: float) -> None:
        """The live exporter's constants (ring.D_EXPORT_RATES), written once; no-op when stopped."""
        with self._lock:
            if self._block is not None:
                d = self._block.d
                d[D_EXPORT_RATES], d[D_EXPORT_RATES + 1], d[D_EXPORT_RATES + 2] = (
                    float(tokens_per_step),
                    float(flops_per_step),
                    float(peak_flops),
                )

    # -- live figures -----------------------------------------------------------------------
    def read_figures(self, seq: int) -> tuple[int, int, list[tuple[int, list[float]]]] | None:
        """The answer to figure request ``seq`` (see mark_ring.read_figures), or None."""
        block = self._block
        if block is None:
            return None
        try:
            return mark_ring.read_figures(block, seq)
        except ValueError:  # released by a concurrent stop()
            return None

    # -- the store's counts -------------------------------------------------------------------
    def store_counts(self) -> dict[str, Any]:
        """The telemetry process's store as of now (after stop: as it left it): segments, rows,
        bytes, flushes, whether it finished (``done``) and what it could not do."""
        with self._lock:
            if self._final_store is not None:
                return self._final_store
            return self._store_counts_locked()

    def _store_counts_locked(self) -> dict[str, Any]:
        block = self._block
        if block is None:
            return {}
        q = block.q
        return {
            "segments": {"samples": q[shm.H_SEG_SAMPLES], "windows": q[shm.H_SEG_WINDOWS]},
            "rows": {"samples": q[shm.H_ROWS_SAMPLES], "windows": q[shm.H_ROWS_WINDOWS]},
            "bytes_written": q[shm.H_BYTES],
            "flushes": q[shm.H_FLUSHES],
            "flush_errors": q[shm.H_FLUSH_ERRORS],
            "flush_ms_max": q[shm.H_FLUSH_NS_MAX] / 1e6,
            "figures_served": q[shm.H_FIGURES_SERVED],
            "rows_lost": q[shm.H_ROWS_LOST],
            "marks_dropped": q[shm.H_MARKS_DROPPED],
            "done": q[H_SVC_STATE] == SVC_DONE,
            "state": q[H_SVC_STATE],
            **self._disk_full_counts(q),
        }

    @staticmethod
    def _disk_full_counts(q: Any) -> dict[str, Any]:
        """``disk_full`` and ``rows_unwritten``, only once the store hit a full disk."""
        if not q[shm.H_DISK_FULL]:
            return {}
        unwritten = {"samples": q[shm.H_ROWS_UNWRITTEN_SAMPLES], "windows": q[shm.H_ROWS_UNWRITTEN_WINDOWS]}
        return {"disk_full": True, "rows_unwritten": unwritten}

    @property
    def disk_full(self) -> bool:
        """Whether the telemetry process's store hit a full disk and stopped writing (a read of
        the shared block)."""
        block = self._block
        if block is None:
            return bool(self._final_store and self._final_store.get("disk_full"))
        return bool(block.q[shm.H_DISK_FULL])

    # -- the sample ring, for live figures ---------------------------------------------------
    def peek_rows(self) -> list[Row]:
        """A copy of the rows the sample ring holds now (up to its capacity, the oldest first;
        empty after stop); the telemetry process's collector takes them as before."""
        with self._lock:
            if self._block is None:
                return []
            return self._read()

    @property
    def health(self) -> SamplerHealth:
        """The child's counters as of now (a fresh snapshot), plus rows lost and start-up time."""
        with self._lock:
            if self._final is not None:
                return self._final
            return self._snapshot()

    def health_counts(self) -> tuple[float, float, float]:
        """:func:`~charllm_nemo.telemetry.sample_loop.health_counts` of :attr:`health`, read
        straight from the block (a rank sends them every step: no SamplerHealth is made)."""
        with self._lock:
            block = self._block
            if self._final is not None or block is None or self._start_error is not None:
                return health_counts(self._final if self._final is not None else self._snapshot())
            q = block.q
            nulls = q[shm.H_NULLS0 : shm.H_NULLS0 + _N_NULLS]
            stopped = (
                q[_H_DEVICES_LOST]
                or q[H_STATE] in (STOPPED, FAILED)
                or (self._proc is not None and self._proc.poll() is not None)
            )
            return float(q[_H_DEADLINES_MISSED]), float(sum(nulls)), 1.0 if stopped else 0.0

    def _snapshot(self) -> SamplerHealth:
        h = SamplerHealth(hz=self.hz, startup_ns=self._startup_ns)
        block = self._block
        if block is None:
            h.stop_reason = self._start_error
            return h
        q = block.q
        for i, field in enumerate(HEALTH_FIELDS):
            setattr(h, field, q[shm.H_HEALTH + i])
        h.counter_every = max(1, h.counter_every)  # 0 until the child's loop has begun
        h.nulls = [q[shm.H_NULLS0 + i] for i in range(len(h.nulls))]
        h.rows_lost = q[shm.H_ROWS_LOST]  # rows the collector was lapped by, never stored
        state = q[H_STATE]
        if state in (STOPPED, FAILED):
            h.stop_reason = block.message()
        elif self._proc is not None and self._proc.poll() is not None:
            h.errors += 1
            h.stop_reason = f"sampling process exited unexpectedly (exit code {self._proc.returncode})"
        if self._start_error is not None:
            h.stop_reason = self._start_error
        return h

    def _read(self) -> list[Row]:
        """The rows in the ring now, oldest first (called under the lock)."""
        block = self._block
        assert block is not None
        first, end, _ = shm.ring_span(block, 0)
        rows, ok = shm.copy_rows(block, first, end)
        keep = shm.still_valid(block, first, len(rows))
        lapped = len(rows) - keep  # overwritten while copied: the oldest
        # Rows whose check word does not match are not visible whole yet (the newest, on a weakly
        # ordered CPU): this read stops before the first, the next one will have it.
        whole = next((k for k in range(lapped, len(rows)) if not ok[k]), len(rows))
        return rows[lapped:whole]


def _span(a: int, b: int) -> float:
    return (b - a) / 1e9 if a and b else math.nan
