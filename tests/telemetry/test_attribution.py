"""Attribution of one device's samples to training windows, checked on hand-computed traces.

Times are int64 ns (S = one second); every test says the physics it checks.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.deadline import deadline

from charllm_nemo.telemetry.attribution import (
    ATTRIBUTION_COLUMN_NAMES,
    ATTRIBUTION_COLUMNS,
    ENERGY_METHODS,
    attribute_windows,
    counter_delta,
    energy_from_counter,
    held_time,
    integrate_power,
    prepare_samples,
    sample_columns,
)
from charllm_nemo.telemetry.schema import (
    FLOAT_METRICS,
    INT_METRICS,
    INT_NULL,
    LIMITING_REASONS,
    THROTTLE_BITS,
    THROTTLE_REASONS,
    VIOLATION_COUNTERS,
)

S = 1_000_000_000
MS = 1_000_000


def step_power(t_ns: np.ndarray) -> np.ndarray:
    """100 W before t = 1 s, 300 W from t = 1 s on."""
    return np.where(t_ns < S, 100.0, 300.0)


def edge_sampled(times_ns: list[int] | np.ndarray) -> dict[str, np.ndarray]:
    """The power step sampled at the given times plus 1 ns either side of the step, and at 0 and 2 s,
    so the trapezoid's ramp across the step lasts 1 ns (an error of 200 W x 1 ns / 2 = 1e-7 J)."""
    t = np.unique(np.concatenate([np.asarray(times_ns, dtype=np.int64), [0, S - 1, S, 2 * S]]))
    return {"t_mono_ns": t, "power_instant_w": step_power(t)}


def one(samples: dict[str, Any], t0: int, t1: int | None) -> dict[str, Any]:
    """Attribute a single window and return scalars."""
    out = attribute_windows(samples, [(t0, t1)])
    return {k: v[0] for k, v in out.items()}


# ------------------------------------------------------------------ energy from the power timeline


@pytest.mark.parametrize(
    "times",
    [
        pytest.param(np.arange(0, 2 * S + 1, MS), id="fine-1ms"),
        pytest.param([], id="coarse-edges-only"),
        pytest.param(np.sort(np.random.default_rng(7).integers(0, 2 * S, 37)), id="uneven-random"),
    ],
)
def test_energy_of_a_power_step_is_its_area(times: Any) -> None:
    # 100 W for 1 s, then 300 W for 1 s: 400 J, whichever way it is sampled, as long as the step
    # itself is resolved (samples 1 ns either side of it).
    samples = edge_sampled(times)
    assert integrate_power(samples["t_mono_ns"], samples["power_instant_w"], 0, 2 * S)[0] == pytest.approx(
        400.0, abs=1e-6
    )
    w = one(samples, 0, 2 * S)
    assert w["energy_method"] == "power_trapezoid"
    assert w["energy_j"] == pytest.approx(400.0, abs=1e-6)
    assert w["power_avg_w"] == pytest.approx(200.0, abs=1e-6)
    assert w["power_timeline_avg_w"] == pytest.approx(200.0, abs=1e-6)
    assert w["power_peak_w"] == 300.0
    assert w["duration_s"] == 2.0


