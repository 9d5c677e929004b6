"""The sampler: rate, timestamps, health, and that nothing it meets reaches the caller."""

from __future__ import annotations

import time
from unittest import mock

import numpy as np
import pytest

from charllm_nemo.devices.base import DeviceIdentity
from charllm_nemo.errors import ConfigError, DeviceLost
from charllm_nemo.telemetry import sample_loop
from charllm_nemo.telemetry.reader import to_arrays
from charllm_nemo.telemetry.sample_loop import (
    AUTO_EVERY,
    SamplerHealth,
    counter_every,
    counter_read_cost_ns,
    effective_counter_every,
    measured_counter_every,
    run_sample_loop,
)
from charllm_nemo.telemetry.sampler import SAMPLES_SCHEMA, Sampler, rows_to_table, validate_hz
from charllm_nemo.telemetry.schema import INT_NULL, METRIC_NAMES, METRICS


class ScriptedDevice:
    """A device whose reading is fixed; it can be told to die after n reads."""

    def __init__(self, index: int = 0, lose_after: int | None = None, boom_after: int | None = None) -> None:
        self.identity = DeviceIdentity(index=index, name="scripted", vendor="test", backend="test")
        self.reads = 0
        self.lose_after = lose_after
        self.boom_after = boom_after
        self.reading = tuple(
            (100.0 + i if m.kind == "float" else 2**40 + i) if i % 3 else None for i, m in enumerate(METRICS)
        )

    def read(self):
        self.reads += 1
        if self.lose_after is not None and self.reads > self.lose_after:
            raise DeviceLost("gone")
        if self.boom_after is not None and self.reads > self.boom_after:
            raise RuntimeError("backend bug")
        return self.reading

    def supported_metrics(self):
        return dict.fromkeys(METRIC_NAMES, True)


class GaugedDevice(ScriptedDevice):
    """A ScriptedDevice that also reads without its cumulative counters, as NvmlDevice does."""

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        self.gauge_reads = 0
        self.reading = tuple(100.0 + i if m.kind == "float" else 2**40 + i for i, m in enumerate(METRICS))

    def read_gauges(self):
        self.gauge_reads += 1
        return tuple(None if m.cumulative else v for m, v in zip(METRICS, self.reading, strict=True))


class _StepClock:
    """The sample loop's ``time``: every read of the clock moves it 1 µs, so a slot never runs a
    period late however the machine schedules the test (a descheduled test skipped slots)."""

    def __init__(self) -> None:
        self.ns = 10**12

    def monotonic_ns(self) -> int:
        self.ns += 1_000
        return self.ns

    def time_ns(self) -> int:
        return self.monotonic_ns() + 1_700_000_000 * 10**9

    perf_counter_ns = monotonic_ns


def _loop(devices, slots: int, every: int):
    """run_sample_loop for ``slots`` slots (no waiting, on a clock of its own), then its final
    sample: the rows, the times on_slot was told, the health."""
    rows, told, h = [], [], SamplerHealth(hz=100.0)
    with mock.patch.object(sample_loop, "time", _StepClock()):
        run_sample_loop(
            devices,
            10_000_000,
            h,
            rows.append,
            lambda: h.slots >= slots,
            sleep=lambda s: None,
            on_slot=told.append,
            counter_every=every,
        )
    return rows, told, h


def test_counters_are_read_on_every_nth_slot_and_live_figures_follow_only_those():
    gauged, plain = GaugedDevice(0), ScriptedDevice(1)
    rows, told, h = _loop([gauged, plain], slots=12, every=5)
    # slots 0, 5 and 10 read the gauged device whole, the others through read_gauges; the final
    # sample at stop is whole too; the device without read_gauges is read whole every time.
    assert gauged.reads == 4 and gauged.gauge_reads == 9 and plain.reads == 13
    assert h.counter_every == 5
    energy = METRIC_NAMES.index("energy_mj")
    whole = [i for i, r in enumerate(r for r in rows if r[3] == 0) if r[4][energy] is not None]
    assert whole == [0, 5, 10, 12]
    # on_slot hears only of the whole slots (a counter delta needs a value past the window's end)
    firsts = [r[0] for r in rows if r[3] == 0]
    assert told == [firsts[i] for i in whole]


def test_every_slot_is_whole_without_a_gauged_device_or_with_counter_every_1():
    for devices, every in (([ScriptedDevice(0)], 5), ([GaugedDevice(0)], 1)):
        rows, told, h = _loop(devices, slots=6, every=every)
        assert len(told) == len(rows) == 7 and h.counter_every == 1
        assert devices[0].reads == 7


