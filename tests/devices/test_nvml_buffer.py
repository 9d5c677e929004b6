"""The driver's sample buffers (nvmlDeviceGetSamples) through the real bindings and the stand-in."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import pytest

from charllm_nemo.errors import DeviceLost

pytest.importorskip("pynvml")
nvml = pytest.importorskip("charllm_nemo.devices.nvml")


def _by_metric(batches: list[tuple[str, list[int], list[float]]]) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {}
    for metric, ts, values in batches:
        assert metric not in out, "one batch per metric and read"
        out[metric] = (ts, values)
    return out


def test_new_samples_since_the_last_read_in_metric_units(fake_nvml: Any) -> None:
    fake_nvml.script(
        [
            "0 samples_period_us 5000",
            "0 samples_buffer 4000",
            "0 power_instant_mw 300500",
            "0 clock_sm_mhz 1755",
        ]
    )
    t_open_us = time.time_ns() // 1000
    b = nvml.open_backend()
    try:
        (dev,) = b.devices
        assert dev.identity.extra["driver_buffers"]["metrics"] == ["power_w", "util_gpu_pct", "clock_sm_mhz"]
        assert dev.identity.extra["driver_buffers"]["capacity"]["power_w"] == 4000
        time.sleep(0.1)
        first = _by_metric(dev.read_buffered())
        t_read_us = time.time_ns() // 1000
        ts, watts = first["power_w"]
        # 5 ms apart, all after open (what the buffer held before open is not returned)
        assert 10 <= len(ts) <= (t_read_us - t_open_us) // 5000 + 1
        assert all(b - a == 5000 for a, b in itertools.pairwise(ts))
        assert ts[0] > t_open_us
        assert set(watts) == {300.5}
        assert set(first["clock_sm_mhz"][1]) == {1755.0}
        assert set(first["util_gpu_pct"][1]) == {97.0}
        time.sleep(0.03)
        second = _by_metric(dev.read_buffered())
        ts2 = second["power_w"][0]
        assert ts2[0] == ts[-1] + 5000, "no sample twice, none skipped"
        assert dev.buffers.health.full["power_w"] == 0
        assert dev.buffers.health.samples["power_w"] == len(ts) + len(ts2)
    finally:
        b.close()
    with pytest.raises(DeviceLost):
        dev.read_buffered()


def test_the_buffer_sees_peaks_between_polls(fake_nvml: Any) -> None:
    # 300 W and 650 W alternating every 2 ms; the buffer samples every 1 ms
    fake_nvml.script(
        [
            "0 samples_period_us 1000",
            "0 power_instant_mw 300000",
            "0 power_square_mw 650000",
            "0 power_period_ms 4",
        ]
    )
    b = nvml.open_backend()
    try:
        time.sleep(0.05)
        watts = _by_metric(b.devices[0].read_buffered())["power_w"][1]
        assert max(watts) == 650.0 and min(watts) == 300.0
        assert 0.3 < sum(1 for w in watts if w == 650.0) / len(watts) < 0.7
    finally:
        b.close()


def test_a_buffer_that_wrapped_is_counted(fake_nvml: Any) -> None:
    fake_nvml.script(["0 samples_period_us 1000", "0 samples_buffer 8"])
    b = nvml.open_backend()
    try:
        time.sleep(0.05)
        ts, _ = _by_metric(b.devices[0].read_buffered())["power_w"]
        assert 8 <= len(ts) <= 16  # the newest 8, plus any taken while draining
        assert b.devices[0].buffers.health.full["power_w"] >= 1
    finally:
        b.close()


@pytest.mark.parametrize(
    "line",
    [
        "0 samples_period_us 0",
        "0 fn:nvmlDeviceGetSamples FUNCTION_NOT_FOUND",
        "0 fn:nvmlDeviceGetSamples NOT_SUPPORTED",
    ],
)
def test_no_buffers_means_nothing_to_read(fake_nvml: Any, line: str) -> None:
    fake_nvml.script([line])
    b = nvml.open_backend()
    try:
        dev = b.devices[0]
        assert dev.buffers is None and dev.read_buffered() == []
        assert "driver_buffers" not in dev.identity.extra
        assert dev.read()[0] is not None  # the polled metrics are untouched
    finally:
        b.close()


def test_one_buffer_failing_leaves_the_others(fake_nvml: Any, caplog: pytest.LogCaptureFixture) -> None:
    fake_nvml.script(["0 samples_period_us 2000"])
    b = nvml.open_backend()
    try:
        dev = b.devices[0]
        fake_nvml.set(0, "util_gpu_pct", "UNKNOWN")
        time.sleep(0.02)
        with caplog.at_level(logging.WARNING, logger="charllm_nemo.devices"):
            got = _by_metric(dev.read_buffered())
            dev.read_buffered()
        assert set(got) == {"power_w", "clock_sm_mhz"}
        assert dev.buffers.health.errors["util_gpu_pct"] == 2
        assert sum("util_gpu_pct" in r.getMessage() for r in caplog.records) == 1
        fake_nvml.set(0, "lost", 1)
        with pytest.raises(DeviceLost):
            dev.read_buffered()
    finally:
        b.close()
