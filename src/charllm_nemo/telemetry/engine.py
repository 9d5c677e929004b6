"""Where a session's sampling, storing and live figures run: the engine interface, and the
thread engine.

A :class:`~charllm_nemo.telemetry.session.TelemetrySession` holds one :class:`Engine`:

* :class:`ThreadEngine`: a sampler thread and a flusher thread in the training process; live
  figures computed on the caller's thread from the rows kept in memory;
* :class:`~charllm_nemo.telemetry.process.engine.ProcessEngine`: a telemetry process beside the
  rank samples, stores and computes figures; the training process writes window records into
  shared memory and reads figures back.

The session keeps what is the same for both (the device, the manifest, signals, the order of a
close); when the telemetry process is lost mid-run it replaces its engine with a thread engine
that goes on numbering the segments (a takeover is one assignment). Both engines compute a
window's figures with :func:`~charllm_nemo.telemetry.attribution.attribute_windows` over the same
slice of samples (:func:`live_slice_start`), so that live figures equal those computed later from
the run directory.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque
from collections.abc import Collection, Sequence
from typing import Any, Protocol, TypedDict

import numpy as np
import pyarrow as pa

from charllm_nemo.devices.base import Device
from charllm_nemo.telemetry.buffered import BufferedStore
from charllm_nemo.telemetry.sample_loop import health_counts
from charllm_nemo.telemetry.sampler import Row, Sampler, SamplerHealth, rows_to_arrays, rows_to_table
from charllm_nemo.telemetry.session_options import StoreOptions
from charllm_nemo.telemetry.store import Flusher, RankStore, records_to_table
from charllm_nemo.telemetry.windows import Record, WindowRecorder

log = logging.getLogger("charllm_nemo.telemetry")


def live_slice_start(t_begin_mono_ns: int, figures_period_ns: int) -> int:
    """Where the samples that a live figure of a window beginning at ``t_begin_mono_ns`` is
    computed from begin (ns): two periods of whole samples (counters read) before the window, so
    that every sample inside has its predecessor in the slice, counter ticks inside are found as
    in the stored run (the first sample of a slice is never a tick) and a window that begins
    after a sampling stall is still bracketed. The collector slices the same way."""
    return t_begin_mono_ns - 2 * figures_period_ns


class EngineClosed(TypedDict):
    """What an engine's ``close`` hands the session for the manifest: ``extra`` (manifest
    fields: sampler, flusher, store_process health), ``counts`` (the store's counts when another
    process wrote them, else None), ``recorded`` (windows recorded)."""

    extra: dict[str, Any]
    counts: dict[str, Any] | None
    recorded: int


class Engine(Protocol):
    """What a session needs of whatever samples, stores and computes its figures."""

    mode: str
    """``thread`` or ``process``: the manifest's ``sampler_mode``."""

    @property
    def sampler(self) -> Any:
        """The sampler object (:class:`Sampler` or ``ProcessSampler``): its health, pid."""
        ...

    @property
    def running(self) -> bool:
        """Whether it still samples."""
        ...

    @property
    def health(self) -> SamplerHealth:
        """How the sampling has gone so far."""
        ...

    def health_counts(self) -> tuple[float, float, float]:
        """What a rank sends of :attr:`health` each step (sample_loop ``health_counts``)."""
        ...

    @property
    def disk_full(self) -> bool:
        """Whether its store stopped writing on a full disk."""
        ...

    @property
    def pid(self) -> int | None:
        """The telemetry process's pid (None: it samples in this process)."""
        ...

    def start(self, windows: WindowRecorder) -> bool:
        """Start sampling and take the recorder's marks from now on; False when it could not
        start (the session then falls back to a thread engine)."""
        ...

    def detach(self) -> None:
        """Marks from now on stay in the recorder (before a fallback or a takeover)."""
        ...

    def lost(self, t_end_mono_ns: int) -> bool:
        """Whether it stopped mid-run and must be replaced (asked once a window ends)."""
        ...

    def stop_for_takeover(self) -> dict[str, Any]:
        """Stop, store what it still holds and return its store's counts (``segments``,
        ``rows``, ...), for the engine that goes on where it left off."""
        ...

    def request_figures(
        self, t_begin_mono_ns: int, t_end_mono_ns: int, figures: Collection[str] | None, batch: int
    ) -> None:
        """Ask ahead for a window's figures (``TelemetrySession.request_figures``)."""
        ...

    def figures(
        self, t_begin_mono_ns: int, t_end_mono_ns: int, wait_s: float, figures: Collection[str] | None
    ) -> list[dict[str, Any]] | None:
        """A window's figures per device, or None while not ready (``step_figures``)."""
        ...

    def live_rows(self, since_mono_ns: int, before: int) -> list[Row]:
        """Sampler rows still in memory from ``since_mono_ns``, and ``before`` rows before."""
        ...

    def flush(self) -> None:
        """Write what was sampled and marked since the last flush, where this process writes."""
        ...

    def close(self, windows: WindowRecorder, open_records: Sequence[Record]) -> EngineClosed:
        """Stop, store everything (``open_records``: windows still open, with a null end) and
        return what the manifest gets: ``extra`` (fields), ``counts`` (the store's counts when
        another process wrote them, else None) and ``recorded`` (windows recorded)."""
        ...