@pytest.mark.parametrize(
    ("hz", "counter_hz", "every"), [(100, 10, 10), (100, None, AUTO_EVERY), (100, 300, 1), (50, 20, 2)]
)
def test_counter_every_is_the_nearest_whole_ratio(hz, counter_hz, every):
    assert counter_every(hz, counter_hz) == every


@pytest.mark.parametrize("bad", [0, -1, "often", float("nan")])
def test_a_counter_rate_that_is_not_positive_is_refused_naming_the_field(bad):
    with pytest.raises(ConfigError, match=r"telemetry\.counter_hz"):
        counter_every(100.0, bad)


@pytest.mark.parametrize("hz", [0, 0.5, 1000.5, 5000, "fast", None])
def test_rates_outside_1hz_to_1khz_are_refused_with_the_range(hz):
    with pytest.raises(ConfigError, match=r"telemetry\.hz.*\[1, 1000\]"):
        validate_hz(hz)


def test_samples_arrive_at_the_requested_rate_with_monotonic_timestamps():
    dev = ScriptedDevice()
    s = Sampler([dev], hz=200)
    s.start()
    time.sleep(0.5)
    s.stop()
    rows = s.take_rows()
    # 0.5 s at 200 Hz: ~100 samples; a loaded CI machine may lose some, never gain many.
    assert 60 <= len(rows) <= 105
    t = np.array([r[0] for r in rows])
    assert (np.diff(t) > 0).all()
    assert np.median(np.diff(t)) == pytest.approx(5e6, rel=0.2)
    h = s.health
    assert h.samples == len(rows) and h.slots >= h.samples - 1  # + the final sample taken at stop
    assert h.read_ns_total > 0 and h.stop_reason == "stopped"
    assert s.take_rows() == []  # taken rows are gone


def test_a_lost_device_stops_its_sampling_and_nothing_raises():
    lost, fine = ScriptedDevice(0, lose_after=5), ScriptedDevice(1)
    s = Sampler([lost, fine], hz=500)
    s.start()
    time.sleep(0.2)
    s.stop()
    rows = s.take_rows()
    by_dev = {0: 0, 1: 0}
    for r in rows:
        by_dev[r[3]] += 1
    assert by_dev[0] == 5 and by_dev[1] > 20
    assert s.health.devices_lost == 1


def test_the_sampler_stops_itself_when_every_device_is_gone():
    s = Sampler([ScriptedDevice(0, boom_after=3)], hz=500)
    s.start()
    time.sleep(0.2)
    assert not s.running
    assert s.health.errors == 1 and s.health.stop_reason == "no devices left"
    assert len(s.take_rows()) == 3


def test_rows_become_a_table_with_nulls_and_full_64_bit_ints():
    dev = ScriptedDevice()
    rows = [(1000 + i, 5000 + i, 7, 0, dev.read()) for i in range(3)]
    table = rows_to_table(rows, "test")
    assert table.schema == SAMPLES_SCHEMA
    arrays = to_arrays(table)
    for i, m in enumerate(METRICS):
        col = arrays[m.name]
        if dev.reading[i] is None:
            assert (np.isnan(col) if m.kind == "float" else col == INT_NULL).all(), m.name
            assert table.column(m.name).null_count == 3
        else:
            assert (col == dev.reading[i]).all(), m.name
    assert arrays["energy_mj"].dtype == np.int64
    assert table.column("source").to_pylist() == ["test"] * 3
    assert rows_to_table([], "x").num_rows == 0


class _Clock:
    """A clock that only the devices move: each read costs what the device says."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


@pytest.mark.parametrize(("whole_ns", "every"), [(3_000_000, 10), (20_000, 1), (312_000, 2)])
def test_a_derived_counter_rate_keeps_counter_reads_within_their_budget(whole_ns, every):
    # At 100 Hz the counters may take 3 % of a core: a whole read 3 ms dearer than a gauge read
    # (an H200's energy counter) is affordable every 10th slot (10 Hz), one 20 us dearer (the
    # synthetic device, the NVML stand-in) with every slot, 312 us every 2nd.
    clock = _Clock()

    class Costly(GaugedDevice):
        def read(self):
            clock.now += whole_ns + 13_000
            return super().read()

        def read_gauges(self):
            clock.now += 13_000
            return super().read_gauges()

    cost = counter_read_cost_ns([Costly(0), ScriptedDevice(1)], clock=clock)
    assert cost == whole_ns  # the device without read_gauges costs nothing extra
    assert measured_counter_every(100.0, cost) == every
    # Without a device that reads its counters apart nothing is measured: every slot is whole.
    assert effective_counter_every([ScriptedDevice(0)], AUTO_EVERY, 100.0) == 1
