"""What the device backends' tests share: a metric's value in a reading, a clock the synthetic
device's tests move by hand, and the stand-in NVML's device read with some of its metrics
refused (the refusal's checks with it)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import pytest

from charllm_nemo.telemetry.schema import METRIC_INDEX


def value(reading: tuple[Any, ...], metric: str) -> Any:
    """``metric``'s value in a device's ``reading`` (schema order)."""
    return reading[METRIC_INDEX[metric]]


class Clock:
    """A monotonic clock in ns that stands still until :meth:`advance` moves it."""

    def __init__(self) -> None:
        self.t = 10**12

    def __call__(self) -> int:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += int(seconds * 1e9)


def read_refused(
    fake_nvml: Any, caplog: pytest.LogCaptureFixture, script: str, reads: int
) -> tuple[list[tuple[Any, ...]], dict[str, bool]]:
    """Device 0 of the stand-in NVML scripted with ``script``, its backend's log caught at INFO:
    ``reads`` readings after the open's probe (the stand-in's call counts reset after it) and
    its supported metrics."""
    from charllm_nemo.devices import nvml

    fake_nvml.script(script)
    caplog.set_level(logging.INFO, logger="charllm_nemo.devices")
    with nvml.open_backend() as b:
        dev = b.devices[0]
        fake_nvml.reset_counts()
        readings = [dev.read() for _ in range(reads)]
        supported = dev.supported_metrics()
    return readings, supported


def assert_unavailable_once(
    metrics: Iterable[str],
    readings: list[tuple[Any, ...]],
    supported: dict[str, bool],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each of ``metrics`` is unsupported, None in every reading, and logged as not available
    once."""
    for metric in metrics:
        assert supported[metric] is False
        assert all(value(r, metric) is None for r in readings)
        lines = [r.getMessage() for r in caplog.records if f" {metric} not available" in r.getMessage()]
        assert len(lines) == 1, lines
