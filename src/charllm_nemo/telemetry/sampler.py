"""The background sampler: one per rank, a daemon thread with deadline-based sleep.

Why a thread and not a process: DESIGN.md's measurements (and bench/bench_sampler.py) show a
plain Python thread holds its deadlines at 100 Hz and 1 kHz when a core is free, which is the
case on a GPU node; with every core busy a separate process did no better, because the limit
was cores, not the GIL.

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
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa

from charllm_nemo.devices.base import Device
from charllm_nemo.errors import ConfigError, DeviceLost
from charllm_nemo.telemetry.schema import METRICS

log = logging.getLogger("charllm_nemo.sampler")

MIN_HZ = 1.0
MAX_HZ = 1000.0

Row = tuple[int, int, int, int, tuple[Any, ...]]  # t_mono_ns, t_wall_ns, read_ns, device_index, reading


def validate_hz(hz: float) -> float:
    """Return ``hz`` as a float if within 1 Hz to 1 kHz, else raise ConfigError."""
    try:
        value = float(hz)
    except (TypeError, ValueError):
        raise ConfigError(f"telemetry.hz={hz!r} is not a number; use a rate in [1, 1000] Hz") from None
    if not MIN_HZ <= value <= MAX_HZ:
        raise ConfigError(
            f"telemetry.hz={hz} is outside the supported range; use a rate in [{MIN_HZ:g}, {MAX_HZ:g}] Hz "
            "(1 kHz is the most a Python sampler holds reliably; NVML's own power average is 1 s)"
        )
    return value


@dataclass
class SamplerHealth:
    """The sampler's own record of how it did (counts, and ns of CLOCK_MONOTONIC)."""

    hz: float
    started_mono_ns: int = 0
    stopped_mono_ns: int = 0
    samples: int = 0
    slots: int = 0  # deadlines that came due while running
    on_time: int = 0  # samples started within half a period of their deadline
    deadlines_missed: int = 0  # slots skipped entirely because the sampler was a period or more late
    late_max_ns: int = 0
    read_ns_total: int = 0
    read_ns_max: int = 0
    devices_lost: int = 0
    errors: int = 0
    stop_reason: str | None = None

    def deadline_ratio(self) -> float:
        """Fraction of due deadlines met on time (1.0 when none came due)."""
        return self.on_time / self.slots if self.slots else 1.0

    def read_ns_mean(self) -> float:
        return self.read_ns_total / self.samples if self.samples else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["deadline_ratio"] = self.deadline_ratio()
        d["read_ns_mean"] = self.read_ns_mean()
        return d


class Sampler:
    """Samples ``devices`` at ``hz`` on a daemon thread until :meth:`stop`.

    Rows accumulate in memory; the store takes them with :meth:`take_rows` (at least every
    second). ``source`` names the backend and lands in every row of the table.
    """

    def __init__(self, devices: Sequence[Device], hz: float = 100.0, source: str = "unknown") -> None:
        self.hz = validate_hz(hz)
        self.period_ns = round(1e9 / self.hz)
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
        self._thread = threading.Thread(target=self._run, name="charllm-sampler", daemon=True)
        self._thread.start()

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
        h = self.health
        period = self.period_ns
        half = period // 2
        mono = time.monotonic_ns
        sleep = time.sleep
        devices = [(d, d.identity.index) for d in self._devices]
        h.started_mono_ns = deadline = mono()
        try:
            while not self._stop.is_set() and devices:
                now = mono()
                late = now - deadline
                h.slots += 1
                if late < half:
                    h.on_time += 1
                if late > h.late_max_ns:
                    h.late_max_ns = late
                self._sample_once(devices)
                deadline += period
                now = mono()
                if now - deadline >= period:
                    # A period or more behind: skip the lost slots rather than burst to catch up.
                    skipped = (now - deadline) // period
                    h.deadlines_missed += skipped
                    h.slots += skipped
                    deadline += skipped * period
                wait = deadline - now
                if wait > 0:
                    sleep(wait / 1e9)
            if devices:
                # One last sample at stop, so a window that closed just before stop() is
                # bracketed by samples on both sides and can be attributed.
                self._sample_once(devices)
            if not devices:
                h.stop_reason = "no devices left"
                log.error("telemetry sampler stopped: no device left to sample; training goes on")
            else:
                h.stop_reason = "stopped"
        except Exception as exc:  # never propagate into the process
            h.errors += 1
            h.stop_reason = f"crashed: {exc!r}"
            log.exception("telemetry sampler crashed; training goes on")
        finally:
            h.stopped_mono_ns = mono()

    def _sample_once(self, devices: list[tuple[Device, int]]) -> None:
        """Read every device once; a device that fails is removed from ``devices``."""
        h = self.health
        mono = time.monotonic_ns
        for entry in tuple(devices):
            dev, idx = entry
            t0 = mono()
            tw = time.time_ns()
            try:
                reading = dev.read()
            except DeviceLost as exc:
                h.devices_lost += 1
                devices.remove(entry)
                log.error("device %d lost (%s): sampling of it stopped; training goes on", idx, exc)
                continue
            except Exception as exc:  # a backend bug must not reach training
                h.errors += 1
                devices.remove(entry)
                log.exception("device %d: unexpected error in read(), sampling of it stopped: %s", idx, exc)
                continue
            dt = mono() - t0
            with self._lock:
                self._rows.append((t0, tw, dt, idx, reading))
            h.samples += 1
            h.read_ns_total += dt
            if dt > h.read_ns_max:
                h.read_ns_max = dt
            self.last_t_mono_ns = t0


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
        columns.append(pa.array(by_metric[i], SAMPLES_SCHEMA.field(m.name).type))
    return pa.Table.from_arrays(columns, schema=SAMPLES_SCHEMA)
