"""The driver-buffered timeline: ``buffered-NNNNNN.parquet`` segments beside the samples.

A device whose driver keeps its own sample buffers (NVML's ``nvmlDeviceGetSamples``:
``devices/nvml_buffer.py``) exposes ``read_buffered()``; :class:`BufferedStore` drains it once
per flush interval, on the thread that writes the rank's segments (the telemetry process's
collector, or thread mode's flusher), and writes what it got as one segment per flush. The rows
are long: one per (device, metric, driver sample), since each buffer has its own timestamps.

The driver stamps samples with the CPU wall clock (us). Each drain converts them to
CLOCK_MONOTONIC with the offset between the two clocks measured at that drain (``t_mono_ns =
t_wall_ns + (monotonic - wall)``), so that they join with the windows as the polled samples do;
a wall-clock step (NTP) between a sample and its drain shifts it by the step.

:func:`window_peaks` gives each window's highest buffered power, the peak the polled instant
power misses between two polls; ``charllm_nemo.telemetry.reader.load_run`` does not read these
segments (:func:`load_buffered` does). Schema: docs/store.md.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from charllm_nemo.devices.base import ServesDriverBuffers
from charllm_nemo.errors import DeviceLost, DiskFull

log = logging.getLogger("charllm_nemo.telemetry")

KIND = "buffered"
"""Segment kind (file name prefix) of the driver-buffered timeline."""

BUFFERED_SCHEMA = pa.schema(
    [
        pa.field("t_mono_ns", pa.int64()),
        pa.field("t_wall_ns", pa.int64()),
        pa.field("device_index", pa.int16()),
        pa.field("metric", pa.dictionary(pa.int8(), pa.string())),
        pa.field("value", pa.float64()),
    ]
)
"""``t_mono_ns`` (ns, CLOCK_MONOTONIC, converted from the driver's stamp), ``t_wall_ns`` (ns, the
driver's own wall-clock stamp), ``device_index``, ``metric`` (``power_w`` W, ``clock_sm_mhz``
MHz, ``util_gpu_pct`` %), ``value`` in the metric's unit."""

_NAME = re.compile(rf"^{KIND}-([0-9]{{6}}|[1-9][0-9]{{6,17}})\.parquet$")


def next_seq(folder: Path) -> int:
    """The next free segment number of :data:`KIND` in ``folder`` (0 when it has none), so a
    writer that takes over from another (the training process after its telemetry process
    died) numbers on."""
    seqs = [int(m.group(1)) for p in folder.glob(f"{KIND}-*.parquet") if (m := _NAME.match(p.name))]
    return max(seqs) + 1 if seqs else 0


def buffered_devices(devices: Sequence[Any]) -> list[ServesDriverBuffers]:
    """The devices that serve a driver buffer (devices/base.py ``ServesDriverBuffers``, with at
    least one buffer)."""
    return [d for d in devices if isinstance(d, ServesDriverBuffers) and d.has_driver_buffers]


class BufferedStore:
    """Drains ``devices``' driver buffers (:meth:`poll`) and writes them as segments under
    ``folder`` (:meth:`flush`). Thread-safe; never raises into its caller: a device that is lost
    or fails is dropped (logged once), a full disk stops the writing (logged once)."""

    def __init__(self, folder: Path, devices: Sequence[Any]) -> None:
        self.dir = folder
        self.devices = buffered_devices(devices)
        self._seq = next_seq(folder) if folder.is_dir() else 0
        # Taking over from another writer (the telemetry process died): this process's buffers
        # were last drained at its own open, so their first drain repeats samples that writer
        # stored. Keep only those after the newest it stored, per (device, metric).
        self._after = _newest_stored(folder, self._seq - 1) if self._seq else {}
        self._lock = threading.Lock()
        self._parts: list[dict[str, np.ndarray[Any, Any]]] = []
        self.segments = 0
        self.rows = 0
        self.polls = 0
        self.poll_ns_total = 0
        self.poll_ns_max = 0
        self.stopped: str | None = None  # why nothing more is written (a full disk)
        self.write_errors = 0

    def poll(self) -> None:
        """Take every device's new driver samples into memory."""
        with self._lock:
            self._poll_locked()

    def _poll_locked(self) -> None:
        if not self.devices:
            return
        t0 = time.monotonic_ns()
        offset = t0 - time.time_ns()  # monotonic - wall, at this drain
        for dev in tuple(self.devices):
            idx = dev.identity.index
            try:
                batches = dev.read_buffered()
            except DeviceLost as exc:
                self.devices.remove(dev)
                log.info("device %d: driver buffers no longer read (%s)", idx, exc)
                continue
            except Exception:
                self.devices.remove(dev)
                log.exception("device %d: reading the driver buffers failed; they are no longer read", idx)
                continue
            for metric, ts_us, values in batches:
                wall = np.asarray(ts_us, np.int64) * 1000
                vals = np.asarray(values, np.float64)
                after = self._after.get((idx, metric))
                if after is not None:
                    keep = wall > after
                    wall, vals = wall[keep], vals[keep]
                    if not len(wall):
                        continue
                self._parts.append(
                    {
                        "t_mono_ns": wall + offset,
                        "t_wall_ns": wall,
                        "device_index": np.full(len(wall), idx, np.int16),
                        "metric": np.full(len(wall), metric, object),
                        "value": vals,
                    }
                )
        dt = time.monotonic_ns() - t0
        self.polls += 1
        self.poll_ns_total += dt
        self.poll_ns_max = max(self.poll_ns_max, dt)

    def flush(self) -> Path | None:
        """Poll, then write what was taken since the last flush as one segment (None: nothing
        to write, or writing stopped)."""
        from charllm_nemo.telemetry.store import atomic_write_table

        with self._lock:
            self._poll_locked()
            if not self._parts:
                return None
            parts, self._parts = self._parts, []
            if self.stopped is not None:
                return None
            table = pa.table(
                {name: np.concatenate([p[name] for p in parts]) for name in BUFFERED_SCHEMA.names}
            )
            table = table.cast(BUFFERED_SCHEMA)
            path = self.dir / f"{KIND}-{self._seq:06d}.parquet"
            try:
                atomic_write_table(path, table)
            except DiskFull as exc:
                self.stopped = str(exc)
                log.error(
                    "telemetry: the disk is full (%s); driver-buffered samples are no longer stored", exc
                )
                return None
            except Exception:
                self._parts = parts + self._parts  # kept for the next flush
                self.write_errors += 1
                log.exception("telemetry: writing %s failed; will retry at the next flush", path.name)
                return None
            self._seq += 1
            self.segments += 1
            self.rows += table.num_rows
            return path

    def counts(self) -> dict[str, Any]:
        """For the manifest: segments and rows written by this store, polls and their cost (ns),
        the devices still read."""
        return {
            "segments": self.segments,
            "rows": self.rows,
            "polls": self.polls,
            "poll_ns_mean": self.poll_ns_total / self.polls if self.polls else 0.0,
            "poll_ns_max": self.poll_ns_max,
            "devices": [d.identity.index for d in self.devices],
            "write_errors": self.write_errors,
            **({"stopped": self.stopped} if self.stopped else {}),
        }