def test_trapezoid_across_an_unresolved_step_by_hand() -> None:
    # Samples straddling the step at 0.9 s and 1.3 s: the trapezoid ramps 100 -> 300 W over 0.4 s,
    # 100*0.9 + 200*0.4 + 300*0.7 = 380 J (the true 400 J is not knowable from these samples).
    # Straddling symmetrically (0.75, 1.25 s) the ramp's area equals the step's: 400 J.
    t = np.array([0, 9 * S // 10, 13 * S // 10, 2 * S])
    p = np.array([100.0, 100.0, 300.0, 300.0])
    assert integrate_power(t, p, 0, 2 * S)[0] == pytest.approx(380.0, rel=1e-12)
    t = np.array([0, 3 * S // 4, 5 * S // 4, 2 * S])
    assert integrate_power(t, p, 0, 2 * S)[0] == pytest.approx(400.0, rel=1e-12)


def test_partial_segments_at_both_edges_are_integrated() -> None:
    # [0.5, 1.5] s over the step: 0.5 s at 100 W + 0.5 s at 300 W = 200 J; [0.25, 0.5] s: 25 J;
    # a window inside one coarse 0 -> 2 s ramp from 100 to 300 W: the line's area.
    samples = edge_sampled([])
    t, p = samples["t_mono_ns"], samples["power_instant_w"]
    e = integrate_power(t, p, [S // 2, S // 4], [3 * S // 2, S // 2])
    assert e == pytest.approx([200.0, 25.0], abs=1e-6)
    ramp_t, ramp_p = np.array([0, 2 * S]), np.array([100.0, 300.0])
    # P(t) = 100 + 100 t; over [0.5, 1.5]: 100 + 100 * (1.5^2 - 0.5^2) / 2 = 200 J
    assert integrate_power(ramp_t, ramp_p, S // 2, 3 * S // 2)[0] == pytest.approx(200.0, rel=1e-12)


def test_window_shorter_than_sampling_period_is_interpolated_and_flagged() -> None:
    # Samples 1 s apart, 100 W at 0 and 300 W at 1 s; a 100 ms window at [0.25, 0.35] s holds no
    # sample: power there is the line, 160 W at the midpoint, so 16 J; flagged, not dropped.
    samples = {"t_mono_ns": np.array([0, S]), "power_instant_w": np.array([100.0, 300.0])}
    w = one(samples, S // 4, 35 * S // 100)
    assert w["interpolated"]
    assert w["n_samples"] == 0
    # One stretch of 1 s with a 1 s period: not a gap (<= 2 periods), so the window is covered;
    # the longest interval without a sample inside it is the whole 0.1 s window.
    assert w["coverage"] == 1.0
    assert w["gap_max_s"] == pytest.approx(0.1)
    assert w["energy_method"] == "power_trapezoid"
    assert w["energy_j"] == pytest.approx(160.0 * 0.1, rel=1e-12)
    assert w["power_avg_w"] == pytest.approx(160.0, rel=1e-12)
    # No sample inside: no peak (an interpolated edge is not a value the device showed), and the
    # energy's bound is the line's worst case over a part of one segment: 200 W x 0.1 s.
    assert np.isnan(w["power_peak_w"])
    assert w["energy_bound_j"] == pytest.approx(200.0 * 0.1, rel=1e-12)


def test_zero_length_window_has_no_energy_and_the_instant_power() -> None:
    # A window of no duration at 0.5 s on a 100 -> 300 W line: 0 J, power 200 W at that instant.
    samples = {"t_mono_ns": np.array([0, S]), "power_instant_w": np.array([100.0, 300.0])}
    w = one(samples, S // 2, S // 2)
    assert w["energy_j"] == 0.0
    assert w["power_avg_w"] == pytest.approx(200.0)
    assert w["duration_s"] == 0.0


def test_peak_power_is_the_highest_sample_inside_never_an_edge() -> None:
    # 100 W at 0, 300 W at 1 s, 100 W at 2 s: [0.5, 1.5] s holds the 300 W sample; [1.2, 1.4] s
    # holds none, so it has no peak (before: the interpolated edge, 260 W, that no sample showed);
    # [0.9 s, 2 s) holds 300 W and not the 2 s sample (the end is exclusive).
    samples = {"t_mono_ns": np.array([0, S, 2 * S]), "power_instant_w": np.array([100.0, 300.0, 100.0])}
    out = attribute_windows(samples, [(S // 2, 3 * S // 2), (12 * S // 10, 14 * S // 10), (0, S // 2)])
    assert out["power_peak_w"][0] == 300.0
    assert np.isnan(out["power_peak_w"][1])
    # [0, 0.5 s) holds only the 100 W sample: the peak is 100 W although the line reaches 200 W.
    assert out["power_peak_w"][2] == 100.0


# ------------------------------------------------------------------ energy from the hardware counter


def counter_trace(offset_mj: int = 123_456_789_000) -> dict[str, np.ndarray]:
    """The 100 W / 300 W step sampled every 10 ms from 0 to 2 s, with an energy counter that ticks
    every 50 ms (a sample at a tick already reads the new value) and an instant power reading that
    is deliberately wrong (1000 W), so a figure that used it would show."""
    t = np.arange(0, 2 * S + 1, 10 * MS, dtype=np.int64)
    tick = (t // (50 * MS)) * (50 * MS)
    # energy at a tick: 100 W until 1 s, 300 W after; in mJ, exact integers
    e_mj = np.where(tick <= S, 100 * tick // MS, 100 * S // MS + 300 * (tick - S) // MS)
    return {
        "t_mono_ns": t,
        "energy_mj": (e_mj + offset_mj).astype(np.int64),
        "power_instant_w": np.full(t.size, 1000.0),
    }


def test_counter_energy_is_exact_for_aligned_and_unaligned_windows() -> None:
    # Ticks every 50 ms on the 100/300 W step: [0.1, 1.9] s starts and ends on ticks, so it is all
    # counter: 0.9 s x 100 W + 0.9 s x 300 W = 360 J. [0.125, 1.875] s: the counter between its
    # first and last tick inside (0.15 and 1.85 s: 85 + 255 = 340 J) plus the instant power over
    # the two 25 ms edges (deliberately 1000 W here: 2 x 25 J) = 390 J.
    samples = counter_trace()
    out = attribute_windows(samples, [(S // 10, 19 * S // 10), (125 * MS, 1875 * MS)])
    assert list(out["energy_method"]) == ["counter", "counter"]
    assert out["energy_j"] == pytest.approx([360.0, 390.0], rel=1e-12)
    # power_avg_w follows energy_j; the timeline average shows the (wrong) instant power
    assert out["power_avg_w"] == pytest.approx([360.0 / 1.8, 390.0 / 1.75], rel=1e-12)
    assert out["power_timeline_avg_w"] == pytest.approx([1000.0, 1000.0])
    # Without a power timeline the edges come from the line through the ticks: 87.5 + 262.5 J
    t, e = samples["t_mono_ns"], samples["energy_mj"]
    assert energy_from_counter(t, e, [125 * MS], [1875 * MS]) == pytest.approx([350.0], rel=1e-12)
    with_power = energy_from_counter(t, e, [125 * MS], [1875 * MS], power_w=samples["power_instant_w"])
    assert with_power == pytest.approx([390.0], rel=1e-12)


def test_window_shorter_than_the_counter_period_falls_back_to_power() -> None:
    # [0.51, 0.54] s lies between the ticks at 0.50 and 0.55 s: the counter says nothing about it,
    # so the energy is the instant power's trapezoid, 1000 W x 0.03 s = 30 J, and says so.
    w = one(counter_trace(), 510 * MS, 540 * MS)
    assert w["energy_method"] == "power_trapezoid"
    assert w["energy_j"] == pytest.approx(30.0, rel=1e-12)


def test_a_window_needs_two_counter_ticks_inside_to_use_the_counter() -> None:
    # [0.49, 0.56] s holds the ticks at 0.50 and 0.55 s: one whole counter interval, 0.05 s x
    # 100 W = 5 J, plus the (deliberately wrong, 1000 W) instant power over the two 10 ms edges,
    # 20 J: 25 J by the counter. Asked for three ticks, it is the power timeline's 70 J.
    w = one(counter_trace(), 490 * MS, 560 * MS)
    assert w["energy_method"] == "counter" and w["energy_j"] == pytest.approx(25.0)
    out = attribute_windows(counter_trace(), [(490 * MS, 560 * MS)], min_counter_ticks=3)
    assert out["energy_method"][0] == "power_trapezoid" and out["energy_j"][0] == pytest.approx(70.0)
    # one tick inside ([0.52, 0.57] s holds 0.55 s only): no whole interval, the power timeline
    assert one(counter_trace(), 520 * MS, 570 * MS)["energy_method"] == "power_trapezoid"


def test_the_counter_needs_no_tick_outside_the_window_when_power_covers_the_edges() -> None:
    # A window from the first sample (which is no tick: when its value was set is unknown):
    # the counter from the first tick inside (0.05 s) to 1 s, 95 J, plus the instant power over
    # [0, 0.05] s, 50 J. Live figures, computed before any tick after the window exists, are the
    # same as those computed later.
    w = one(counter_trace(), 0, S)
    assert w["energy_method"] == "counter" and w["energy_j"] == pytest.approx(145.0)
    # with no power timeline the ends must interpolate between ticks: none before 0 s
    no_power = {k: v for k, v in counter_trace().items() if k != "power_instant_w"}
    assert one(no_power, 0, S)["energy_method"] == "none"
    assert one(no_power, 125 * MS, 1875 * MS)["energy_j"] == pytest.approx(350.0)


def test_counter_reset_is_a_break_never_negative_energy() -> None:
    # The counter drops back to ~0 at 1 s (driver reload): a window across the drop falls back to
    # power; windows wholly before or after it still use the counter.
    samples = counter_trace()
    e = samples["energy_mj"].copy()
    after = samples["t_mono_ns"] >= S
    e[after] -= e[after][0] - 7  # the post-reset counter starts near 7 mJ and keeps the slope
    samples["energy_mj"] = e
    windows = [(S // 2, 3 * S // 2), (S // 10, 9 * S // 10), (11 * S // 10, 19 * S // 10)]
    out = attribute_windows(samples, windows)
    assert list(out["energy_method"]) == ["power_trapezoid", "counter", "counter"]
    assert out["energy_j"] == pytest.approx([1000.0, 80.0, 240.0], rel=1e-12)
    assert np.all(out["energy_j"] >= 0)


def test_energy_falls_back_to_averaged_power_then_to_none() -> None:
    # No counter and no instant power: the vendor's averaged power (a steady 250 W) gives 250 J/s;
    # without any power reading there is no energy at all, rather than a made-up one.
    t = np.array([0, S, 2 * S])
    w = one({"t_mono_ns": t, "power_avg_w": np.full(3, 250.0)}, S // 2, 3 * S // 2)
    assert w["energy_method"] == "power_avg_trapezoid"
    assert w["energy_j"] == pytest.approx(250.0)
    assert np.isnan(w["power_peak_w"])  # a peak of a 1 s average is not a peak
    w = one({"t_mono_ns": t}, S // 2, 3 * S // 2)
    assert w["energy_method"] == "none"
    assert np.isnan(w["energy_j"]) and np.isnan(w["power_avg_w"])


# ------------------------------------------------------------------ edge cases of windows and samples


def test_empty_window_list_gives_empty_columns() -> None:
    # No windows: every column present, each empty, with its dtype.
    as_columns = {"t_begin_mono_ns": np.array([], np.int64), "t_end_mono_ns": np.array([], np.int64)}
    no_pairs: list[tuple[int, int]] = []
    for windows in (no_pairs, as_columns):
        out = attribute_windows(edge_sampled([]), windows)
        assert tuple(out) == ATTRIBUTION_COLUMN_NAMES
        assert all(v.shape == (0,) for v in out.values())
        assert out["n_samples"].dtype == np.int64 and out["interpolated"].dtype == bool


def test_empty_samples_give_nan_figures_and_method_none() -> None:
    # Nothing was sampled: nothing is known about the window except its duration.
    w = one({"t_mono_ns": np.array([], np.int64), "power_instant_w": np.array([])}, 0, S)
    assert w["energy_method"] == "none" and w["n_samples"] == 0 and not w["interpolated"]
    assert w["duration_s"] == 1.0
    for name, value in w.items():
        if name not in ("duration_s", "n_samples", "coverage", "gap_max_s", "interpolated", "energy_method"):
            assert np.isnan(value), name


@pytest.mark.parametrize(
    ("t0", "t1"),
    [(-2 * S, -S), (3 * S, 4 * S), (-S // 2, S // 2), (3 * S // 2, 5 * S // 2)],
    ids=["before", "after", "straddles-first", "straddles-last"],
)
def test_no_extrapolation_outside_the_sampled_span(t0: int, t1: int) -> None:
    # The samples cover 0 .. 2 s; a window reaching outside that gets no figures, not a guess.
    samples = edge_sampled([])
    samples["temp_gpu_c"] = np.full(samples["t_mono_ns"].size, 60.0)
    w = one(samples, t0, t1)
    assert w["energy_method"] == "none"
    assert np.isnan(w["energy_j"]) and np.isnan(w["power_peak_w"]) and np.isnan(w["temp_gpu_peak_c"])
    assert not w["interpolated"]


def test_open_and_reversed_windows_are_invalid() -> None:
    # A window still open (null end) or ending before it begins has no figures at all.
    samples = edge_sampled([])
    by_pairs = attribute_windows(samples, [(0, None), (S, S // 2), (0, S)])
    by_columns = attribute_windows(
        samples, {"t_begin_mono_ns": np.array([0, S, 0]), "t_end_mono_ns": np.array([INT_NULL, S // 2, S])}
    )
    for out in (by_pairs, by_columns):
        assert list(out["energy_method"]) == ["invalid", "invalid", "power_trapezoid"]
        assert np.isnan(out["energy_j"][:2]).all() and np.isnan(out["duration_s"][:2]).all()
        assert list(out["n_samples"][:2]) == [0, 0]
        assert out["energy_j"][2] == pytest.approx(100.0, abs=1e-6)
    assert set(by_pairs["energy_method"]) <= set(ENERGY_METHODS)


def test_clock_going_backwards_and_duplicate_timestamps() -> None:
    # Two segments concatenated out of order, with a sample repeated at the seam: after sorting
    # and dropping the repeat the trace is the plain step again, 400 J over [0, 2 s].
    good = edge_sampled(np.arange(0, 2 * S + 1, 100 * MS))
    t, p = good["t_mono_ns"], good["power_instant_w"]
    half = t.size // 2
    order = np.concatenate([np.arange(half, t.size), np.arange(0, half + 1)])  # sample `half` twice
    shuffled = {"t_mono_ns": t[order], "power_instant_w": p[order]}
    prepared, diag = prepare_samples(shuffled)
    assert diag["n_input"] == t.size + 1 and diag["n_output"] == t.size
    assert diag["n_duplicates_dropped"] == 1 and diag["n_backward_steps"] == 1
    assert diag["n_reordered"] > 0
    np.testing.assert_array_equal(prepared["t_mono_ns"], t)
    assert one(shuffled, 0, 2 * S)["energy_j"] == pytest.approx(400.0, abs=1e-6)
    _, clean = prepare_samples(good)
    assert clean["n_reordered"] == clean["n_duplicates_dropped"] == 0


def test_helpers_refuse_unsorted_times() -> None:
    # The helpers take a prepared timeline; unsorted input is a caller error, said plainly.
    with pytest.raises(ValueError, match="prepare_samples"):
        integrate_power([0, 2, 1], [1.0, 1.0, 1.0], 0, 1)
    with pytest.raises(ValueError, match="t_mono_ns"):
        attribute_windows({"power_instant_w": np.ones(3)}, [(0, 1)])


# ------------------------------------------------------------------ throttle, counters, other metrics


def test_throttle_bit_set_for_0_3_s_inside_a_1_s_window() -> None:
    # sw_power_cap is read set at 0.2 s and clear again at 0.5 s; held between samples, that is
    # 0.3 s of [0, 1 s]. hw_thermal from 0.4 to 0.7 s overlaps it: any limiting reason 0.2..0.7 s,
    # 0.5 s. idle, set 0.8..1 s, is not a limiting reason.
    t = np.arange(0, 11) * (S // 10)
    mask = np.zeros(t.size, dtype=np.int64)
    mask[2:5] |= THROTTLE_BITS["sw_power_cap"]
    mask[4:7] |= THROTTLE_BITS["hw_thermal"]
    mask[8:] |= THROTTLE_BITS["idle"]
    w = one({"t_mono_ns": t, "throttle_reasons": mask}, 0, S)
    assert w["throttle_sw_power_cap_s"] == pytest.approx(0.3, abs=1e-12)
    assert w["throttle_hw_thermal_s"] == pytest.approx(0.3, abs=1e-12)
    assert w["throttle_idle_s"] == pytest.approx(0.2, abs=1e-12)
    assert w["throttle_any_limiting_s"] == pytest.approx(0.5, abs=1e-12)
    assert w["throttle_hw_slowdown_s"] == 0.0
    # the hold is intersected with the window: [0.3, 0.45] s sees 0.15 s of sw_power_cap
    flags = (mask & THROTTLE_BITS["sw_power_cap"]) != 0
    assert held_time(t, flags, 3 * S // 10, 45 * S // 100)[0] == pytest.approx(0.15, abs=1e-12)


def test_every_throttle_reason_at_once_equals_each_reason_on_its_own() -> None:
    # attribute_windows computes all reasons in one pass (one column per bit); held_time does one.
    rng = np.random.default_rng(7)
    t = np.cumsum(rng.integers(5_000_000, 15_000_000, 200)).astype(np.int64)
    mask = rng.integers(0, 1 << 12, t.size).astype(np.int64)
    mask[rng.random(t.size) < 0.1] = INT_NULL  # nulls are skipped, as for one reason
    t0 = rng.integers(t[0], t[-1], 40)
    t1 = np.minimum(t0 + rng.integers(0, 400_000_000, 40), t[-1] + 1)  # some past the last sample
    windows = {"t_begin_mono_ns": t0, "t_end_mono_ns": t1}
    got = attribute_windows({"t_mono_ns": t, "throttle_reasons": mask}, windows)
    ok = mask != INT_NULL
    for name, bit in THROTTLE_REASONS:
        alone = held_time(t[ok], (mask[ok] & bit) != 0, t0, t1)
        np.testing.assert_array_equal(got[f"throttle_{name}_s"], alone)
    limiting = (mask[ok][:, None] & np.array([THROTTLE_BITS[n] for n in LIMITING_REASONS])).any(axis=1)
    np.testing.assert_array_equal(got["throttle_any_limiting_s"], held_time(t[ok], limiting, t0, t1))
    assert np.isnan(got["throttle_idle_s"]).any() and not np.isnan(got["throttle_idle_s"]).all()


def test_64_bit_traffic_counter_gives_exact_integer_deltas() -> None:
    # Counters near 2**62, where float64 cannot tell 2**62 from 2**62 + 1: deltas between samples
    # are exact integers; an edge half-way along a 2-byte segment adds exactly 1 byte.
    base = 2**62
    t = np.array([0, S, 2 * S, 3 * S])
    c = np.array([base + 1, base + 12_345_678_902, base + 12_345_678_904, base + 12_345_678_904], np.int64)
    d = counter_delta(t, c, [0, S, 0, S + S // 2], [S, 2 * S, 3 * S, 2 * S])
    assert d.tolist() == [12_345_678_901.0, 2.0, 12_345_678_903.0, 1.0]
    w = one({"t_mono_ns": t, "pcie_tx_bytes": c, "nvlink_rx_bytes": c}, 0, S)
    assert w["pcie_tx_bytes"] == 12_345_678_901 and w["nvlink_rx_bytes"] == 12_345_678_901
    assert np.isnan(w["pcie_rx_bytes"])  # not sampled at all


def test_counter_decrease_gives_nan_not_a_negative_delta() -> None:
    # A traffic counter that wraps (drops) inside the window: the delta is unknown, so NaN.
    t = np.array([0, S, 2 * S])
    c = np.array([1000, 10, 20])
    assert np.isnan(counter_delta(t, c, 0, 2 * S)[0])
    assert counter_delta(t, c, S, 2 * S)[0] == 10.0


def test_violation_counters_are_reported_in_seconds() -> None:
    # violation_power_ns grows by 0.25 s over [0, 1 s], violation_thermal_ns by 10 ms.
    t = np.array([0, S])
    samples = {
        "t_mono_ns": t,
        "violation_power_ns": np.array([5 * S, 5 * S + S // 4]),
        "violation_thermal_ns": np.array([0, 10 * MS]),
    }
    w = one(samples, 0, S)
    assert w["violation_power_s"] == pytest.approx(0.25) and w["violation_thermal_s"] == pytest.approx(0.01)


def test_every_per_reason_counter_gives_its_window_time() -> None:
    # Counter k grows by k ms over [0, 1 s]; a counter that resets inside the window is NaN, a
    # counter with no values NaN, never 0.
    t = np.array([0, S // 2, S])
    samples: dict[str, np.ndarray] = {"t_mono_ns": t}
    names = [name for name, _ in VIOLATION_COUNTERS]
    for k, name in enumerate(names[:-2], start=1):
        samples[f"violation_{name}_ns"] = np.array([2**62, 2**62 + k * MS // 2, 2**62 + k * MS])
    samples[f"violation_{names[-2]}_ns"] = np.array([3 * S, 0, 10])  # reset (driver reload)
    w = one(samples, 0, S)
    for k, name in enumerate(names[:-2], start=1):
        assert w[f"violation_{name}_s"] == pytest.approx(k / 1000, abs=1e-12), name
    assert np.isnan(w[f"violation_{names[-2]}_s"]) and np.isnan(w[f"violation_{names[-1]}_s"])


def test_temperatures_and_clocks() -> None:
    # SM clock 1000 MHz at 0 s rising linearly to 2000 MHz at 1 s: mean over [0, 1 s] is 1500 MHz;
    # over [0.5, 1 s] there is no sample inside (the end is exclusive), so its minimum is the
    # 1500 MHz edge. GPU peaks at 80 degC at 0.5 s; HBM has no reading, so no figure.
    t = np.array([0, S // 2, S])
    samples = {
        "t_mono_ns": t,
        "clock_sm_mhz": np.array([1000.0, 1500.0, 2000.0]),
        "temp_gpu_c": np.array([60.0, 80.0, 70.0]),
        "temp_hbm_c": np.full(3, np.nan),
    }
    out = attribute_windows(samples, [(0, S), (S // 2, S)])
    assert out["clock_sm_avg_mhz"] == pytest.approx([1500.0, 1750.0])
    assert out["clock_sm_min_mhz"] == pytest.approx([1000.0, 1500.0])
    assert out["temp_gpu_peak_c"] == pytest.approx([80.0, 80.0])
    assert np.isnan(out["temp_hbm_peak_c"]).all()


def test_null_metrics_are_ignored_per_metric() -> None:
    # Temperature never read, power missing at some samples, the PCIe counter null at one: each
    # metric uses its own non-null samples; energy is still the step's 400 J (the nulls fall on
    # the flat parts), the counter's delta skips the null, the temperature is NaN.
    samples = edge_sampled(np.arange(0, 2 * S + 1, 250 * MS))
    n = samples["t_mono_ns"].size
    p = samples["power_instant_w"].copy()
    p[[1, 2, n - 2]] = np.nan
    samples["power_instant_w"] = p
    samples["temp_gpu_c"] = np.full(n, np.nan)
    samples["throttle_reasons"] = np.full(n, INT_NULL, dtype=np.int64)
    pcie = np.arange(n, dtype=np.int64) * 100
    pcie[3] = INT_NULL
    samples["pcie_rx_bytes"] = pcie
    w = one(samples, 0, 2 * S)
    assert w["energy_method"] == "power_trapezoid"
    assert w["energy_j"] == pytest.approx(400.0, abs=1e-6)
    assert np.isnan(w["temp_gpu_peak_c"]) and np.isnan(w["throttle_any_limiting_s"])
    assert w["pcie_rx_bytes"] == (n - 1) * 100


def test_coverage_columns() -> None:
    # Samples every 100 ms from 0 to 2 s, with one missing at 1.0 s; the window [0.5, 1.5) holds
    # the samples 0.5 .. 1.4 s but not 1.0: 9 samples, largest gap 0.2 s = 2 periods, which is
    # not yet a sampling gap (it must be longer than 2 periods), so the window is fully covered.
    t = np.delete(np.arange(0, 21) * (100 * MS), 10)
    w = one({"t_mono_ns": t}, S // 2, 3 * S // 2)
    assert w["n_samples"] == 9
    assert w["coverage"] == pytest.approx(1.0)
    assert w["gap_max_s"] == pytest.approx(0.2)
    assert not w["interpolated"]


def _holed(hole_begin_ns: int, hole_end_ns: int, end_ns: int = 2 * S) -> np.ndarray:
    """Samples every 10 ms over [0, end], none strictly inside (hole_begin, hole_end)."""
    t = np.arange(0, end_ns + 1, 10 * MS)
    return t[(t <= hole_begin_ns) | (t >= hole_end_ns)]


def test_a_one_second_hole_in_a_two_second_window_is_half_covered() -> None:
    # Samples every 10 ms, none from 0.5 s to 1.5 s: the 2 s window has 1 s covered (coverage 0.5)
    # and its longest interval without a sample is the 1 s hole.
    w = one({"t_mono_ns": _holed(S // 2, 3 * S // 2)}, 0, 2 * S)
    assert w["coverage"] == pytest.approx(0.5)
    assert w["gap_max_s"] == pytest.approx(1.0)
    # A window inside the hole is not covered at all; one before it entirely.
    inner = one({"t_mono_ns": _holed(S // 2, 3 * S // 2)}, 600 * MS, 700 * MS)
    assert inner["coverage"] == 0.0 and inner["gap_max_s"] == pytest.approx(0.1)
    before = one({"t_mono_ns": _holed(S // 2, 3 * S // 2)}, 0, S // 2)
    assert before["coverage"] == pytest.approx(1.0) and before["gap_max_s"] == pytest.approx(0.01)


@pytest.mark.parametrize("hole_ms", [20, 30, 250, 1000])
def test_coverage_counts_only_stretches_longer_than_two_periods(hole_ms: int) -> None:
    # A hole of exactly 2 periods (20 ms) is still sampling; 3 periods and more are gaps, and the
    # window [0, 2 s) loses exactly the hole's length.
    t = _holed(S // 2, S // 2 + hole_ms * MS)
    w = one({"t_mono_ns": t}, 0, 2 * S)
    lost = 0.0 if hole_ms <= 20 else hole_ms / 1000
    assert w["coverage"] == pytest.approx(1.0 - lost / 2.0)
    assert w["gap_max_s"] == pytest.approx(hole_ms / 1000)


def test_coverage_at_the_edges_and_with_a_given_period() -> None:
    # The hole straddles the window's begin: only its part inside the window is lost.
    t = _holed(S // 2, 3 * S // 2)
    w = one({"t_mono_ns": t}, S, 2 * S)
    assert w["coverage"] == pytest.approx(0.5)
    assert w["gap_max_s"] == pytest.approx(0.5)
    # After the last sample the stretch runs to the window's end: 0.3 s past a 10 ms sampler is a gap.
    t = np.arange(0, S + 1, 10 * MS)
    w = one({"t_mono_ns": t}, S // 2, 13 * S // 10)
    assert w["coverage"] == pytest.approx(0.5 / 0.8)
    assert w["gap_max_s"] == pytest.approx(0.3)
    # Told the sampler runs every 200 ms, the same 10 ms samples with a 250 ms hole have no gap.
    t = _holed(S // 2, 3 * S // 4)
    w = attribute_windows({"t_mono_ns": t}, [(0, 2 * S)], sample_period_s=0.2)
    assert w["coverage"][0] == pytest.approx(1.0)
    # No samples at all: nothing covered; the longest interval without a sample is the window.
    w = one({"t_mono_ns": np.zeros(0, np.int64)}, 0, S)
    assert w["coverage"] == 0.0 and w["gap_max_s"] == pytest.approx(1.0)


def test_every_output_column_is_documented() -> None:
    # The docs are the contract for the figures: every column is named there with its unit.
    assert len(set(ATTRIBUTION_COLUMN_NAMES)) == len(ATTRIBUTION_COLUMNS)
    assert {f"throttle_{name}_s" for name, _ in THROTTLE_REASONS} <= set(ATTRIBUTION_COLUMN_NAMES)
    doc = Path(__file__).resolve().parents[2] / "docs" / "attribution.md"
    text = doc.read_text()
    for name in ATTRIBUTION_COLUMN_NAMES:
        assert f"`{name}`" in text, name


# ------------------------------------------------------------------ scale


@pytest.mark.slow
def test_1e5_windows_over_1e6_samples_in_a_few_seconds() -> None:
    # A long run's rank: 10^6 samples at ~1 kHz with every metric, 10^5 nested-ish windows.
    rng = np.random.default_rng(0)
    n, m = 10**6, 10**5
    t = np.cumsum(rng.integers(900_000, 1_100_000, n)).astype(np.int64) + 10**15
    samples: dict[str, np.ndarray] = {"t_mono_ns": t}
    for name in FLOAT_METRICS:
        samples[name] = rng.uniform(100.0, 700.0, n)
    for name in INT_METRICS:
        if name == "throttle_reasons":
            samples[name] = rng.integers(0, 512, n)
        else:
            samples[name] = np.cumsum(rng.integers(0, 1000, n)).astype(np.int64) + 2**62
    begin = np.sort(rng.integers(t[0], t[-1] - 60 * MS, m))
    end = begin + rng.integers(1, 50 * MS, m)
    start = time.perf_counter()
    out = attribute_windows(samples, {"t_begin_mono_ns": begin, "t_end_mono_ns": end})
    elapsed = time.perf_counter() - start
    assert all(v.shape == (m,) for v in out.values())
    assert not np.isnan(out["energy_j"]).any()
    assert elapsed < deadline(5.0), f"attribution took {elapsed:.2f} s"


def test_asking_for_a_few_figures_gives_the_same_values_and_computes_only_those() -> None:
    samples = counter_trace()
    samples["throttle_reasons"] = np.where(samples["t_mono_ns"] > S, 0x4, 0).astype(np.int64)
    samples["temp_gpu_c"] = np.linspace(40.0, 60.0, samples["t_mono_ns"].size)
    windows = [(125 * MS, 1875 * MS), (490 * MS, 560 * MS)]
    full = attribute_windows(samples, windows)
    few = ("energy_j", "power_peak_w", "temp_gpu_peak_c", "throttle_any_limiting_s")
    part = attribute_windows(samples, windows, figures=few)
    assert set(part) == set(few)
    for name in few:
        assert np.array_equal(part[name], full[name], equal_nan=True), name
    with pytest.raises(ValueError, match="unknown attribution figure"):
        attribute_windows(samples, windows, figures=("energy_kwh",))


def every_case_trace() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Every metric over 4 s at ~10 ms with nulls, resets and gaps, so that the windows (open,
    reversed, zero-length, short, long, outside the samples) meet every energy method: the
    counter until 1 s (with a reset at 0.5 s), instant power until 2 s, averaged power until 3 s,
    nothing after."""
    rng = np.random.default_rng(11)
    n = 400
    t = np.cumsum(rng.integers(8 * MS, 12 * MS, n)).astype(np.int64)
    samples: dict[str, np.ndarray] = {"t_mono_ns": t}
    for name in FLOAT_METRICS:
        v = rng.uniform(50.0, 700.0, n)
        v[rng.random(n) < 0.1] = np.nan
        samples[name] = v
    samples["power_instant_w"][t >= 2 * S] = np.nan
    samples["power_avg_w"][t >= 3 * S] = np.nan
    for name in INT_METRICS:
        if name == "throttle_reasons":
            c = rng.integers(0, 1024, n)
        else:
            c = np.cumsum(rng.integers(0, 5000, n)) + 2**40
            c[n // 3 :] -= 2**39  # a reset
        c = c.astype(np.int64)
        c[rng.random(n) < 0.1] = INT_NULL
        samples[name] = c
    e = (np.cumsum(rng.integers(0, 3, n)) // 2 * 1000 + 10**9).astype(np.int64)  # ticks now and then
    e[t >= S // 2] -= 10**8  # a reset
    e[t >= S] = INT_NULL
    samples["energy_mj"] = e
    m = 300
    begin = rng.integers(-S // 10, 41 * S // 10, m)
    end = begin + rng.integers(-5 * MS, 400 * MS, m)
    end[::17] = begin[::17]  # zero-length
    begin[5::41] = INT_NULL  # open
    end[7::43] = INT_NULL
    return samples, {"t_begin_mono_ns": begin, "t_end_mono_ns": end}


@pytest.mark.parametrize("figure", ATTRIBUTION_COLUMN_NAMES)
def test_one_figure_alone_and_from_its_sample_columns_equals_the_full_computation(figure: str) -> None:
    # What the live figures rely on: attribute_windows skips what was not asked for, and the
    # collector passes only sample_columns(figures); neither may change a value.
    samples, windows = every_case_trace()
    full = attribute_windows(samples, windows)
    assert set(full["energy_method"]) == set(ENERGY_METHODS)  # the trace meets every case
    alone = attribute_windows(samples, windows, figures=[figure])
    columns = sample_columns([figure])
    assert columns[0] == "t_mono_ns" and set(columns) <= set(samples)
    narrow = attribute_windows({c: samples[c] for c in columns}, windows, figures=[figure])
    for out in (alone, narrow):
        assert list(out) == [figure]
        assert np.array_equal(out[figure], full[figure], equal_nan=full[figure].dtype.kind == "f"), figure


def test_sample_columns_name_what_the_figures_read() -> None:
    assert sample_columns(["duration_s", "coverage"]) == ("t_mono_ns",)
    assert sample_columns(["power_peak_w", "temp_hbm_peak_c"]) == (
        "t_mono_ns",
        "power_instant_w",
        "temp_hbm_c",
    )
    assert sample_columns(["energy_j"]) == ("t_mono_ns", "energy_mj", "power_avg_w", "power_instant_w")
    unread = {"t_mono_ns", *FLOAT_METRICS, *INT_METRICS} - set(sample_columns())
    assert unread == {
        "util_gpu_pct",
        "util_mem_pct",
        "mem_used_bytes",
        "power_limit_w",
        "power_memory_w",
        "power_module_w",  # read by the job power waveform (analysis/grid_power.py), not here
        "power_module_avg_w",
        "clock_mem_mhz",
        # the driver's timestamps of the violation counters: kept in the samples, not used here
        *(f"violation_{name}_ts_us" for name, _ in VIOLATION_COUNTERS),
    }
    with pytest.raises(ValueError, match="unknown attribution figure"):
        sample_columns(["energy_kwh"])
