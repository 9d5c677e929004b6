"""The synthetic device's thermal limits: harder throttling at its slowdown temperature and a
shutdown that ends its sampling (issue #47: it used to heat without limit, 125-185 C at 0.15 x)."""

from __future__ import annotations

import logging

import pytest

from charllm_nemo.devices import open_backend
from charllm_nemo.devices.synthetic import SyntheticParams
from charllm_nemo.devices.synthetic_config import SyntheticConfig, SyntheticDeviceConfig, synthetic_options
from charllm_nemo.errors import DeviceLost
from charllm_nemo.telemetry.sample_loop import SamplerHealth, run_sample_loop
from charllm_nemo.telemetry.schema import METRIC_INDEX, decode_throttle

P = SyntheticParams()


class Clock:
    """A clock that moves ``step_s`` each time it is read (each read of the device advances it)."""

    def __init__(self, step_s: float = 0.0) -> None:
        self.t = 10**12
        self.step_ns = int(step_s * 1e9)

    def __call__(self) -> int:
        self.t += self.step_ns
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += int(seconds * 1e9)


def _hot(cooling: float, tau_s: float, step_s: float = 0.0):
    cfg = SyntheticConfig(devices={"0": SyntheticDeviceConfig(cooling=cooling, tau_s=tau_s)})
    clock = Clock(step_s)
    options = {**synthetic_options(cfg, 0), "slowdown": False}
    backend = open_backend("synthetic", activity=1.0, clock=clock, **options)
    return backend.devices[0], clock


def _get(reading, name):
    return reading[METRIC_INDEX[name]]


@pytest.mark.parametrize("every_s", [0.01, 0.5, 5.0])
def test_cooled_0_15x_it_throttles_hard_at_its_slowdown_temperature_and_never_shuts_down(every_s):
    # 0.15 x: 0.5 C/W; the old model settled near 189 C (sw_thermal's 0.8 x only). Now the
    # clock is cut to hold the die at 90 C, whatever the interval between reads against tau.
    dev, clock = _hot(0.15, 0.3)
    temps, rows = [], []
    for _ in range(int(60 / every_s)):  # a minute at full activity: longer than a 30-step CPU run
        clock.advance(every_s)
        r = dev.read()
        temps.append(_get(r, "temp_gpu_c"))
        rows.append(r)
    assert max(temps) <= P.slowdown_c + 1e-6
    assert temps[-1] == pytest.approx(P.slowdown_c)
    last = rows[-1]
    names = decode_throttle(_get(last, "throttle_reasons"))
    assert "sw_thermal" in names and "hw_slowdown" not in names and "hw_thermal" not in names
    # held: the power that keeps 0.5 C/W at 90 C, and a clock well under sw_thermal's 0.8 x
    assert _get(last, "power_instant_w") == pytest.approx((P.slowdown_c - P.ambient_c) / 0.5)
    clock_mhz = _get(last, "clock_sm_mhz")
    assert P.clock_max_mhz * 0.8 * P.min_clock_factor < clock_mhz < 0.6 * P.clock_max_mhz


def test_cooled_too_weakly_for_its_floor_it_slows_in_hardware_then_shuts_down_and_says_why():
    # 0.05 x: 1.5 C/W; even the floor (0.25 x of the clock) leaves ~79 W: 148 C steady > 92 C
    dev, clock = _hot(0.05, 3.0)  # from 87 C: ~12 ms to 90 C, then ~0.1 s at its floor to 92 C
    temps, reasons = [], []
    with pytest.raises(DeviceLost) as lost:
        for _ in range(1000):
            clock.advance(0.005)
            r = dev.read()
            temps.append(_get(r, "temp_gpu_c"))
            reasons.append(decode_throttle(_get(r, "throttle_reasons")))
    assert temps and max(temps) < P.shutdown_c  # never a temperature above the shutdown
    assert any("hw_slowdown" in n and "hw_thermal" in n for n in reasons)  # the floor, before it
    message = str(lost.value)
    assert "shut down" in message and f"{P.shutdown_c:g} C" in message and ".cooling" in message
    clock.advance(1.0)
    with pytest.raises(DeviceLost):  # and stays down
        dev.read()
    assert dev.clock_fraction() == 0.0


def test_a_shut_down_device_ends_its_sampling_with_one_clear_line_not_a_traceback(caplog):
    dev, _clock = _hot(0.05, 3.0, step_s=0.005)  # each read: 5 ms later on the device's clock
    health = SamplerHealth(hz=1000.0)
    rows: list = []
    slots = [0]

    def stop() -> bool:
        slots[0] += 1
        return slots[0] > 5000

    with caplog.at_level(logging.ERROR, logger="charllm_nemo.sampler"):
        run_sample_loop([dev], 100_000, health, rows.append, stop, sleep=lambda _s: None)
    assert health.devices_lost == 1 and rows and slots[0] < 5000  # the loop ended with no device left
    assert max(r[4][METRIC_INDEX["temp_gpu_c"]] for r in rows) < P.shutdown_c
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and all(r.exc_info is None for r in errors)  # said in words, no traceback
    assert "device 0 lost (synthetic device 0 shut down" in errors[0].getMessage()
    assert "no device left to sample" in errors[-1].getMessage()