def _newest_stored(folder: Path, seq: int) -> dict[tuple[int, str], int]:
    """The newest ``t_wall_ns`` per (device, metric) in segment ``seq`` of ``folder`` (every
    flush drains every buffer, so the last segment holds each one's newest); empty when it
    cannot be read."""
    from charllm_nemo.telemetry.layout import read_parquet

    try:
        t = read_parquet(folder / f"{KIND}-{seq:06d}.parquet", ["t_wall_ns", "device_index", "metric"])
    except Exception as exc:
        log.warning("%s: cannot be read to continue after it (%s); samples may repeat", folder, exc)
        return {}
    out: dict[tuple[int, str], int] = {}
    for wall, idx, metric in zip(
        t.column("t_wall_ns").to_pylist(),
        t.column("device_index").to_pylist(),
        t.column("metric").to_pylist(),
        strict=True,
    ):
        key = (int(idx), str(metric))
        out[key] = max(out.get(key, wall), wall)
    return out


def load_buffered(run_dir: str | Path, ranks: Sequence[int] | None = None) -> pa.Table:
    """Every rank's ``buffered-*.parquet`` as one table with a ``rank`` column (int32), ordered
    by rank, device, metric and time; an empty table (the schema, plus ``rank``) when there is
    none. Files are found and opened as the other readers do (telemetry.layout); a damaged
    segment is skipped with a warning."""
    from charllm_nemo.telemetry.layout import UnpackBudget, read_parquet, scan_run

    run = scan_run(run_dir)
    tables = []
    budget = UnpackBudget()  # every file read here is held at once: a bomb over many is refused
    for rank in run.rank_ids:
        if ranks is not None and rank not in ranks:
            continue
        for path in run.ranks[rank].buffered:
            try:
                t = read_parquet(path, budget=budget).cast(BUFFERED_SCHEMA)
            except Exception as exc:
                log.warning("%s: skipped: %s", path, exc)
                continue
            tables.append(t.append_column("rank", pa.array(np.full(t.num_rows, rank, np.int32))))
    if not tables:
        return BUFFERED_SCHEMA.append(pa.field("rank", pa.int32())).empty_table()
    table = pa.concat_tables(tables)
    return table.sort_by([("rank", "ascending"), ("device_index", "ascending"), ("t_mono_ns", "ascending")])


def window_peaks(
    t_mono_ns: np.ndarray[Any, Any],
    power_w: np.ndarray[Any, Any],
    t_begin_mono_ns: np.ndarray[Any, Any],
    t_end_mono_ns: np.ndarray[Any, Any],
) -> np.ndarray[Any, Any]:
    """Each window's highest driver-buffered power (W), NaN where no buffered sample falls in
    ``[t_begin, t_end]``. ``t_mono_ns`` sorted ascending, one device's ``power_w`` rows."""
    lo = np.searchsorted(t_mono_ns, t_begin_mono_ns, side="left")
    hi = np.searchsorted(t_mono_ns, t_end_mono_ns, side="right")
    out = np.full(len(lo), np.nan)
    for i, (a, b) in enumerate(zip(lo, hi, strict=True)):
        if b > a:
            out[i] = float(np.max(power_w[a:b]))
    return out
