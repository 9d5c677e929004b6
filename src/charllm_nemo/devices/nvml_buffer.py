"""The NVIDIA driver's own sample buffers: ``nvmlDeviceGetSamples``.

The driver samples some quantities itself, faster and more regularly than a Python poller can,
and keeps the last few of them (a ring per quantity) with a CPU wall-clock timestamp in
microseconds. ``nvmlDeviceGetSamples(device, type, lastSeenTimeStamp, &valueType, &count,
samples)`` returns those newer than ``lastSeenTimeStamp``, oldest first (``NVML_ERROR_NOT_FOUND``
when there is none); called with ``samples = NULL`` it says how many the buffer holds. The
polled instant power (a field read once per sampler period) misses what happens between two
polls; the buffer does not, as long as it is drained before it wraps.

:class:`DriverBuffers` drains the buffers of one device: total board power
(``NVML_TOTAL_POWER_SAMPLES``, mW -> W), SM clock (``NVML_PROCESSOR_CLK_SAMPLES``, MHz) and GPU
utilization (``NVML_GPU_UTILIZATION_SAMPLES``, %). Each is probed at open; one the driver does
not serve is left out (logged once). It calls the C entry point directly with a buffer
allocated at open (no per-call allocation). It uses no state of the device's polled reads, so it
may run on another thread than the sampler's (NVML itself is thread-safe).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from typing import Any

from charllm_nemo.devices.nvml_sources import LOST_CODES, NVML_SUCCESS, error_name, resolve
from charllm_nemo.errors import DeviceLost

log = logging.getLogger("charllm_nemo.devices")

NVML_ERROR_NOT_FOUND = 6
"""What nvmlDeviceGetSamples returns when no sample is newer than the one last seen."""

BUFFERED_METRICS: tuple[tuple[str, int, float], ...] = (
    ("power_w", 0, 1000.0),  # NVML_TOTAL_POWER_SAMPLES: mW
    ("util_gpu_pct", 1, 1.0),  # NVML_GPU_UTILIZATION_SAMPLES: %
    ("clock_sm_mhz", 5, 1.0),  # NVML_PROCESSOR_CLK_SAMPLES: MHz
)
"""(metric, NVML sampling type, divisor to the metric's unit) of each buffer read."""

MAX_DRAINS = 8
"""Calls per buffer and :meth:`DriverBuffers.read` at most (each returns up to a buffer's size)."""

MIN_SLOTS = 512
"""Samples our buffer for one drain call holds at least: asked with ``samples = NULL``, NVML says
how many samples it would return now, which is the driver's ring size only once that is full."""


class _Value(ctypes.Union):
    _fields_ = [
        ("dVal", ctypes.c_double),
        ("uiVal", ctypes.c_uint),
        ("ulVal", ctypes.c_ulong),
        ("ullVal", ctypes.c_ulonglong),
        ("sllVal", ctypes.c_longlong),
        ("siVal", ctypes.c_int),
        ("usVal", ctypes.c_ushort),
    ]


class _Sample(ctypes.Structure):
    _fields_ = [("timeStamp", ctypes.c_ulonglong), ("sampleValue", _Value)]


_VALUE_FIELDS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")  # by nvmlValueType_t


@dataclass
class BufferHealth:
    """How draining went, per metric: calls made, samples returned, drains that found the
    buffer already full (samples older than its oldest may have been lost: drain more often),
    and failed calls."""

    calls: dict[str, int] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)
    full: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    read_ns_total: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "calls": dict(self.calls),
            "samples": dict(self.samples),
            "full": dict(self.full),
            "errors": dict(self.errors),
            "read_ns_total": self.read_ns_total,
        }


Batch = tuple[str, list[int], list[float]]
"""One metric's new samples: (metric, wall-clock timestamps in us, values in the metric's unit)."""


