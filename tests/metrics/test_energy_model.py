"""The dry run's energy model: what it fits, what it predicts, and its error on held-out runs."""

from __future__ import annotations

import random

import pytest

from charllm_nemo.errors import ConfigError
from charllm_nemo.metrics.energy_model import (
    Calibration,
    Point,
    bubble_factor,
    dump_table,
    estimate,
    fit,
    load_table,
    platform_for,
)

TRUE = Calibration("X", 2e-12, 0.05, 80.0, 400.0, 1.2, 450.0, 0, None, None)
"""A made platform: 0.5 TFLOP/s effective, 50 ms a step of overhead, 80 W idle to 400 W busy."""


def measured(flops: float, world: int, pp: int, m: int, noise: float, rng: random.Random) -> Point:
    e = estimate(TRUE, flops, world, pp, m)
    k = 1 + rng.uniform(-noise, noise)
    return Point("r", flops, world, pp, m, e.step_s * k, e.power_avg_w, e.power_peak_w, e.energy_step_j * k)


def test_bubble_lengthens_the_step_not_the_work() -> None:
    assert bubble_factor(1, 8) == 1.0
    assert bubble_factor(4, 4) == pytest.approx(7 / 4)
    one = estimate(TRUE, 1e12, 8, 1, 4)
    four = estimate(TRUE, 1e12, 8, 4, 4)
    assert four.step_s > one.step_s and four.busy_share < one.busy_share
    assert four.power_avg_w < one.power_avg_w  # the bubble idles the device


def test_energy_is_world_times_power_times_time_and_peak_is_capped() -> None:
    e = estimate(TRUE, 5e12, 4, 1, 1)
    assert e.step_s == pytest.approx(2e-12 * 5e12 + 0.05)
    assert e.energy_step_j == pytest.approx(4 * e.power_avg_w * e.step_s)
    assert e.power_peak_w <= 450.0


def test_fit_recovers_the_model_and_its_held_out_error_is_small() -> None:
    rng = random.Random(1)
    pts = [
        measured(f, w, pp, m, 0.05, rng)
        for f, w, pp, m in [
            (1e12, 2, 1, 1),
            (2e12, 2, 2, 4),
            (4e12, 4, 1, 2),
            (8e12, 4, 4, 8),
            (3e12, 8, 2, 2),
            (6e12, 2, 1, 8),
        ]
    ]
    cal = fit("X", pts, 450.0)
    assert cal.runs == 6
    assert cal.s_per_flop == pytest.approx(2e-12, rel=0.15)
    assert cal.held_out_error_median is not None and cal.held_out_error_median < 0.15
    assert cal.held_out_error_max is not None and cal.held_out_error_max < 0.30


def test_held_out_error_reports_a_model_that_does_not_fit() -> None:
    # Energy that has nothing to do with the FLOPs: the held-out error says so.
    rng = random.Random(2)
    pts = [
        Point("r", f, 2, 1, 1, 1.0, 300.0, 350.0, rng.choice([100.0, 2000.0]))
        for f in (1e12, 2e12, 3e12, 4e12, 5e12)
    ]
    assert fit("X", pts).held_out_error_max > 0.5  # type: ignore[operator]


def test_too_few_runs_are_refused() -> None:
    with pytest.raises(ConfigError, match="2 or more runs"):
        fit("X", [Point("r", 1e12, 1, 1, 1, 1.0, 100.0, 120.0, 100.0)])


def test_table_round_trip_and_platform_lookup() -> None:
    table = {"NVIDIA H200": TRUE, "Synthetic accelerator (model, not hardware)": TRUE}
    back = load_table(dump_table(table))
    assert back == table
    assert platform_for(back, "h200", on_cpu=False) is back["NVIDIA H200"]
    assert platform_for(back, None, on_cpu=True) is back["Synthetic accelerator (model, not hardware)"]
    assert platform_for(back, None, on_cpu=False) is None
    assert platform_for(back, "MI300X", on_cpu=False) is None


def test_the_shipped_table_loads() -> None:
    for cal in load_table().values():
        assert cal.runs >= 2 and cal.s_per_flop > 0
