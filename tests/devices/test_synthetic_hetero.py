"""Heterogeneous synthetic devices: cooling, power limit, injected throttle windows, slowdown."""

from __future__ import annotations

import math
import time

import pytest

from charllm_nemo.devices import open_backend
from charllm_nemo.devices.factory import open_in_process, process_plan
from charllm_nemo.devices.synthetic import SyntheticParams
from charllm_nemo.devices.synthetic_config import (
    SyntheticConfig,
    SyntheticDeviceConfig,
    ThrottleInjection,
    synthetic_options,
    synthetic_problems,
)
from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.config import TelemetryConfig, telemetry_problems
from charllm_nemo.telemetry.schema import decode_throttle
from tests.devices.helpers import Clock, value


def _run_steps(backend, clock, steps, compute_s=0.4, gap_s=0.1):
    """Drive the marks a training loop makes (forward + backward per step) on a fake clock;
    one reading at the end of each step's compute."""
    marks, dev = backend.activity, backend.devices[0]
    if marks.governor is not None:
        marks.governor._sleep = lambda s: None  # the fake clock drives the model, not real time
    out = []
    for _ in range(steps):
        marks("step", "step", True)
        for ph in ("forward", "backward"):
            marks("phase", ph, True)
            clock.advance(compute_s / 2)
            marks("phase", ph, False)
        out.append(dev.read())
        marks("step", "step", False)
        clock.advance(gap_s)
    return out


def _backend(cfg: SyntheticConfig, rank: int):
    clock = Clock()
    return open_backend("synthetic", activity="marks", clock=clock, **synthetic_options(cfg, rank)), clock


def test_a_poorly_cooled_device_runs_hotter_reaches_its_limit_and_clocks_down():
    # rank 1: half the cooling (twice the thermal resistance) and a 1 s time constant: at the
    # 550 W of full activity it would settle at 30 + 0.15 * 550 = 112.5 C, far above the 87 C
    # limit; rank 0, the default model, settles at 71 C and is never thermally limited.
    cfg = SyntheticConfig(devices={"1": SyntheticDeviceConfig(cooling=0.5, tau_s=1.0)})
    (cool, c0), (hot, c1) = _backend(cfg, 0), _backend(cfg, 1)
    r_cool, r_hot = _run_steps(cool, c0, 20), _run_steps(hot, c1, 20)
    t_cool = [value(r, "temp_gpu_c") for r in r_cool]
    t_hot = [value(r, "temp_gpu_c") for r in r_hot]
    assert max(t_cool) < SyntheticParams().temp_limit_c
    assert max(t_hot) > SyntheticParams().temp_limit_c
    assert all(h > c for h, c in zip(t_hot[2:], t_cool[2:], strict=True))
    hot_reasons = [decode_throttle(value(r, "throttle_reasons")) for r in r_hot]
    assert any("sw_thermal" in r for r in hot_reasons)
    assert not any("sw_thermal" in decode_throttle(value(r, "throttle_reasons")) for r in r_cool)
    thermal = [r for r, names in zip(r_hot, hot_reasons, strict=True) if "sw_thermal" in names]
    # thermally limited: the clock is the cool device's times the thermal factor (0.8)
    assert value(thermal[-1], "clock_sm_mhz") == pytest.approx(
        value(r_cool[-1], "clock_sm_mhz") * SyntheticParams().thermal_clock_factor
    )
    assert value(r_hot[-1], "violation_thermal_ns") > 0 == value(r_cool[-1], "violation_thermal_ns")


def test_a_lower_power_limit_caps_power_and_is_reported():
    cfg = SyntheticConfig(devices={"0": SyntheticDeviceConfig(power_limit_w=400.0)})
    b, clock = _backend(cfg, 0)
    r = _run_steps(b, clock, 3)[-1]
    assert value(r, "power_limit_w") == 400.0
    assert value(r, "power_instant_w") == pytest.approx(400.0)
    assert "sw_power_cap" in decode_throttle(value(r, "throttle_reasons"))
    # P ∝ f^3 on the dynamic part: (400-75)/(peak-75) of the dynamic power -> its cube root of the clock
    p = SyntheticParams()
    expected = p.clock_max_mhz * ((400 - p.idle_w) / (p.peak_w - p.idle_w)) ** (1 / 3)
    assert value(r, "clock_sm_mhz") == pytest.approx(expected)


