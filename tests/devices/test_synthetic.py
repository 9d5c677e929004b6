"""The synthetic device is a small physical model; these tests check its physics."""

from __future__ import annotations

import logging
import math
import os

import pytest

from charllm_nemo.devices import open_backend
from charllm_nemo.devices.base import ActivityInput, activity_input
from charllm_nemo.devices.factory import ProcessPlan, open_in_process, process_plan
from charllm_nemo.devices.synthetic import MarkActivity, SyntheticParams
from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.schema import METRICS, decode_throttle
from charllm_nemo.telemetry.windows import WindowRecorder
from tests.devices.helpers import Clock, value


def _dev(activity, params=None):
    clock = Clock()
    backend = open_backend("synthetic", activity=activity, params=params or SyntheticParams(), clock=clock)
    return backend.devices[0], clock


def test_a_reading_has_every_metric_in_schema_units():
    dev, clock = _dev(0.5)
    clock.advance(0.1)
    r = dev.read()
    assert len(r) == len(METRICS)
    assert dev.identity.backend == "synthetic" and "not hardware" in dev.identity.name
    for m, v in zip(METRICS, r, strict=True):
        assert v is None or isinstance(v, (int, float)), m.name
        if m.kind == "int" and v is not None:
            assert isinstance(v, int), m.name
    # unsupported metrics are null, never invented
    assert value(r, "nvlink_tx_bytes") is None and value(r, "temp_hotspot_c") is None
    assert not dev.supported_metrics()["nvlink_tx_bytes"]


def test_power_follows_activity_between_idle_and_the_cap():
    p = SyntheticParams()
    for level, expected in (
        (0.0, p.idle_w),
        (0.5, p.idle_w + 0.5 * (p.peak_w - p.idle_w)),
        (1.0, p.peak_w),  # under the cap by default
    ):
        dev, clock = _dev(level)
        clock.advance(0.01)
        assert value(dev.read(), "power_instant_w") == pytest.approx(expected)


def test_temperature_rises_as_a_first_order_system_towards_ambient_plus_r_times_p():
    # half activity, no cap: T(t) = T_inf + (T0 - T_inf) exp(-t / tau)
    p = SyntheticParams()
    dev, clock = _dev(0.5, p)
    t0 = value(dev.read(), "temp_gpu_c")
    power = p.idle_w + 0.5 * (p.peak_w - p.idle_w)
    t_inf = p.ambient_c + p.r_gpu_c_per_w * power
    for _ in range(100):  # 10 s in 0.1 s steps: exact for piecewise-constant power
        clock.advance(0.1)
        temp = value(dev.read(), "temp_gpu_c")
    assert temp == pytest.approx(t_inf + (t0 - t_inf) * math.exp(-10.0 / p.tau_gpu_s), rel=1e-9)
    assert value(dev.read(), "temp_hbm_c") < temp  # HBM: smaller R, slower


def test_the_energy_counter_integrates_power_and_ticks_at_its_update_period():
    p = SyntheticParams(energy_update_ms=50.0)
    dev, clock = _dev(0.0, p)  # idle: 75 W
    e0 = value(dev.read(), "energy_mj")
    values = []
    for _ in range(100):  # 1 s in 10 ms steps
        clock.advance(0.01)
        values.append(value(dev.read(), "energy_mj"))
    distinct = sorted(set(values))
    assert 18 <= len(distinct) <= 22  # ~20 updates in 1 s at 50 ms
    assert values[-1] - e0 == pytest.approx(p.idle_w * 1e3 * 1.0, rel=0.06)  # 75 J = 75000 mJ


def test_by_default_full_activity_stays_under_the_cap_unthrottled():
    """Issue 33: the default device read 700 W and throttled 100% at step 1 of a tiny CPU model."""
    p = SyntheticParams()
    dev, clock = _dev(1.0, p)
    clock.advance(0.5)
    r = dev.read()
    assert value(r, "power_instant_w") == pytest.approx(p.peak_w) and p.peak_w < 0.85 * p.power_limit_w
    assert not decode_throttle(value(r, "throttle_reasons"))
    assert value(r, "clock_sm_mhz") == p.clock_max_mhz
    assert value(r, "violation_power_ns") == 0


