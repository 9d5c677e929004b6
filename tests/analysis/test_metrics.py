"""Whole-run figures against hand-computed traces."""

from __future__ import annotations

import numpy as np
import pytest

from charllm_nemo.analysis.metrics import (
    counter_increase,
    held_share,
    largest_rise,
    pearson,
    time_weighted_mean,
    trapezoid_energy_j,
)

S = 1_000_000_000


def test_time_weighted_mean_weights_by_time_not_by_sample() -> None:
    # 100 W -> 300 W over the first second (mean 200), then 300 W for 2 s: 800 J over 3 s.
    t = np.array([0, 1, 3]) * S
    p = np.array([100.0, 300.0, 300.0])
    assert time_weighted_mean(t, p) == pytest.approx(800 / 3)
    assert trapezoid_energy_j(t, p) == pytest.approx(800.0)


def test_nulls_are_skipped_not_zero() -> None:
    t = np.array([0, 1, 2, 3]) * S
    p = np.array([100.0, np.nan, np.nan, 100.0])
    assert time_weighted_mean(t, p) == pytest.approx(100.0)
    assert trapezoid_energy_j(t, p) == pytest.approx(300.0)
    assert np.isnan(time_weighted_mean(t[:1], p[:1]))


def test_64_bit_counter_deltas_are_exact() -> None:
    # Near 2**62 float64 cannot tell x from x + 1; the delta must still be exactly 12.
    base = 2**62
    c = np.array([base, base + 5, base + 12], dtype=np.int64)
    assert counter_increase(c) == (12.0, 0)


def test_counter_reset_drops_the_interval_that_holds_it() -> None:
    # 100 -> 150 (+50), reset to 10 (unknown: left out), 10 -> 30 (+20); one decrease; nulls skipped.
    c = np.array([100, 150, -1, 10, 30], dtype=np.int64)
    assert counter_increase(c) == (70.0, 1)


def test_held_share_is_sample_and_hold() -> None:
    # Flag set at 0 s (held 1 s), clear at 1 s (held 3 s): 25 % of 4 s.
    t = np.array([0, 1, 4]) * S
    share = held_share(t, np.array([[True], [False], [True]]))
    assert share.tolist() == [0.25]


def test_largest_rise_within_100ms() -> None:
    # 10 ms samples: 300 W, a step to 700 W at 0.5 s. The largest rise within 100 ms starting at
    # a 300 W sample within 100 ms of the step is 400 W; later samples see no rise.
    t = np.arange(100) * 10_000_000
    p = np.where(np.arange(100) >= 50, 700.0, 300.0)
    rise = largest_rise(t, p, 100_000_000)
    assert rise[49] == 400.0 and rise[40] == 400.0
    assert rise[39] == 0.0  # 0.39 s -> 0.5 s is 110 ms: out of reach
    assert rise[60] == 0.0


@pytest.mark.parametrize("nulls", [False, True])
def test_largest_rise_equals_a_plain_loop_on_jittered_samples(nulls: bool) -> None:
    # Steps of 7-13 ms: some passes have every sample within the 100 ms horizon (unmasked),
    # others only some (masked); with nulls, the null samples are skipped and give NaN.
    rng = np.random.default_rng(3)
    t = np.cumsum(rng.integers(7_000_000, 13_000_000, size=400)).astype(np.int64)
    p = rng.uniform(100.0, 700.0, size=t.size)
    if nulls:
        p[rng.random(t.size) < 0.2] = np.nan
    want = np.full(t.size, np.nan)
    for i in range(t.size):
        if np.isnan(p[i]):
            continue
        later = p[i + 1 :][(t[i + 1 :] - t[i] <= 100_000_000) & ~np.isnan(p[i + 1 :])]
        want[i] = max(float(later.max()) - p[i], 0.0) if later.size else 0.0
    np.testing.assert_array_equal(largest_rise(t, p, 100_000_000), want)


def test_pearson() -> None:
    x = np.array([1.0, 2.0, 3.0, 4.0])
    assert pearson(x, 2 * x + 1) == pytest.approx(1.0)
    assert pearson(x, -x) == pytest.approx(-1.0)
    assert np.isnan(pearson(x, np.ones(4)))


def test_throttle_shares_per_reason() -> None:
    from charllm_nemo.analysis.rank_tables import throttle_shares
    from charllm_nemo.telemetry.schema import THROTTLE_REASONS

    # sw_power_cap (0x4) for 1 s, sw_power_cap + hw_slowdown (0xC) for 1 s, nothing for 2 s.
    t = np.array([0, 1, 2, 4]) * S
    shares = dict(
        zip([n for n, _ in THROTTLE_REASONS], throttle_shares(t, np.array([4, 12, 0, 4])), strict=True)
    )
    assert shares["sw_power_cap"] == 0.5 and shares["hw_slowdown"] == 0.25 and shares["idle"] == 0.0
    # A mask with an unknown high bit takes the general path and agrees.
    high = throttle_shares(t, np.array([4 | 1 << 20, 12, 0, 4]))
    assert high.tolist() == list(shares.values())
