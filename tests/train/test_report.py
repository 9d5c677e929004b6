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


def test_the_loop_waits_for_figures_only_once_they_are_overdue():
    import time

    from charllm_nemo.train.loop import late_wait

    now = time.monotonic_ns()
    # 100 Hz: a step that ended 30 ms ago is past two periods; its figures should be there:
    # wait up to two periods for a starved telemetry process.
    assert late_wait(now - 30_000_000, 10_000_000) == 0.02
    # the step just ended, or 10 Hz with 30 ms steps: not due yet, no wait (the figures are dropped)
    assert late_wait(now, 10_000_000) == 0.0
    assert late_wait(now - 30_000_000, 100_000_000) == 0.0
    # long overdue at 10 Hz: capped at 50 ms; 1 kHz: two periods, 2 ms
    assert late_wait(now - 1_000_000_000, 100_000_000) == 0.05
    assert late_wait(now - 30_000_000, 1_000_000) == 0.002
