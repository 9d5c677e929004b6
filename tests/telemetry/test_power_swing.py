"""A step window's power swing and ramps (attribution's ``power_swing_w``, ``power_ramp_up_w_s``,
``power_ramp_down_w_s``), on a square wave whose edges are known exactly."""

from __future__ import annotations

import math

import numpy as np

from charllm_nemo.telemetry.attribution import attribute_windows

MS = 1_000_000
FIGS = ("power_swing_w", "power_ramp_up_w_s", "power_ramp_down_w_s", "power_peak_w")


def _square(period_ms: int = 600, low: float = 150.0, high: float = 600.0, n: int = 400) -> dict:
    """100 Hz samples of a square wave, high for the first half of each period, each edge crossed
    within one 10 ms sample period."""
    t = np.arange(n, dtype=np.int64) * 10 * MS
    phase = (t // MS) % period_ms
    p = np.where(phase < period_ms // 2, high, low).astype(np.float64)
    return {"t_mono_ns": t, "power_instant_w": p}


def test_swing_and_ramps_of_a_square_wave_are_its_height_and_edges():
    s = _square()
    # a period and the next rising edge, only a high half, one falling edge
    windows = [(600 * MS, 1210 * MS), (600 * MS, 890 * MS), (850 * MS, 1000 * MS)]
    f = attribute_windows(s, windows, figures=FIGS)
    assert f["power_swing_w"][0] == 450.0
    # each edge is 450 W between two samples 10 ms apart: 45 kW/s, up and down
    assert f["power_ramp_up_w_s"][0] == 45_000.0 and f["power_ramp_down_w_s"][0] == 45_000.0
    assert f["power_swing_w"][1] == 0.0 and f["power_ramp_up_w_s"][1] == 0.0
    assert f["power_ramp_down_w_s"][1] == 0.0
    assert f["power_swing_w"][2] == 450.0
    assert f["power_ramp_up_w_s"][2] == 0.0 and f["power_ramp_down_w_s"][2] == 45_000.0


def test_a_slower_ramp_is_its_slope_and_a_window_with_one_sample_has_none():
    t = np.arange(0, 200, 10, dtype=np.int64) * MS
    p = np.clip(100.0 + (t / MS - 50.0) * 5.0, 100.0, 400.0)  # 5 W/ms from 50 ms to 110 ms
    s = {"t_mono_ns": t, "power_instant_w": p}
    f = attribute_windows(s, [(0, 190 * MS), (95 * MS, 105 * MS), (0, 500 * MS)], figures=FIGS)
    assert f["power_ramp_up_w_s"][0] == 5_000.0 and f["power_ramp_down_w_s"][0] == 0.0
    assert f["power_swing_w"][0] == 300.0
    # one sample inside (100 ms): no swing, no ramp it showed; but it has a peak
    assert math.isnan(f["power_swing_w"][1]) and math.isnan(f["power_ramp_up_w_s"][1])
    assert f["power_peak_w"][1] == 350.0
    # a window past the last sample was not all observed: nothing
    assert math.isnan(f["power_swing_w"][2]) and math.isnan(f["power_ramp_down_w_s"][2])


def test_null_power_samples_are_skipped_not_read_as_a_drop():
    s = _square()
    s["power_instant_w"][70] = np.nan  # inside the low half of the second period
    f = attribute_windows(s, [(600 * MS, 1200 * MS)], figures=FIGS)
    assert f["power_swing_w"][0] == 450.0 and f["power_ramp_down_w_s"][0] == 45_000.0
