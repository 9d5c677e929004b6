"""The thread sampler: a daemon thread with deadline-based sleep, in the training process.

A session uses it only where its telemetry process cannot run (``telemetry.sampler=thread``, a
Backend object, a process that does not start): a Python thread shares the GIL with the
training thread, which can hold it for up to the interpreter's switch interval (5 ms).
bench/bench_sampler.py (figures in docs/benchmarks.md) shows the thread meeting 100 % of its
deadlines at 100 Hz with a core free, but only ~55 % at 1 kHz when the main thread runs Python,
while the same loop in the telemetry process meets 98.7-99.4 %
(:mod:`charllm_nemo.telemetry.process.parent`). Both run the one deadline loop in
:mod:`charllm_nemo.telemetry.sample_loop`.

Hot path per sample: two clock reads, the backend's ``read()``, one more clock read and one
``list.append`` of a tuple. The backend's reading tuple is kept as it is; turning rows into
columns (Arrow arrays) happens off this thread when the store takes a batch
(``take_rows`` -> ``rows_to_table``), where it runs in C.

It never raises into the training process: a lost device stops its own sampling with one log
line; an unexpected backend error is logged once and that device is dropped; the thread
records its own health.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from charllm_nemo.devices.base import Device
from charllm_nemo.telemetry.sample_loop import (
    DEFAULT_COUNTER_HZ,
    DEFAULT_HZ,
    MAX_HZ,
    MIN_HZ,
    Row,
    SamplerHealth,
    counter_every,
    run_sample_loop,
    validate_hz,
)
from charllm_nemo.telemetry.schema import INT_NULL, METRICS

log = logging.getLogger("charllm_nemo.telemetry")

__all__ = [
    "DEFAULT_COUNTER_HZ",
    "MAX_HZ",
    "MIN_HZ",
    "SAMPLES_SCHEMA",
    "Row",
    "Sampler",
    "SamplerHealth",
    "columns_to_table",
    "rows_to_arrays",
    "rows_to_table",
    "validate_hz",
]


class Sampler:
    """Samples ``devices`` at ``hz`` on a daemon thread until :meth:`stop`.

    Rows accumulate in memory; the store takes them with :meth:`take_rows` (at least every
    second). ``source`` names the backend and lands in every row of the table. ``counter_hz``:
    how often a device that reads its cumulative counters apart (``read_gauges``) reads them
    (None: derived from their measured cost when sampling starts;
    :func:`~charllm_nemo.telemetry.sample_loop.run_sample_loop`).
    """

    mode = "thread"

    def __init__(
        self,
        devices: Sequence[Device],
        hz: float = DEFAULT_HZ,
        source: str = "unknown",
        counter_hz: float | None = DEFAULT_COUNTER_HZ,
    ) -> None:
        self.hz = validate_hz(hz)
        self.period_ns = round(1e9 / self.hz)
        self.counter_every = counter_every(self.hz, counter_hz)
        self.source = source
        self._devices = list(devices)
        self._rows: list[Row] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.health = SamplerHealth(hz=self.hz)
        self.last_t_mono_ns = 0

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        t0 = time.monotonic_ns()
        self._thread = threading.Thread(target=self._run, name="charllm-sampler", daemon=True)
        self._thread.start()
        self.health.startup_ns = time.monotonic_ns() - t0

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- data ------------------------------------------------------------------------------
    def take_rows(self) -> list[Row]:
        """Hand over the rows sampled since the last call (the store calls this)."""
        with self._lock:
            rows, self._rows = self._rows, []
        return rows

    def peek_rows(self) -> list[Row]:
        """A copy of the rows not yet taken (for live figures); the rows stay queued."""
        with self._lock:
            return list(self._rows)

    # -- the loop --------------------------------------------------------------------------
    def _run(self) -> None:
        run_sample_loop(
            self._devices,
            self.period_ns,
            self.health,
            self._emit,
            self._stop.is_set,
            on_slot=self._slot_done,
            counter_every=self.counter_every,
        )

    def _emit(self, row: Row) -> None:
        with self._lock:
            self._rows.append(row)

    def _slot_done(self, t_first: int) -> None:
        # Every device sampled has a row at or after this: a window ending by then has its
        # samples past the end on every device.
        self.last_t_mono_ns = t_first


def _arrow_schema() -> pa.Schema:
    fields = [
        pa.field("t_mono_ns", pa.int64(), nullable=False),
        pa.field("t_wall_ns", pa.int64(), nullable=False),
        pa.field("read_ns", pa.int64(), nullable=False),
        pa.field("device_index", pa.int16(), nullable=False),
        pa.field("source", pa.dictionary(pa.int8(), pa.string()), nullable=False),
    ]
    for m in METRICS:
        fields.append(pa.field(m.name, pa.float64() if m.kind == "float" else pa.int64()))
    return pa.schema(fields)


SAMPLES_SCHEMA: pa.Schema = _arrow_schema()


def rows_to_table(rows: Sequence[Row], source: str) -> pa.Table:
    """Transpose sampler rows into an Arrow table with SAMPLES_SCHEMA (None -> null)."""
    n = len(rows)
    if n == 0:
        return SAMPLES_SCHEMA.empty_table()
    t_mono, t_wall, read_ns, dev, readings = zip(*rows, strict=True)
    columns: list[pa.Array] = [
        pa.array(t_mono, pa.int64()),
        pa.array(t_wall, pa.int64()),
        pa.array(read_ns, pa.int64()),
        pa.array(dev, pa.int16()),
        pa.DictionaryArray.from_arrays(pa.array([0] * n, pa.int8()), pa.array([source])),
    ]
    by_metric = list(zip(*readings, strict=True))
    for i, m in enumerate(METRICS):
        columns.append(_metric_array(m.name, by_metric[i]))
    return pa.Table.from_arrays(columns, schema=SAMPLES_SCHEMA)


_BAD_VALUE = (pa.ArrowException, OverflowError, TypeError, ValueError)


def _metric_array(name: str, values: Sequence[Any]) -> pa.Array:
    """One metric's column. A value that does not fit its type (a driver's 2**64 - 1 in an int64
    column, a string) becomes null, as the telemetry process's ring does, instead of failing
    the whole flush."""
    typ = SAMPLES_SCHEMA.field(name).type
    try:
        return pa.array(values, typ)
    except _BAD_VALUE:
        kept, bad = [], 0
        for v in values:
            try:
                pa.scalar(v, typ)
                kept.append(v)
            except _BAD_VALUE:
                kept.append(None)
                bad += 1
        log.warning("telemetry: %d value(s) of %s did not fit %s: stored as null", bad, name, typ)
        return pa.array(kept, typ)


def columns_to_table(columns: Mapping[str, np.ndarray[Any, Any]], source: str) -> pa.Table:
    """Numpy sample columns (the in-memory null convention: NaN floats, INT_NULL ints; keys: the
    sample columns and every metric) -> an Arrow table with SAMPLES_SCHEMA. No per-row Python."""
    n = len(columns["t_mono_ns"])
    arrays: list[pa.Array] = [
        pa.array(columns["t_mono_ns"], pa.int64()),
        pa.array(columns["t_wall_ns"], pa.int64()),
        pa.array(columns["read_ns"], pa.int64()),
        pa.array(columns["device_index"], pa.int16()),
        pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int8)), pa.array([source])),
    ]
    for m in METRICS:
        col = columns[m.name]
        if m.kind == "float":
            arrays.append(pa.array(col, pa.float64(), from_pandas=True))  # NaN -> null
        else:
            null = col == INT_NULL
            arrays.append(pa.array(col, pa.int64(), mask=null if null.any() else None))
    return pa.Table.from_arrays(arrays, schema=SAMPLES_SCHEMA)


def rows_to_arrays(rows: Sequence[Row]) -> dict[str, np.ndarray[Any, Any]]:
    """Sampler rows -> numpy columns with the in-memory null convention (NaN floats, INT_NULL
    ints), the form the attribution takes; no Arrow round trip (cheap for a step's few rows)."""
    out: dict[str, np.ndarray[Any, Any]] = {}
    if not rows:
        out["t_mono_ns"] = np.zeros(0, np.int64)
        out["device_index"] = np.zeros(0, np.int64)
        for m in METRICS:
            out[m.name] = np.zeros(0, np.float64 if m.kind == "float" else np.int64)
        return out
    t_mono, _wall, _read, dev, readings = zip(*rows, strict=True)
    out["t_mono_ns"] = np.fromiter(t_mono, np.int64, len(rows))
    out["device_index"] = np.fromiter(dev, np.int64, len(rows))
    by_metric = list(zip(*readings, strict=True))
    for i, m in enumerate(METRICS):
        col = by_metric[i]
        if m.kind == "float":
            out[m.name] = np.array(col, dtype=np.float64)  # None -> NaN
        else:
            out[m.name] = np.array([INT_NULL if v is None else v for v in col], dtype=np.int64)
    return out