def test_an_injected_window_by_steps_sets_its_reasons_and_lowers_the_clock_only_then():
    window = ThrottleInjection(steps=[2, 3], reasons=["hw_slowdown", "hw_power_brake"], clock_factor=0.5)
    cfg = SyntheticConfig(devices={"0": SyntheticDeviceConfig(throttle=[window])})
    b, clock = _backend(cfg, 0)
    rows = _run_steps(b, clock, 6)
    reasons = [decode_throttle(value(r, "throttle_reasons")) for r in rows]
    on = [("hw_slowdown" in r and "hw_power_brake" in r) for r in reasons]
    assert on == [False, False, True, True, False, False]
    clocks = [value(r, "clock_sm_mhz") for r in rows]
    assert clocks[2] == pytest.approx(0.5 * clocks[0]) and clocks[4] == pytest.approx(clocks[0])
    assert value(rows[3], "violation_thermal_ns") > 0  # hw_slowdown counts as thermal, like NVML's


def test_an_injected_window_by_seconds_counts_from_the_first_step():
    window = ThrottleInjection(seconds=[1.0, 2.0], reasons=["sw_thermal"], clock_factor=0.7)
    cfg = SyntheticConfig(devices={"0": SyntheticDeviceConfig(throttle=[window])})
    b, clock = _backend(cfg, 0)
    clock.advance(30.0)  # time before the first step does not count
    rows = _run_steps(b, clock, 6, compute_s=0.4, gap_s=0.1)  # reads at 0.4, 0.9, 1.4, 1.9, 2.4 s
    on = ["sw_thermal" in decode_throttle(value(r, "throttle_reasons")) for r in rows]
    assert on == [False, False, True, True, False, False]


def test_the_window_crosses_into_the_telemetry_process_with_the_level():
    # The training process publishes level + 2 * window; the device in the telemetry process
    # reads the level and the window back from that one word.
    window = ThrottleInjection(steps=[1, 1], reasons=["hw_thermal"], clock_factor=0.25)
    options = synthetic_options(SyntheticConfig(devices={"0": SyntheticDeviceConfig(throttle=[window])}), 0)
    clock = Clock()
    parent = open_backend("synthetic", activity="marks", clock=clock, **options)
    word = [math.nan]
    parent.activity.on_change = lambda v: word.__setitem__(0, v)
    plan = process_plan("synthetic", {**options, "activity": "marks", "clock": clock})
    assert "slowdown" not in plan.options and plan.options["throttle"] == options["throttle"]
    child = open_in_process("synthetic", None, plan, parent_pid=0, published_level=lambda: word[0]).devices[0]
    seen = []
    for _ in range(3):
        parent.activity("step", "step", True)
        parent.activity("phase", "forward", True)
        clock.advance(0.1)
        r = child.read()
        seen.append((value(r, "util_gpu_pct"), decode_throttle(value(r, "throttle_reasons"))))
        parent.activity("phase", "forward", False)
        parent.activity("step", "step", False)
    assert [u for u, _ in seen] == [100.0, 100.0, 100.0]  # the level crossed whole
    assert ["hw_thermal" in names for _, names in seen] == [False, True, False]


