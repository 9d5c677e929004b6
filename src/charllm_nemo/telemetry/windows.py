"""Window marks: the training loop says when steps, microbatches and phases begin and end.

A window is ``(kind, name, step, microbatch, t_begin_mono_ns, t_end_mono_ns, labels)``.
``kind`` is ``step``, ``microbatch`` or ``phase``; a phase's ``name`` is ``forward``,
``backward``, ``optimizer`` or any free-form name (``pp-send``, ``grad-sync``, ...).

Marks are cheap, because they run on the training thread (~15 windows per step in a
Megatron-Core loop): ``begin`` takes a clock reading and keeps a small list; ``end`` turns it
into one **record**, a flat tuple of ints (:data:`RECORD_FIELDS`: strings as codes of the
recorder's name table, :data:`NULL` for null), and hands it to the recorder's sink. The default
sink keeps records in a list that the session's flusher drains; a session whose telemetry runs
in its own process installs a sink that writes the record into shared memory, and that process
stores it (telemetry/process/child.py). Either way records become the windows table with
one vectorised conversion (:func:`charllm_nemo.telemetry.store.records_to_table`). The trainer's
StepMarker does less still per mark: it logs a step's marks and makes (or, given a
:attr:`WindowRecorder.log_sink`, has the telemetry process make) the step's records at step end
(telemetry/steplog.py).

Timestamps are CLOCK_MONOTONIC ns, the same clock the sampler stamps samples with, so the two
join on one machine whichever thread or process made them. A loop that times with CUDA events
resolves them at step end and hands explicit timestamps to :meth:`WindowRecorder.record`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.schema import WINDOW_KINDS, WINDOW_LABELS

WINDOW_COLUMNS: tuple[str, ...] = (
    "window_id",
    "parent_id",
    "kind",
    "name",
    "step",
    "microbatch",
    "t_begin_mono_ns",
    "t_end_mono_ns",
    "t_begin_wall_ns",
    "timing",
    *WINDOW_LABELS,
)
"""Columns of the windows table (docs/store.md)."""

NULL = -(2**63)
"""Null in a record (every record field is an int64)."""

RECORD_WINDOW, RECORD_FIGURES, RECORD_STEP_LOG = 0, 1, 2
"""Record types: a window, a request for a window's live figures, a step's raw marks
(telemetry/steplog.py; these two only in the mark ring to a telemetry process)."""

SEEDED_NAMES: tuple[str, ...] = (*WINDOW_KINDS, "host", "cuda_event", "forward", "backward", "optimizer")
"""The first codes of every :class:`NameTable`, in order: the same in every process, so a reader
of records recognises them without the table."""

RECORD_FIELDS: tuple[str, ...] = ("record_type", *WINDOW_COLUMNS)
"""A record: the record type, then WINDOW_COLUMNS with ``kind``, ``name`` and ``timing`` as
codes of the recorder's :class:`NameTable`."""
RECORD_LEN = len(RECORD_FIELDS)
STRING_FIELDS: tuple[str, ...] = ("kind", "name", "timing")

Record = tuple[int, ...]

WALL_REFRESH_NS = 1_000_000_000
"""How often a recorder re-reads the wall clock's offset from CLOCK_MONOTONIC (``t_begin_wall_ns``
is for humans; it follows NTP slewing to within this interval)."""


class NameTable:
    """Strings of window records (kinds, names, timings) as small int codes, in first-seen order.
    ``on_new(code, text)`` is called once per new string, before any record uses its code."""

    def __init__(self, on_new: Callable[[int, str], None] | None = None) -> None:
        self.codes: dict[str, int] = {}
        self.names: list[str] = []
        self._lock = threading.Lock()
        self._on_new = on_new
        for s in SEEDED_NAMES:
            self.code(s)

    def code(self, text: str) -> int:
        c = self.codes.get(text)
        if c is not None:
            return c
        with self._lock:
            c = self.codes.get(text)
            if c is None:
                c = len(self.names)
                if self._on_new is not None:
                    self._on_new(c, text)
                self.names.append(text)
                self.codes[text] = c
        return c

    def set_on_new(self, on_new: Callable[[int, str], None]) -> None:
        """Install the publisher of new names and publish the ones known so far."""
        with self._lock:
            for c, text in enumerate(self.names):
                on_new(c, text)
            self._on_new = on_new


def decode_record(rec: Sequence[int], names: Sequence[str]) -> dict[str, Any]:
    """A record as a row dict keyed by WINDOW_COLUMNS (codes back to strings, NULL to None)."""
    row: dict[str, Any] = {}
    for field, v in zip(RECORD_FIELDS[1:], rec[1:], strict=True):
        if field in STRING_FIELDS:
            row[field] = names[v]
        else:
            row[field] = None if v == NULL else v
    return row