def test_full_activity_over_a_lower_cap_lowers_the_clock_and_says_why():
    p = SyntheticParams(power_limit_w=400.0)
    dev, clock = _dev(1.0, p)
    clock.advance(0.5)
    r = dev.read()
    assert "sw_power_cap" in decode_throttle(value(r, "throttle_reasons"))
    dyn = (p.power_limit_w - p.idle_w) / (p.peak_w - p.idle_w)
    assert value(r, "clock_sm_mhz") == pytest.approx(p.clock_max_mhz * dyn ** (1 / 3))
    assert value(r, "violation_power_ns") == 500_000_000


def test_over_the_temperature_limit_clocks_drop_and_sw_thermal_is_set():
    p = SyntheticParams(temp_limit_c=40.0, tau_gpu_s=0.5, peak_w=600.0)
    dev, clock = _dev(1.0, p)
    for _ in range(50):
        clock.advance(0.1)
        r = dev.read()
    assert "sw_thermal" in decode_throttle(value(r, "throttle_reasons"))
    assert value(r, "clock_sm_mhz") == pytest.approx(p.clock_max_mhz * p.thermal_clock_factor)
    assert value(r, "violation_thermal_ns") > 0


def test_idle_sets_the_idle_reason_and_the_idle_clock():
    dev, clock = _dev(0.0)
    clock.advance(0.1)
    r = dev.read()
    assert decode_throttle(value(r, "throttle_reasons")) == ("idle",)
    assert value(r, "clock_sm_mhz") == SyntheticParams().clock_idle_mhz


def test_activity_follows_the_training_phases_reported_by_window_marks():
    backend = open_backend("synthetic", activity="marks")
    marks = backend.activity
    assert isinstance(marks, MarkActivity)
    rec = WindowRecorder()
    rec.add_listener(marks)
    assert marks.level() == 0.0
    with rec.window("step", step=0):
        assert marks.level() == 0.3
        with rec.window("phase", "forward"):
            assert marks.level() == 1.0
        with rec.window("phase", "optimizer"):
            assert marks.level() == 0.5
            with rec.window("phase", "data-wait"):  # any other phase: 0.7, the highest open wins
                assert marks.level() == 0.7
                with rec.window("phase", "backward"):
                    assert marks.level() == 1.0
                assert marks.level() == 0.7
            assert marks.level() == 0.5
        # communication is low: pipeline send / receive (waits included) and gradient syncs
        for comm in ("pp-forward-recv", "pp-backward-send-forward-recv", "grad-sync", "embedding-grad-sync"):
            with rec.window("phase", comm):
                assert marks.level() == 0.15
                with rec.window("phase", "backward"):  # a sync overlapped with compute: compute
                    assert marks.level() == 1.0
                assert marks.level() == 0.15
            assert marks.level() == 0.3
    assert marks.level() == 0.0
    marks("phase", "forward", False)  # an end without its begin changes nothing
    assert marks.level() == 0.0
    published: list[float] = []
    marks.on_change = published.append
    with rec.window("step", step=1):
        for _ in range(2):
            with rec.window("phase", "forward"):
                pass
    assert published == [0.3, 1.0, 0.3, 1.0, 0.3, 0.0]  # once per change, not per mark


def test_power_swings_with_the_phases_of_a_pipeline_step():
    """A 1F1B-like step on a device that follows marks: every compute phase reads the full
    activity's power, every wait for the neighbour stage and the gradient sync the communication
    level's, so one step's power rises and falls as a GPU's does."""
    clock = Clock()
    p = SyntheticParams()
    backend = open_backend("synthetic", activity="marks", params=p, clock=clock)
    dev = backend.devices[0]
    rec = WindowRecorder()
    rec.add_listener(backend.activity)

    def power_after(seconds: float) -> float:
        clock.advance(seconds)
        return float(value(dev.read(), "power_instant_w"))

    compute, comm = p.peak_w, p.idle_w + 0.15 * (p.peak_w - p.idle_w)
    seen: list[float] = []
    with rec.window("step", step=0):
        for phase in (
            "forward",
            "pp-forward-send-backward-recv",
            "backward",
            "pp-backward-send-forward-recv",
        ):
            with rec.window("phase", phase):
                seen.append(power_after(0.02))
        with rec.window("phase", "grad-sync"):
            seen.append(power_after(0.02))
        with rec.window("phase", "optimizer"):
            seen.append(power_after(0.02))
    seen.append(power_after(0.02))
    assert seen == pytest.approx(
        [compute, comm, compute, comm, comm, p.idle_w + 0.5 * (p.peak_w - p.idle_w), p.idle_w]
    )
    assert comm == pytest.approx(146.25)


