"""The live job power swing / ramp alerts (alerts/grid.py) over step reports built from rank vectors
as rank 0 receives them, through the real detector; and their config checks."""

from __future__ import annotations

import math

import pytest

from charllm_nemo.alerts import AlertDetector, AlertsConfig, alerts_problems
from charllm_nemo.alerts.grid import job_power
from charllm_nemo.steps.report import StepReport, apply_rank_figures, pack_rank_vector


def _vector(swing: float, up: float = 1000.0, down: float = 1000.0, peak: float = 600.0) -> list[float]:
    figures = {
        "duration_s": 0.5,
        "power_peak_w": peak,
        "power_swing_w": swing,
        "power_ramp_up_w_s": up,
        "power_ramp_down_w_s": down,
    }
    return pack_rank_vector(step_time_s=0.5, figures=figures, timing=(0.5, 0.1, 0.2, 0.05, 0.0, 0.0))


def _report(step: int, ranks: list[list[float]]) -> StepReport:
    rep = StepReport(step=step, loss=1.0, step_time_s=0.5)
    apply_rank_figures(rep, ranks)
    return rep


def _alerts(cfg: AlertsConfig, steps: list[list[list[float]]]) -> list[dict]:
    det = AlertDetector(cfg)
    out = []
    for step, ranks in enumerate(steps):
        out += [a for a in det.check(_report(step, ranks)) if a["kind"] in ("power_swing", "power_ramp")]
    return out


def test_the_job_swing_is_the_sum_of_the_ranks_swings_over_those_that_know_it():
    figs = [
        {"power_swing_w": 450.0, "power_peak_w": 600.0, "power_ramp_up_w_s": 4e4},
        {"power_swing_w": 400.0, "power_peak_w": 580.0, "power_ramp_up_w_s": 3e4},
        {"power_swing_w": math.nan, "power_peak_w": math.nan},
    ]
    job = job_power(figs)
    assert (job.swing_w, job.peak_w, job.ramp_up_w_s, job.ranks, job.world) == (850.0, 1180.0, 7e4, 2, 3)
    assert job.ramp_down_w_s is None


def test_off_by_default_then_k_of_n_steps_over_the_limit_raise_it_once():
    small, big = _vector(100.0), _vector(450.0)
    steps = [[big, big]] * 6  # 900 W of job swing every step
    assert _alerts(AlertsConfig(), steps) == []  # limits null: not watched
    cfg = AlertsConfig(power_swing_limit_w=800.0, power_limit_steps=3, power_limit_window=5)
    # over, under, over, under, over: 3 of the last 5 at step 4
    seq = [[big, big], [small, small], [big, big], [small, small], [big, big], [big, big]]
    alerts = _alerts(cfg, seq)
    assert [a["step"] for a in alerts] == [4]  # step 5 over again, held back by the rate limit
    a = alerts[0]
    assert a["kind"] == "power_swing" and a["rank"] is None and a["severity"] == "warning"
    assert (a["job_swing_w"], a["limit_w"], a["steps_over"], a["window"]) == (900.0, 800.0, 3, 5)
    assert (a["ranks"], a["world_size"], a["job_peak_w"]) == (2, 2, 1200.0)
    assert a["swing_share_of_peak"] == pytest.approx(0.75)
    m = a["message"]
    assert "900 W" in m and "limit 800 W" in m and "3 of the last 5 steps" in m
    assert "upper bound" in m and "peak minus trough" in m and "all 2 ranks" in m
    assert _alerts(cfg, [[big, big], [small, small], [small, small]] * 3) == []  # 2 of 5 at most: noise
    # a step over it after the rate limit's steps raises it again
    again = AlertsConfig(power_swing_limit_w=800.0, power_limit_steps=1, repeat_after_steps=2)
    assert [a["step"] for a in _alerts(again, [[big, big]] * 5)] == [0, 2, 4]


def test_the_ramp_alert_names_its_direction_and_its_resolution():
    fall = _vector(450.0, up=20_000.0, down=45_000.0)
    cfg = AlertsConfig(power_ramp_limit_w_s=80_000.0, power_limit_steps=2, power_limit_window=3)
    alerts = _alerts(cfg, [[fall, fall]] * 3)
    assert [a["step"] for a in alerts] == [1]
    a = alerts[0]
    assert a["kind"] == "power_ramp" and a["direction"] == "down" and a["limit_w_s"] == 80_000.0
    assert (a["job_ramp_up_w_s"], a["job_ramp_down_w_s"]) == (40_000.0, 90_000.0)
    assert "ramp down 90 kW/s" in a["message"] and "sampling period's resolution" in a["message"]
    assert _alerts(cfg, [[_vector(450.0, 20_000.0, 30_000.0)] * 2] * 3) == []  # 60 kW/s: below


def test_a_rank_without_figures_is_said_and_left_out_of_the_sum():
    known, unknown = _vector(450.0), _vector(math.nan, math.nan, math.nan, math.nan)
    cfg = AlertsConfig(power_swing_limit_w=400.0, power_limit_steps=1, power_limit_window=1)
    (a,) = _alerts(cfg, [[known, unknown]])
    assert a["job_swing_w"] == 450.0 and a["ranks"] == 1 and "1/2 ranks" in a["message"]


def test_the_limits_are_checked():
    bad = AlertsConfig(
        power_swing_limit_w=-5.0, power_ramp_limit_w_s=True, power_limit_steps=4, power_limit_window=3
    )
    problems = alerts_problems(bad)
    assert "alerts.power_swing_limit_w=-5.0 must be null (not watched) or a number > 0" in problems
    assert "alerts.power_ramp_limit_w_s=True must be null (not watched) or a number > 0" in problems
    assert "alerts.power_limit_steps=4 must be <= alerts.power_limit_window=3" in problems
    assert alerts_problems(AlertsConfig(power_swing_limit_w=2e6, power_ramp_limit_w_s=5e5)) == []