class WindowRecorder:
    """Collects window marks for one rank. Thread-safe; cheap enough to call per microbatch.

    ``labels`` (pp_stage, tp_rank, dp_rank, ep_rank, cp_rank, vpp_chunk) are set once with
    :meth:`set_labels` and copied into every window; a window may override them.
    """

    def __init__(self) -> None:
        self._next_id = 0  # window ids, taken under the lock
        self._lock = threading.Lock()
        self._open: dict[int, list[Any]] = {}
        self._stack: list[int] = []
        self._done: list[Record] = []
        self._sink: Callable[[Sequence[Record]], None] = self._done.extend
        self.log_sink: Callable[..., None] | None = None
        """Where a StepMarker sends a step's raw log (telemetry/steplog.py) instead of making its
        windows here: the telemetry process's mark ring (set by the session in process mode)."""
        self.steps_shipped = 0
        self.names = NameTable()
        self._labels: dict[str, int | None] = dict.fromkeys(WINDOW_LABELS)
        self._label_values: tuple[int, ...] = (NULL,) * len(WINDOW_LABELS)
        self._listeners: list[Any] = []
        self._pending_sources: list[Callable[[], None]] = []
        self._host = self.names.code("host")
        self.total_recorded = 0
        self._wall_offset = 0  # time_ns() - monotonic_ns(), refreshed every WALL_REFRESH_NS
        self._wall_at = -WALL_REFRESH_NS

    def _wall(self, t_mono: int) -> int:
        """Wall-clock ns of a CLOCK_MONOTONIC time (one clock read a second, not one a mark)."""
        if t_mono - self._wall_at >= WALL_REFRESH_NS:
            self._wall_at = time.monotonic_ns()
            self._wall_offset = time.time_ns() - self._wall_at
        return t_mono + self._wall_offset

    # -- configuration ---------------------------------------------------------------------
    def set_labels(self, **labels: int | None) -> None:
        unknown = set(labels) - set(WINDOW_LABELS)
        if unknown:
            raise ConfigError(f"unknown window label(s) {sorted(unknown)}; use {', '.join(WINDOW_LABELS)}")
        self._labels.update(labels)
        self._label_values = tuple(NULL if v is None else int(v) for v in self._labels.values())

    def add_listener(self, fn: Any) -> None:
        """``fn(kind, name, is_begin)`` is called on every begin/end (the synthetic device uses
        this to follow the training phases). It must be cheap and must not raise."""
        self._listeners.append(fn)

    @property
    def listeners(self) -> list[Any]:
        """The listeners (the live list: read it, add with :meth:`add_listener`)."""
        return self._listeners

    def notify(self, kind: str, name: str, is_begin: bool) -> None:
        """Tell the listeners of a begin / end that is not (yet) a window here: a marker that
        records its windows later (train/marks.py) calls this as its marks happen."""
        for fn in self._listeners:
            fn(kind, name, is_begin)

    def add_pending_source(self, flush: Callable[[], None]) -> None:
        """``flush()`` hands this recorder the windows someone holds back (a StepMarker records
        a step's windows at step end); :meth:`flush_pending` calls it, e.g. at session close."""
        self._pending_sources.append(flush)

    def flush_pending(self) -> None:
        """Have every pending source (:meth:`add_pending_source`) record what it holds."""
        for flush in self._pending_sources:
            flush()

    def set_sink(self, sink: Callable[[Sequence[Record]], None]) -> None:
        """Send finished records to ``sink`` (a sequence of records per call, in order) instead of
        the recorder's own list (records already in the list are passed on first)."""
        with self._lock:
            if self._done:
                sink(self._done[:])
            self._done.clear()
            self._sink = sink

    def reset_sink(self) -> None:
        """Keep records in the recorder's own list again (:meth:`drain` takes them)."""
        with self._lock:
            self._sink = self._done.extend

    def _labels_with(self, labels: dict[str, int | None]) -> tuple[int, ...]:
        if not labels:
            return self._label_values
        unknown = set(labels) - set(WINDOW_LABELS)
        if unknown:
            raise ConfigError(f"unknown window label(s) {sorted(unknown)}; use {', '.join(WINDOW_LABELS)}")
        merged = {**self._labels, **labels}
        return tuple(NULL if merged[k] is None else int(merged[k]) for k in WINDOW_LABELS)  # type: ignore[arg-type]

    # -- marks -----------------------------------------------------------------------------
    def begin(
        self,
        kind: str,
        name: str | None = None,
        *,
        step: int | None = None,
        microbatch: int | None = None,
        t_mono_ns: int | None = None,
        **labels: int | None,
    ) -> int:
        """Open a window; returns its id for :meth:`end`."""
        if kind not in WINDOW_KINDS:
            raise ConfigError(f"window kind {kind!r} is not one of {', '.join(WINDOW_KINDS)}")
        t = time.monotonic_ns() if t_mono_ns is None else t_mono_ns
        wall = self._wall(t)
        name = name or kind
        with self._lock:
            wid = self._next_id
            self._next_id += 1
            parent = self._stack[-1] if self._stack else NULL
            self._open[wid] = [kind, name, step, microbatch, t, wall, parent, self._labels_with(labels)]
            self._stack.append(wid)
        for fn in self._listeners:
            fn(kind, name, True)
        return wid

    def end(self, window_id: int, *, t_mono_ns: int | None = None) -> None:
        """Close a window opened by :meth:`begin`. Ending an unknown id is ignored."""
        t = time.monotonic_ns() if t_mono_ns is None else t_mono_ns
        with self._lock:
            entry = self._open.pop(window_id, None)
            if entry is None:
                return
            if self._stack and self._stack[-1] == window_id:
                self._stack.pop()
            elif window_id in self._stack:
                self._stack.remove(window_id)
            self._sink((self._record(window_id, entry, t),))
            self.total_recorded += 1
        for fn in self._listeners:
            fn(entry[0], entry[1], False)

    def _record(self, wid: int, entry: list[Any], t_end: int) -> Record:
        kind, name, step, mb, t0, wall, parent, labels = entry
        code = self.names.code
        return (
            RECORD_WINDOW,
            wid,
            parent,
            code(kind),
            code(name),
            NULL if step is None else step,
            NULL if mb is None else mb,
            t0,
            t_end,
            wall,
            self._host,
            *labels,
        )

    @contextmanager
    def window(self, kind: str, name: str | None = None, **kw: Any) -> Iterator[int]:
        wid = self.begin(kind, name, **kw)
        try:
            yield wid
        finally:
            self.end(wid)

    def record(
        self,
        kind: str,
        name: str | None,
        t_begin_mono_ns: int,
        t_end_mono_ns: int,
        *,
        step: int | None = None,
        microbatch: int | None = None,
        timing: str = "cuda_event",
        parent_id: int | None = None,
        **labels: int | None,
    ) -> int:
        """Add a finished window with explicit timestamps (e.g. resolved from CUDA events)."""
        if kind not in WINDOW_KINDS:
            raise ConfigError(f"window kind {kind!r} is not one of {', '.join(WINDOW_KINDS)}")
        wall = self._wall(int(t_begin_mono_ns))
        code = self.names.code
        wid = self.reserve_ids(1)
        rec = (
            RECORD_WINDOW,
            wid,
            NULL if parent_id is None else parent_id,
            code(kind),
            code(name or kind),
            NULL if step is None else step,
            NULL if microbatch is None else microbatch,
            int(t_begin_mono_ns),
            int(t_end_mono_ns),
            wall,
            code(timing),
            *self._labels_with(labels),
        )
        self.emit_records((rec,))
        return wid

    def reserve_ids(self, n: int) -> int:
        """Take ``n`` consecutive window ids; returns the first (a StepMarker reserves a step's
        ids before its windows are made, here or in the telemetry process)."""
        with self._lock:
            first = self._next_id
            self._next_id += n
        return first

    def wall_offset(self, t_mono_ns: int) -> int:
        """``t_begin_wall_ns - t_begin_mono_ns`` for a window beginning at ``t_mono_ns``."""
        return self._wall(t_mono_ns) - t_mono_ns

    @property
    def label_values(self) -> tuple[int, ...]:
        """The labels every window gets, as record ints (NULL for null), in WINDOW_LABELS order."""
        return self._label_values

    def emit_records(self, recs: Sequence[Record]) -> None:
        """Hand finished records (made elsewhere, e.g. from a step's log) to the sink in one call."""
        with self._lock:
            self._sink(recs)
            self.total_recorded += len(recs)

    def ship_step_log(self, *parts: Sequence[int]) -> None:
        """Send a step's packed log (steplog.pack, or its pieces in order) to :attr:`log_sink`."""
        assert self.log_sink is not None
        self.log_sink(*parts)
        self.steps_shipped += 1

    # -- taking what was recorded ----------------------------------------------------------
    def drain_records(self) -> list[Record]:
        """Take the finished records since the last drain (empty once a sink is installed)."""
        with self._lock:
            done = self._done[:]
            self._done.clear()
        return done

    def drain(self) -> list[dict[str, Any]]:
        """Take the finished windows since the last drain, as rows keyed by WINDOW_COLUMNS."""
        names = self.names.names
        return [decode_record(r, names) for r in self.drain_records()]

    def open_records(self) -> list[Record]:
        """Windows begun and not yet ended (e.g. at SIGTERM), as records with a NULL end."""
        with self._lock:
            return [self._record(wid, entry, NULL) for wid, entry in self._open.items()]

    def open_windows(self) -> list[dict[str, Any]]:
        """Windows begun and not yet ended, as rows with ``t_end_mono_ns`` None."""
        names = self.names.names
        return [decode_record(r, names) for r in self.open_records()]