def test_the_factory_warns_loudly_that_synthetic_is_not_hardware(caplog):
    with caplog.at_level(logging.WARNING):
        open_backend("synthetic")
    assert "SYNTHETIC" in caplog.text and "not from hardware" in caplog.text


@pytest.mark.parametrize("bad", [1.5, -0.1, "gpu"])
def test_bad_activity_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="activity"):
        open_backend("synthetic", activity=bad)


def test_an_unknown_backend_name_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"telemetry\.backend='cuda'.*auto, nvml, amdsmi, synthetic"):
        open_backend("cuda")


# -- the generic activity interface (devices/base.py, devices/factory.py) ------------------------


def test_the_activity_input_is_the_backends_and_none_for_a_measured_device():
    backend = open_backend("synthetic", activity="marks")
    assert isinstance(activity_input(backend), ActivityInput)
    assert activity_input(open_backend("synthetic", activity=0.5)) is None  # nothing to follow

    class Measured:  # a stand-in backend without the attribute: a GPU measures its own
        name, devices = "stand-in", []

    assert activity_input(Measured()) is None  # type: ignore[arg-type]


def test_a_process_plan_carries_a_backends_options_and_the_synthetic_activity_mode():
    assert process_plan("synthetic", {"count": 2, "activity": "marks"}) == ProcessPlan(
        {"count": 2}, "marks", True
    )
    assert process_plan("synthetic", {}) == ProcessPlan({}, "auto", True)
    assert process_plan("synthetic", {"activity": 0.25}) == ProcessPlan({"activity": 0.25}, None, True)
    with pytest.raises(ConfigError, match="cannot cross"):
        process_plan("synthetic", {"activity": lambda t: 0.5})
    assert process_plan("nvml", {"x": 1}) == ProcessPlan({"x": 1}, None, False)  # no hook: as they are


def test_a_device_opened_by_plan_follows_the_level_published_from_the_other_side():
    # What the telemetry process does: the level is one word the training process's input sets.
    published = [math.nan]
    plan = process_plan("synthetic", {"activity": "marks"})
    backend = open_in_process(
        "synthetic", [0], plan, parent_pid=os.getpid(), published_level=lambda: published[0]
    )
    dev = backend.devices[0]
    assert value(dev.read(), "util_gpu_pct") == 0.0  # marks, nothing published yet: idle
    trainer_side = open_backend("synthetic", activity="marks").activity
    assert trainer_side is not None
    trainer_side.on_change = lambda level: published.__setitem__(0, level)
    rec = WindowRecorder()
    rec.add_listener(trainer_side)
    with rec.window("step", step=0), rec.window("phase", "forward"):
        assert value(dev.read(), "util_gpu_pct") == 100.0
    assert published == [0.0]


def test_the_console_line_says_when_power_is_modelled() -> None:
    from charllm_nemo.steps.observers import format_report
    from charllm_nemo.steps.report import StepReport, apply_rank_figures, pack_rank_vector

    figures = {"energy_j": 5.0, "power_avg_w": 480.0, "power_peak_w": 550.0, "throttle_any_limiting_s": 0.0}
    s = StepReport(step=0, loss=1.0, step_time_s=0.01)
    apply_rank_figures(s, [pack_rank_vector(loss=1.0, step_time_s=0.01, figures=figures)])
    assert "| 480 W/GPU avg, peak 550 W (synthetic) |" in format_report(s, 1, 1, synthetic=True)
    assert "(synthetic)" not in format_report(s, 1, 1)  # a real device's line is as it was