def test_slowdown_makes_compute_phases_longer_by_the_clock_drop():
    # A 10 ms compute phase on a device injected to half its clock sleeps, at its begin, the
    # phase's last length again (x 1/0.5 - 1, a little more under the power cap); the
    # uninjected device only its power-cap drop (~3 %). Judged on what the governor asked to
    # sleep against the length it measured, never on wall time: a loaded machine stretches both.
    window = ThrottleInjection(steps=[2, 10], reasons=["hw_slowdown"], clock_factor=0.5)
    cfg = SyntheticConfig(devices={"0": SyntheticDeviceConfig(throttle=[window])})
    b = open_backend("synthetic", activity="marks", **synthetic_options(cfg, 0))
    marks = b.activity
    gov = marks.governor
    assert gov is not None
    slept, measured, spans = [], [], []
    for _ in range(5):
        marks("step", "step", True)
        before = gov.slept_s
        t0 = time.monotonic()
        marks("phase", "forward", True)
        end = time.monotonic() + 0.010
        while time.monotonic() < end:  # the phase's own work: 10 ms
            pass
        marks("phase", "forward", False)
        spans.append(time.monotonic() - t0)
        slept.append(gov.slept_s - before)
        measured.append(gov.last_length_s("forward"))
        marks("step", "step", False)
    ratio = [slept[i] / measured[i - 1] for i in range(1, 5)]
    assert slept[0] == 0.0  # no length measured yet
    assert ratio[0] < 0.1  # unthrottled: the power-cap drop only
    assert all(0.95 < r < 1.25 for r in ratio[2:]), ratio  # half the clock: the phase again
    assert all(x >= 0.010 for x in measured)  # the length excludes the sleep, holds the work
    assert all(span >= s + 0.010 for span, s in zip(spans, slept, strict=True))  # the sleep is inside


def test_no_settings_no_options_and_an_unset_rank_keeps_the_default_model():
    assert synthetic_options(SyntheticConfig(), 0) == {}
    cfg = SyntheticConfig(devices={"1": SyntheticDeviceConfig(cooling=0.5)})
    assert synthetic_options(cfg, 0) == {"slowdown": True}  # every rank runs at its clock alike
    assert synthetic_options(SyntheticConfig(slowdown=False, devices=cfg.devices), 0) == {}
    p = synthetic_options(cfg, 1)["params"]
    assert p.r_gpu_c_per_w == pytest.approx(2 * SyntheticParams().r_gpu_c_per_w)


def test_bad_settings_name_the_field_and_the_fix():
    bad = {
        "slowdown": "yes",
        "devices": {
            "one": {"cooling": 1.0},
            "2": {
                "cooling": 0.0,
                "power_limit_w": -5,
                "tau_s": None,
                "ambient_c": None,
                "throttle": [{"steps": [4, 2], "seconds": None, "reasons": ["idle"], "clock_factor": 2}],
            },
        },
    }
    problems = synthetic_problems(bad)
    text = "\n".join(problems)
    for needle in (
        "telemetry.synthetic.slowdown='yes'",
        "devices has key 'one'",
        "devices.2.cooling=0.0 must be a number in [0.05, 20]",
        "devices.2.power_limit_w=-5",
        "devices.2.throttle.0.steps=[4, 2]",
        "devices.2.throttle.0.reasons=['idle']",
        "devices.2.throttle.0.clock_factor=2",
    ):
        assert needle in text
    both = synthetic_problems(
        {"devices": {"0": {"cooling": 1, "throttle": [{"reasons": ["hw_slowdown"], "clock_factor": 0.5}]}}}
    )
    assert "give exactly one of steps" in both[0]
    cfg = TelemetryConfig(synthetic=SyntheticConfig(devices={"0": SyntheticDeviceConfig(cooling=-1)}))
    assert any(
        "telemetry.synthetic.devices.0.cooling=-1" in p for p in telemetry_problems(cfg, check_out_dir=False)
    )


def test_throttle_needs_marks():
    window = ThrottleInjection(steps=[0, 1])
    options = synthetic_options(SyntheticConfig(devices={"0": SyntheticDeviceConfig(throttle=[window])}), 0)
    with pytest.raises(ConfigError, match="activity 'auto' or 'marks'"):
        open_backend("synthetic", activity=0.5, **options)


def test_the_hydra_shape_composes_into_the_typed_config():
    from charllm_nemo.train import app

    cfg = app.load(
        [
            "telemetry=synthetic",
            "++telemetry.synthetic.devices.1.cooling=0.5",
            "++telemetry.synthetic.devices.1.throttle=[{steps:[3,6],reasons:[hw_slowdown]}]",
        ]
    )
    dev = cfg.telemetry.synthetic.devices["1"]
    assert dev.cooling == 0.5 and dev.throttle[0].steps == [3, 6]
    assert dev.throttle[0].clock_factor == 0.5 and dev.throttle[0].reasons == ["hw_slowdown"]
    with pytest.raises(ConfigError, match="coolng"):
        app.load(["++telemetry.synthetic.devices.1.coolng=0.5"])