class DriverBuffers:
    """The driver sample buffers of one NVML device, drained by :meth:`read`.

    ``metrics``: the metrics served (those of :data:`BUFFERED_METRICS` whose buffer answered at
    open); ``capacity``: samples each of the driver's buffers held at open, as it says (its ring
    size once the ring is full; 0 right after the driver loads: then no drain is counted as
    full). The first drain happens at open and is discarded, so :meth:`read` returns only
    samples taken after open.
    """

    def __init__(self, nvml: Any, handle: Any, index: int) -> None:
        self._nvml = nvml
        self._handle = handle
        self.index = index
        self._fn: Any = resolve(nvml, "nvmlDeviceGetSamples")
        self._plans: list[tuple[str, ctypes.c_uint, float, Any, int]] = []
        self._last: dict[str, int] = {}
        self.capacity: dict[str, int] = {}
        self.health = BufferHealth()
        self._logged: set[tuple[str, int]] = set()
        self.unsupported: dict[str, str] = {}
        for metric, kind, divisor in BUFFERED_METRICS:
            why = self._probe(metric, kind, divisor)
            if why is not None:
                self.unsupported[metric] = why
                log.info("device %d: driver-buffered %s not available (%s)", index, metric, why)

    @property
    def metrics(self) -> tuple[str, ...]:
        """The metrics whose buffer this device serves."""
        return tuple(p[0] for p in self._plans)

    def _probe(self, metric: str, kind: int, divisor: float) -> str | None:
        if self._fn is None:
            return "this NVML has no nvmlDeviceGetSamples"
        vt, count = ctypes.c_int(0), ctypes.c_uint(0)
        rc = int(self._fn(self._handle, ctypes.c_uint(kind), ctypes.c_ulonglong(0), ctypes.byref(vt),
                          ctypes.byref(count), None))  # fmt: skip
        if rc in LOST_CODES:
            raise DeviceLost(f"NVML GPU {self.index}: {error_name(self._nvml, rc)}")
        if rc != NVML_SUCCESS:
            return error_name(self._nvml, rc)
        size = max(int(count.value), MIN_SLOTS)
        buf = (_Sample * size)()
        self._plans.append((metric, ctypes.c_uint(kind), divisor, buf, size))
        self.capacity[metric] = int(count.value)
        self._last[metric] = 0
        for name in ("calls", "samples", "full", "errors"):
            getattr(self.health, name)[metric] = 0
        self._drain(self._plans[-1])  # what the buffer held before open: not ours
        self.health.samples[metric] = 0
        self.health.full[metric] = 0
        return None

    def read(self) -> list[Batch]:
        """Every metric's samples taken since the last read (oldest first); a metric with none
        is left out. Raises only :class:`DeviceLost`; a failed call is counted in
        :attr:`health` and logged once per (metric, error)."""
        import time

        t0 = time.monotonic_ns()
        out: list[Batch] = []
        for plan in self._plans:
            ts, values = self._drain(plan)
            if ts:
                out.append((plan[0], ts, values))
        self.health.read_ns_total += time.monotonic_ns() - t0
        return out

    def _drain(self, plan: tuple[str, ctypes.c_uint, float, Any, int]) -> tuple[list[int], list[float]]:
        metric, kind, divisor, buf, size = plan
        h = self.health
        ts: list[int] = []
        values: list[float] = []
        vt, count = ctypes.c_int(0), ctypes.c_uint(0)
        for _ in range(MAX_DRAINS):
            count.value = size
            rc = int(self._fn(self._handle, kind, ctypes.c_ulonglong(self._last[metric]), ctypes.byref(vt),
                              ctypes.byref(count), buf))  # fmt: skip
            h.calls[metric] += 1
            if rc == NVML_ERROR_NOT_FOUND:
                break
            if rc != NVML_SUCCESS:
                if rc in LOST_CODES:
                    raise DeviceLost(f"NVML GPU {self.index}: {error_name(self._nvml, rc)}")
                h.errors[metric] += 1
                if (metric, rc) not in self._logged:
                    self._logged.add((metric, rc))
                    log.warning(
                        "device %d: driver-buffered %s: %s while draining (counted)",
                        self.index,
                        metric,
                        error_name(self._nvml, rc),
                    )
                break
            n = count.value
            if not 0 <= vt.value < len(_VALUE_FIELDS) or n > size:
                h.errors[metric] += 1
                break
            attr = _VALUE_FIELDS[vt.value]
            for i in range(n):
                s = buf[i]
                ts.append(int(s.timeStamp))
                values.append(getattr(s.sampleValue, attr) / divisor)
            if n:
                self._last[metric] = int(buf[n - 1].timeStamp)
            if 0 < self.capacity[metric] <= n:
                h.full[metric] += 1  # the driver's whole ring was new: older samples may be lost
            if n < size:
                break
        h.samples[metric] += len(ts)
        return ts, values
