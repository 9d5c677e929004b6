"""The ranks table's throttle-counter columns (analysis/throttle_counters.py): the driver's
per-reason counters beside the sampled bits, their difference, and transitions per minute."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from charllm_nemo.analysis.analyze import analyze
from charllm_nemo.analysis.store_writer import write_rank
from charllm_nemo.analysis.throttle_counters import (
    counter_vs_sampled,
    throttle_counter_figures,
    transitions_per_min,
)
from charllm_nemo.telemetry.schema import INT_NULL, THROTTLE_BITS, THROTTLE_REASONS, VIOLATION_COUNTERS

S = 1_000_000_000
MS = 1_000_000
BRAKE = THROTTLE_BITS["hw_power_brake"]
BOARD = THROTTLE_BITS["board_limit"]


def test_transitions_count_each_rise_of_each_bit_per_minute() -> None:
    # 121 samples 0.5 s apart (60 s); hw_power_brake rises 4 times, board_limit once and stays.
    t = np.arange(121, dtype=np.int64) * S // 2
    mask = np.zeros(121, np.int64)
    for start in (10, 30, 50, 70):
        mask[start : start + 5] |= BRAKE
    mask[100:] |= BOARD
    mask[60] = INT_NULL  # a null sample is skipped, not counted as a change
    out = transitions_per_min(t, mask)
    assert set(out) == {f"throttle_{name}_per_min" for name, _ in THROTTLE_REASONS}
    assert out["throttle_hw_power_brake_per_min"] == pytest.approx(4.0)
    assert out["throttle_board_limit_per_min"] == pytest.approx(1.0)
    assert out["throttle_sw_power_cap_per_min"] == 0.0
    # the same number of rises over 2 minutes: half the rate
    assert transitions_per_min(t * 2, mask)["throttle_hw_power_brake_per_min"] == pytest.approx(2.0)
    assert math.isnan(transitions_per_min(t[:1], mask[:1])["throttle_idle_per_min"])


def test_counter_equals_sampled_time_when_the_bits_are_seen() -> None:
    # Counter read every 100 ms; the bit set on 1.0-2.0 s and the counter grows by exactly that.
    t = np.arange(31, dtype=np.int64) * (S // 10)
    mask = np.where((t >= S) & (t < 2 * S), BRAKE, 0).astype(np.int64)
    counter = 5_000 + np.clip(t - S, 0, S).astype(np.int64)
    counter_s, sampled_s = counter_vs_sampled(t, mask, counter, BRAKE)
    assert counter_s == pytest.approx(1.0, abs=1e-12)
    assert sampled_s == pytest.approx(1.0, abs=1e-12)


def test_throttling_between_samples_shows_as_a_positive_difference() -> None:
    # 40 ms of throttling inside a 100 ms sampling gap: the bit is never sampled set.
    t = np.arange(11, dtype=np.int64) * (S // 10)
    mask = np.zeros(11, np.int64)
    counter = np.where(t >= 5 * S // 10, 40_000_000, 0).astype(np.int64)
    s = {"throttle_reasons": mask, "violation_hw_power_brake_ns": counter}
    row = throttle_counter_figures(t, s)
    assert row["violation_hw_power_brake_counter_s"] == pytest.approx(0.04)
    assert row["violation_hw_power_brake_sampled_s"] == 0.0
    assert row["violation_hw_power_brake_diff_s"] == pytest.approx(0.04)


def test_a_reset_or_wrap_leaves_its_segment_out_of_both() -> None:
    # The bit is on throughout and the counter grows with it from near 2**62, but resets to 0
    # between samples 10 and 11 (driver reload) and drops again between 19 and 20 (a wrap):
    # those two segments are left out of the counter and of the sampled time alike.
    t = np.arange(21, dtype=np.int64) * (S // 10)
    mask = np.full(21, BOARD, np.int64)
    counter = (1 << 62) + t
    counter[11:] = t[11:] - t[11]
    counter[20] = 5
    counter_s, sampled_s = counter_vs_sampled(t, mask, counter, BOARD)
    assert counter_s == pytest.approx(1.0 + 0.8, abs=1e-12)  # segments 0-10 and 11-19
    assert sampled_s == pytest.approx(1.8, abs=1e-12)


def test_a_counter_without_a_bit_or_without_values() -> None:
    t = np.arange(5, dtype=np.int64) * S
    mask = np.zeros(5, np.int64)
    counter_s, sampled_s = counter_vs_sampled(t, mask, np.arange(5, dtype=np.int64) * 10, None)
    assert counter_s == pytest.approx(4e-8) and math.isnan(sampled_s)
    null = np.full(5, INT_NULL, np.int64)
    assert all(math.isnan(v) for v in counter_vs_sampled(t, mask, null, BRAKE))
    # every counter gets its three columns; a column with nothing to measure is NaN, never 0
    row = throttle_counter_figures(t, {"throttle_reasons": mask})
    for name, _ in VIOLATION_COUNTERS:
        for part in ("counter", "sampled", "diff"):
            assert math.isnan(row[f"violation_{name}_{part}_s"]), (name, part)
    assert {n for n, r in VIOLATION_COUNTERS if not r} == {
        "low_util",
        "total_app_clocks",
        "total_base_clocks",
    }


def test_the_ranks_table_carries_the_columns(tmp_path: Path) -> None:
    # One rank, 10 ms samples over 6 s; sw_power_cap on 1.00-2.00 s and 3.00-3.50 s (2 rises);
    # the driver's power counter grows 1.5 s over the same time plus 0.2 s between samples.
    n = 601
    t = (np.arange(n) * 10 * MS).astype(np.int64)
    cap = ((t >= 1000 * MS) & (t < 2000 * MS)) | ((t >= 3000 * MS) & (t < 3500 * MS))
    mask = np.where(cap, THROTTLE_BITS["sw_power_cap"], 0).astype(np.int64)
    counter = np.cumsum(np.concatenate(([0], np.where(cap[:-1], 10 * MS, 0)))).astype(np.int64)
    counter[500:] += 200 * MS  # 0.2 s the sampled bits never saw
    windows = {
        "window_id": np.arange(2, dtype=np.int64),
        "kind": ["step", "step"],
        "name": ["step", "step"],
        "step": np.array([0, 1]),
        "microbatch": np.array([-1, -1]),
        "t_begin_mono_ns": np.array([0, 1000]) * MS,
        "t_end_mono_ns": np.array([1000, 5000]) * MS,
    }
    samples = {
        "t_mono_ns": t,
        "power_instant_w": np.full(n, 500.0),
        "throttle_reasons": mask,
        "violation_power_ns": counter,
    }
    write_rank(tmp_path / "run", 0, samples, windows, {})
    a = analyze(tmp_path / "run")
    row = a.tables["ranks"].to_pylist()[0]
    assert row["violation_power_counter_s"] == pytest.approx(1.7)
    assert row["violation_power_sampled_s"] == pytest.approx(1.5)
    assert row["violation_power_diff_s"] == pytest.approx(0.2)
    assert row["throttle_sw_power_cap_per_min"] == pytest.approx(2 / 0.1)  # 2 rises in 6 s
    assert row["throttle_board_limit_share"] == 0.0 and row["throttle_board_limit_per_min"] == 0.0
    assert row["violation_board_limit_counter_s"] is None  # not sampled: null, not 0
    assert a.windows is not None
    step = next(r for r in a.windows.to_pylist() if r["step"] == 1)  # [1, 5] s: both episodes
    assert step["throttle_sw_power_cap_s"] == pytest.approx(1.5)