class ThreadEngine:
    """Sampling in a thread of this process, a flusher thread writing ``store``'s segments every
    ``storing.flush_interval_s``, and live figures computed here from the last
    ``storing.live_window_s`` seconds of rows (kept as the sampler's tuples: a live figure costs
    no Arrow round trip). ``earlier_windows``: windows stored by an engine this one took over
    from (counted at close). ``storing.driver_buffers``: drain the devices' driver sample buffers
    at every flush into ``buffered-NNNNNN.parquet`` (telemetry/buffered.py; devices without
    them: nothing)."""

    mode = "thread"

    def __init__(
        self,
        devices: Sequence[Device],
        hz: float,
        *,
        source: str,
        store: RankStore,
        storing: StoreOptions,
        figures_period_ns: int,
        counter_hz: float | None = None,
        earlier_windows: int = 0,
    ) -> None:
        self.devices = list(devices)
        self.buffered = BufferedStore(store.dir, self.devices) if storing.driver_buffers else None
        if self.buffered is not None and not self.buffered.devices:
            self.buffered = None
        self.hz = hz
        self.source = source
        self.store = store
        self.figures_period_ns = figures_period_ns
        self.earlier_windows = earlier_windows
        self._sampler = Sampler(self.devices, hz, source=source, counter_hz=counter_hz)
        self.flusher = Flusher(self.flush, storing.flush_interval_s)
        self._windows: WindowRecorder | None = None
        n_dev = max(1, len(self.devices))
        self._recent: deque[Row] = deque(maxlen=max(1024, int(storing.live_window_s * hz * n_dev)))
        self._recent_lock = threading.Lock()
        self._pending: list[tuple[str, pa.Table]] = []

    @property
    def sampler(self) -> Sampler:
        return self._sampler

    @property
    def running(self) -> bool:
        return self._sampler.running

    @property
    def health(self) -> SamplerHealth:
        return self._sampler.health

    def health_counts(self) -> tuple[float, float, float]:
        return health_counts(self._sampler.health)

    @property
    def disk_full(self) -> bool:
        return self.store.disk_full

    @property
    def pid(self) -> int | None:
        return None

    def start(self, windows: WindowRecorder) -> bool:
        self._windows = windows
        self._sampler.start()
        self.flusher.start()
        return True

    def detach(self) -> None:
        """Nothing: the marks stay in the recorder, where this engine takes them."""

    def lost(self, t_end_mono_ns: int) -> bool:
        """Never: a thread that stops (no device left) leaves the store going, as it is."""
        return False

    def stop_for_takeover(self) -> dict[str, Any]:
        self._sampler.stop()
        self.flusher.stop()
        self.flusher.flush_once()
        return self.store.segments.counts()

    def flush(self) -> None:
        """Write what was sampled and marked since the last flush (the flusher calls this)."""
        # Taken and remembered under one lock: live_rows() never sees a row in neither place.
        with self._recent_lock:
            rows = self._sampler.take_rows()
            self._recent.extend(rows)
        if rows:
            self._pending.append(("samples", rows_to_table(rows, self.source)))
        windows = self._windows
        done = windows.drain_records() if windows is not None else []
        if done and windows is not None:
            self._pending.append(("windows", records_to_table(done, windows.names.names)))
        while self._pending:
            kind, table = self._pending[0]
            # An error (not a full disk: the writer drops from then on) keeps it for the next try.
            self.store.write_segment(kind, table)
            self._pending.pop(0)
        if self.buffered is not None:
            self.buffered.flush()

    def live_rows(self, since_mono_ns: int = 0, before: int = 0) -> list[Row]:
        with self._recent_lock:
            rows = list(self._recent) + self._sampler.peek_rows()
        first = bisect.bisect_left(rows, since_mono_ns, key=lambda r: r[0])
        return rows[max(0, first - before) :]

    def request_figures(
        self, t_begin_mono_ns: int, t_end_mono_ns: int, figures: Collection[str] | None, batch: int
    ) -> None:
        """Nothing to ask ahead: figures are computed when read."""

    def figures(
        self, t_begin_mono_ns: int, t_end_mono_ns: int, wait_s: float, figures: Collection[str] | None
    ) -> list[dict[str, Any]] | None:
        """Only the ``figures`` wanted (None = all) are computed, on this thread."""
        from charllm_nemo.telemetry.attribution import attribute_windows

        deadline = time.monotonic() + wait_s
        while self._sampler.last_t_mono_ns < t_end_mono_ns:
            if not self._sampler.running or time.monotonic() >= deadline:
                if self._sampler.running:
                    return None
                break
            time.sleep(min(0.002, 1.0 / self.hz))
        since = live_slice_start(t_begin_mono_ns, self.figures_period_ns)
        # One slot (a row per device) more before the slice, as the collector keeps.
        arrays = rows_to_arrays(self.live_rows(since, before=len(self.devices)))
        out = []
        win = {
            "t_begin_mono_ns": np.array([t_begin_mono_ns], np.int64),
            "t_end_mono_ns": np.array([t_end_mono_ns], np.int64),
        }
        for dev in self.devices:
            idx = dev.identity.index
            mask = arrays["device_index"] == idx
            per_dev = {k: v[mask] for k, v in arrays.items()}
            result = attribute_windows(per_dev, win, figures=figures)
            row = {k: (v[0].item() if hasattr(v[0], "item") else v[0]) for k, v in result.items()}
            row["device_index"] = idx
            out.append(row)
        return out

    def close(self, windows: WindowRecorder, open_records: Sequence[Record]) -> EngineClosed:
        self._sampler.stop()
        self.flusher.stop()
        self.flusher.flush_once()
        if open_records:
            try:  # a full disk: the manifest must still be written, the backend closed
                self.store.write_segment("windows", records_to_table(list(open_records), windows.names.names))
            except Exception:
                self.flusher.errors += 1
                log.exception("could not store the %d window(s) open at close", len(open_records))
        extra = {
            "flusher": {
                "flushes": self.flusher.flushes,
                "errors": self.flusher.errors,
                "flush_ms_max": self.flusher.flush_ns_max / 1e6,
                "interval_s": self.flusher.interval_s,
                "where": "training process",
            },
        }
        if self.buffered is not None:
            extra["driver_buffers"] = self.buffered.counts()
        return EngineClosed(extra=extra, counts=None, recorded=windows.total_recorded + self.earlier_windows)
