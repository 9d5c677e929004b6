"""Run summaries: medians over steps, warm-up left out."""

from __future__ import annotations

from pathlib import Path

import pytest

from charllm_nemo.steps.observers import StepsFile
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

    from charllm_nemo.steps.pending import late_wait

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


def test_the_last_steps_wait_generously_but_not_forever() -> None:
    from charllm_nemo.steps.pending import final_wait

    assert final_wait(100.0) == 2.0  # a loaded node may hold the telemetry process off for a while
    assert final_wait(1.0) == 5.0  # five periods, capped
    assert final_wait(2.0) == 2.5


def test_short_steps_are_reported_a_few_steps_late_in_the_same_order_on_every_rank():
    import math
    import time

    from charllm_nemo.steps.pending import FIGURES_BATCH_S, MAX_FIGURES_LAG, PendingSteps
    from charllm_nemo.steps.report import StepReport

    def step(i: int, t_end: int) -> tuple[StepReport, int, int]:
        return StepReport(step=i, loss=None, step_time_s=0.03), t_end - 30_000_000, t_end

    now = time.monotonic_ns()
    p: PendingSteps[StepReport] = PendingSteps()
    reported = []
    for i in range(12):
        due = p.due()
        if due is not None:
            reported.append((i, due[0].step))
        # 30 ms steps: ceil(0.1 / 0.03) = 4 steps late; a slow first step does not hold it back
        p.add(step(i, now), 1.0 if i == 0 else 0.03)
    assert p.lag == 4 == math.ceil(FIGURES_BATCH_S / 0.03)
    assert reported == [(1, 0)] + [(i, i - 4) for i in range(5, 12)]  # no step skipped
    # Its figures are computed with those of the steps after it: due when the newest's are.
    due = p.due()
    assert due is not None and due[0].step == 8
    assert p.wait_s(due, 10_000_000) == 0.0  # the newest (step 11) ended just now
    p.add(step(12, now), 0.03)
    p.steps[-1] = step(12, now - 30_000_000)
    assert p.wait_s(p.due(), 10_000_000) == 0.02  # the newest ended 30 ms ago: overdue
    # Longer steps later never shrink the lag; very short ones are capped; no telemetry: no lag.
    p.add(step(13, now), 10.0)
    assert p.lag == 4
    p.add(step(14, now), 1e-6)
    assert p.lag == MAX_FIGURES_LAG
    q: PendingSteps[StepReport] = PendingSteps(max_lag=1)
    q.add(step(0, now), 1e-6)
    assert q.lag == 1
    assert p.batch == p.lag  # every sample can answer a figure: the whole lag is one batch


def test_figures_ready_a_counter_period_late_leave_steps_between_a_batch_and_its_reading():
    from charllm_nemo.steps.pending import PendingSteps
    from charllm_nemo.steps.report import StepReport as StepSummary

    # NVML's counters at 10 Hz, samples at 100 Hz: a figure can be ready 2 * 90 ms after the
    # samples pass its window. 60 ms steps: batches of 2, and 3 more steps before a batch is read.
    p = PendingSteps(ready_s=0.18)
    for i in range(3):
        p.add((StepSummary(step=i, loss=None, step_time_s=0.06), 0, 0), 0.06)
    assert (p.batch, p.lag) == (2, 5)
    # The batch's last window (step d + 1) has ended 4 steps (240 ms) before step d is read.
    assert (p.lag - p.batch + 1) * 0.06 >= 0.18
    # Very short steps: the lag is capped, the slack kept, the batch shrinks to one step.
    p.add((StepSummary(step=3, loss=None, step_time_s=0.01), 0, 0), 0.01)
    assert (p.batch, p.lag) == (2, 8)  # never shrinks
    q = PendingSteps(ready_s=0.18)
    q.add((StepSummary(step=0, loss=None, step_time_s=0.01), 0, 0), 0.01)
    assert (q.batch, q.lag) == (1, 8)


def test_a_steps_file_on_a_full_disk_never_stops_training(caplog: pytest.LogCaptureFixture) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    f = StepsFile(Path("/dev/full"))  # every write: ENOSPC
    f.write({"step": 0, "loss": 6.9})
    f.write({"step": 1, "loss": 6.8})  # given up after the first failure: no second error
    f.close()
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "cannot write /dev/full" in errors[0].getMessage()


@pytest.mark.parametrize(
    ("name", "units", "peak"),
    [
        ("AMD Instinct MI250X / MI250", 110, 191.5),  # one name for both: the CU count tells
        ("AMD Instinct MI250X / MI250", 104, 181.05),
        ("AMD Instinct MI250X / MI250", None, None),  # ambiguous: MFU absent, not guessed
        ("AMD Instinct MI300X", 38, 1307.4 * 38 / 304),  # a CPX partition
        ("NVIDIA H100 80GB HBM3", 132, 989.4),
    ],
)
def test_the_gpu_peak_uses_the_devices_compute_units(
    name: str, units: int | None, peak: float | None
) -> None:
    from charllm_nemo.train.config import TrainConfig
    from charllm_nemo.train.report import train_rates

    cfg = TrainConfig()
    cfg.batch.precision = "bf16"
    t = train_rates(cfg, 8, name, on_cpu=False, compute_units=units)
    assert t is not None and t.peak_tflops_per_gpu == (None if peak is None else pytest.approx(peak))


def test_fp32_training_on_transformer_engine_is_measured_against_the_tf32_rate() -> None:
    from charllm_nemo.train.config import TrainConfig
    from charllm_nemo.train.report import train_rates

    def peak(**kw: object) -> float | None:
        rates = train_rates(cfg, 8, name, on_cpu=False, **kw)  # type: ignore[arg-type]
        assert rates is not None
        return rates.peak_tflops_per_gpu

    cfg = TrainConfig()
    cfg.batch.precision = "fp32"
    name = "NVIDIA H100 80GB HBM3"
    assert peak(compute_units=132) == pytest.approx(67.0)
    assert peak(compute_units=132, tf32_gemms=True) == pytest.approx(494.7)
    cfg.batch.precision = "bf16"  # 16-bit training: its own rate either way
    assert peak(tf32_gemms=True) == pytest.approx(989.4)


def test_figures_known_without_energy_still_reach_the_summary_and_the_console() -> None:
    # A device that reports temperature, peak power and throttling but no energy (a vGPU guest).
    from charllm_nemo.steps.observers import format_report
    from charllm_nemo.steps.report import StepReport, apply_rank_figures, pack_rank_vector

    figures = {"power_peak_w": 350.0, "temp_gpu_peak_c": 81.0, "throttle_any_limiting_s": 0.02}
    s = StepReport(step=0, loss=1.0, step_time_s=0.1)
    apply_rank_figures(s, [pack_rank_vector(loss=1.0, step_time_s=0.1, figures=figures)])
    assert (s.energy_j, s.power_peak_w, s.temp_gpu_peak_c) == (None, 350.0, 81.0)
    assert s.throttle_share == pytest.approx(0.2)
    assert format_report(s, 1, 1).endswith("| energy n/a | peak 350 W | max 81 C | throttle 20%")


def test_the_energy_median_counts_only_steps_every_rank_reported() -> None:
    # A step some rank's figures missed is a partial sum over ranks, not the job's energy.
    rows = [{"step": i, "energy_j": e, "ranks_reporting": n} for i, (e, n) in
            enumerate([(800, 8), (800, 8), (100, 1), (400, 4), (100, 1), (800, 8)])]  # fmt: skip
    assert run_summary(rows, world_size=8)["energy_j_median"] == 800
    assert run_summary(rows)["energy_j_median"] == 400  # (no world size: every step)
