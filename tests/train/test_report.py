"""Run summaries: medians over steps, warm-up left out."""

from __future__ import annotations

from charllm_nemo.train.report import SUMMARY_FIELDS, run_summary


def test_medians_leave_the_warm_up_step_out_and_skip_missing_values():
    steps = [
        {"step_time_s": 9.0, "mfu": None, "energy_j": 100.0},  # warm-up: excluded
        {"step_time_s": 1.0, "mfu": None, "energy_j": 10.0},
        {"step_time_s": 3.0, "mfu": None, "energy_j": float("nan")},
        {"step_time_s": 2.0, "mfu": None, "energy_j": 30.0},
    ]
    s = run_summary(steps)
    assert s["steps"] == 4 and s["steps_in_medians"] == 3
    assert s["step_time_s_median"] == 2.0
    assert s["energy_j_median"] == 20.0  # NaN ignored, median of 10 and 30
    assert s["mfu_median"] is None  # never reported: absent, not zero
    assert all(f"{f}_median" in s for f in SUMMARY_FIELDS)


def test_a_single_step_run_still_has_a_summary():
    s = run_summary([{"step_time_s": 5.0}])
    assert s["steps_in_medians"] == 1 and s["step_time_s_median"] == 5.0
