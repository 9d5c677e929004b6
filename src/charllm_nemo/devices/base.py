"""The one device protocol every vendor backend implements.

A backend module (``nvml.py``, ``amdsmi.py``, ``synthetic.py``) exposes
``open_backend(indices=None, **options) -> Backend``. Setup raises :class:`BackendUnavailable`
with a message a person can act on; after that, ``Device.read()`` never raises anything but
:class:`DeviceLost`: an unsupported metric is ``None`` in the reading and is logged once per
(device, metric) through :class:`UnsupportedLog`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from charllm_nemo.devices.contract import Reading

log = logging.getLogger("charllm_nemo.devices")


@dataclass(frozen=True)
class DeviceIdentity:
    """Who a device is, recorded in every manifest.

    ``extra`` holds vendor facts worth keeping (PCI bus id, energy counter resolution, which
    die of a package reports the package power, ...). Values must be JSON-serializable.
    """

    index: int
    name: str
    vendor: str  # "nvidia" | "amd" | "synthetic"
    backend: str  # "nvml" | "amdsmi" | "synthetic"
    uuid: str | None = None
    driver_version: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "vendor": self.vendor,
            "backend": self.backend,
            "uuid": self.uuid,
            "driver_version": self.driver_version,
            "extra": dict(self.extra),
        }


@runtime_checkable
class Device(Protocol):
    """One accelerator, opened and ready to sample."""

    identity: DeviceIdentity

    def read(self) -> Reading:
        """One value per ``schema.METRICS`` entry, in order, in the schema's units.

        Returns None for a metric the device does not support. Raises only DeviceLost.
        """
        ...

    def supported_metrics(self) -> dict[str, bool]:
        """Which metrics produced a value at open time (probe), by name."""
        ...


@runtime_checkable
class ReadsGaugesApart(Protocol):
    """A device whose cumulative counters are dear to read (NVML's energy counter: ~3 ms on an
    H200): the sampling loop reads them every n-th slot only and calls ``read_gauges`` between
    (telemetry/sample_loop.py)."""

    def read_gauges(self) -> Reading:
        """:meth:`read` with the cumulative metrics (``Metric.cumulative``) left None."""
        ...


@runtime_checkable
class ServesDriverBuffers(Protocol):
    """A device whose driver keeps its own sample buffers (NVML): drained into
    ``buffered-*.parquet`` (telemetry/buffered.py). ``has_driver_buffers``: whether this one
    serves any (a driver may serve none)."""

    identity: DeviceIdentity

    @property
    def has_driver_buffers(self) -> bool: ...

    def read_buffered(self) -> list[Any]:
        """The driver's samples since the last call: ``(metric, timestamps us, values)`` each."""
        ...


@runtime_checkable
class Backend(Protocol):
    """An initialized vendor library and the devices opened through it."""

    name: str
    devices: list[Device]

    def close(self) -> None:
        """Release the vendor library (nvmlShutdown, amdsmi_shut_down); idempotent."""
        ...


@runtime_checkable
class ActivityInput(Protocol):
    """How a backend whose devices model their load, rather than measure it, takes the training
    loop's activity: a backend's ``activity`` attribute (None, or absent, for devices that
    measure their own: NVML, AMD SMI). The telemetry session calls it the same way for every
    backend: it adds it as a WindowRecorder listener (called with ``(kind, name, is_begin)`` on
    every mark, on the training thread: it must be cheap), and where the devices are read in a
    telemetry process it sets ``on_change`` to publish each new level (0..1) there, and back to
    None when that process is gone. How the level is read on the other side is the backend
    module's business (devices/factory.py: ``process_plan`` and ``open_in_process``)."""

    on_change: Callable[[float], object] | None

    def __call__(self, kind: str, name: str, is_begin: bool) -> None:
        """A window mark: ``kind`` (step / microbatch / phase), its ``name``, begin or end."""
        ...


def activity_input(backend: Backend) -> ActivityInput | None:
    """``backend``'s activity input, or None where its devices measure their own activity (a
    backend object without the attribute, e.g. a test's stand-in, counts as that)."""
    activity: ActivityInput | None = getattr(backend, "activity", None)
    return activity


class UnsupportedLog:
    """Logs a missing metric once per (device, metric), then stays silent."""

    def __init__(self) -> None:
        self._seen: set[tuple[int, str]] = set()

    def __call__(self, device_index: int, metric: str, reason: str) -> None:
        key = (device_index, metric)
        if key in self._seen:
            return
        self._seen.add(key)
        log.info("device %d: %s not available (%s); recorded as null", device_index, metric, reason)

    def seen(self) -> set[tuple[int, str]]:
        return set(self._seen)
