"""The alert logic over step reports: each alert, its threshold, its fields, the rate limit."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest

from charllm_nemo.alerts import ALERTS_FILE, AlertDetector, AlertsConfig, alert_observer, alerts_problems
from charllm_nemo.errors import ConfigError
from charllm_nemo.steps.report import StepReport, apply_rank_figures, pack_rank_vector

INFOS = [
    {"rank": r, "local_rank": r % 2, "host": f"node{r // 2}", "gpu_index": r % 2, "gpu_uuid": f"GPU-{r}",
     "power_limit_w": 700.0}
    for r in range(4)
]  # fmt: skip


def _rank(
    step_s=0.1,
    fwd=0.03,
    bwd=0.05,
    opt=0.01,
    temp=60.0,
    power=500.0,
    clock=1980.0,
    thermal_s=0.0,
    cap_s=0.0,
    pp_wait=0.0,
):
    figures = {
        "duration_s": step_s,
        "power_avg_w": power,
        "power_peak_w": power + 50,
        "temp_gpu_peak_c": temp,
        "clock_sm_avg_mhz": clock,
        "clock_sm_min_mhz": clock,
        "throttle_sw_thermal_s": thermal_s,
        "throttle_sw_power_cap_s": cap_s,
    }
    return pack_rank_vector(step_time_s=step_s, figures=figures, timing=(step_s, fwd, bwd, opt, pp_wait, 0.0))


def _report(step, ranks):
    rep = StepReport(step=step, loss=1.0, step_time_s=max(r[0] for r in ranks) if ranks else 0.1)
    apply_rank_figures(rep, [_rank(*r) if isinstance(r, tuple) else r for r in ranks])
    return rep


def _run(det, steps):
    out = []
    for step, ranks in enumerate(steps):
        out += det.check(_report(step, ranks))
    return out


def test_throttle_onset_names_rank_host_gpu_reason_share_and_cost_then_its_end():
    det = AlertDetector(AlertsConfig())
    det.set_rank_info(INFOS[:2])
    cool = (0.1, 0.03, 0.05, 0.01)
    hot = (0.1, 0.045, 0.075, 0.015, 90.0, 400.0, 1584.0, 0.08)  # 80 % of the step under sw_thermal
    alerts = _run(det, [[cool, cool]] * 4 + [[cool, hot]] * 2 + [[cool, cool]] * 2)
    onset = [a for a in alerts if a["kind"] == "throttle_onset"]
    assert len(onset) == 1
    a = onset[0]
    assert (a["step"], a["rank"], a["host"], a["gpu_index"], a["gpu_uuid"]) == (4, 1, "node0", 1, "GPU-1")
    assert a["reasons"] == ["sw_thermal"] and a["share"] == pytest.approx(0.8)
    # compute 0.135 s against its own 0.09 s and the other rank's 0.09 s: +50 % both
    assert a["compute_cost_vs_own"] == pytest.approx(0.5) and a["cost_vs_fastest"] == pytest.approx(0.5)
    assert a["fastest_rank"] == 0 and a["baseline_step_time_s"] == pytest.approx(0.1)
    assert a["clock_sm_avg_mhz"] == 1584.0 and a["temp_gpu_peak_c"] == 90.0
    # the cost's baseline: the unthrottled rank doing the same work, said in the fields and text
    assert a["baseline"] == "same_stage_peers" and a["cost"] == pytest.approx(0.5)
    assert a["lost_s"] == pytest.approx(0.045) and a["cost_vs_clock"] == pytest.approx(1980 / 1584 - 1)
    assert (
        "+50% (45 ms lost) against its stage's 1 unthrottled rank(s)' median compute 0.090 s" in a["message"]
    )
    assert "rank 1 (node0, GPU 1 GPU-1)" in a["message"] and "sw_thermal 80%" in a["message"]
    end = [a for a in alerts if a["kind"] == "throttle_end"]
    assert len(end) == 1 and end[0]["step"] == 7 and end[0]["throttled_steps"] == 2  # 2 steps below ends it
    assert end[0]["since_step"] == 4


def test_the_power_cap_alone_is_not_a_throttle_alert_by_default():
    det = AlertDetector(AlertsConfig())
    capped = (0.1, 0.03, 0.05, 0.01, 60.0, 700.0, 1900.0, 0.0, 0.1)  # 100 % sw_power_cap
    assert not [a for a in _run(det, [[capped, capped]] * 5) if a["kind"].startswith("throttle")]
    det = AlertDetector(AlertsConfig(throttle_reasons=["sw_power_cap"]))
    assert [a["kind"] for a in _run(det, [[capped, capped]])] == ["throttle_onset", "throttle_onset"]


def test_a_straggler_is_flagged_after_n_steps_over_its_peers_median_with_its_telemetry():
    cfg = AlertsConfig(warmup_steps=1, straggler_steps=3, straggler_threshold=0.15)
    det = AlertDetector(cfg)
    det.set_rank_info(INFOS)
    normal = (0.1, 0.03, 0.05, 0.01, 60.0, 500.0, 1980.0)
    slow = (0.1, 0.036, 0.06, 0.012, 85.0, 450.0, 1650.0, 0.05)  # +20 % compute, throttled half the step
    alerts = _run(det, [[normal] * 4] + [[normal, normal, slow, normal]] * 4)
    stragglers = [a for a in alerts if a["kind"] == "straggler"]
    assert len(stragglers) == 1
    s = stragglers[0]
    assert (s["rank"], s["host"], s["step"]) == (2, "node1", 3)  # slow from step 1: 3 steps in a row
    assert s["metrics"]["compute_s"]["excess"] == pytest.approx(0.2)
    assert s["peers_clock_sm_avg_mhz"] == 1980.0 and s["clock_sm_avg_mhz"] == 1650.0
    assert s["throttle_shares"] == {"sw_thermal": pytest.approx(0.5)}
    assert s["compared_with"] == "same_stage_peers" and s["peers"] == [0, 1, 3] and s["pp_stage"] is None
    # what it lost to the clock: its compute at 1650 MHz against the same work at 1980 MHz
    assert s["lost_to"] == "sw_thermal" and s["lost_s"] == pytest.approx(0.108 * (1 - 1650 / 1980))
    assert "lost 18 ms to sw_thermal (50% of the step; clock 1650 MHz vs 1980 MHz" in s["message"]


def test_no_straggler_below_the_threshold_the_floor_or_in_warm_up():
    det = AlertDetector(AlertsConfig(warmup_steps=0, straggler_steps=1, straggler_min_s=0.002))
    normal = (0.1, 0.03, 0.05, 0.01)
    assert not _run(det, [[normal, (0.1, 0.033, 0.055, 0.011)]] * 3)  # +10 %: under 15 %
    tiny = (0.1, 0.0001, 0.0001, 0.0001)
    assert not _run(det, [[tiny, (0.1, 0.0003, 0.0003, 0.0003)]] * 3)  # x3, but by < 2 ms
    det = AlertDetector(AlertsConfig(warmup_steps=5, straggler_steps=1))
    assert not _run(det, [[normal, (0.1, 0.06, 0.1, 0.02)]] * 5)  # all in warm-up


def test_thermal_imbalance_is_per_node_and_power_over_the_limit():
    det = AlertDetector(AlertsConfig(thermal_imbalance_c=15.0, power_over_limit=0.05))
    det.set_rank_info(INFOS)
    ranks = [
        (0.1, 0.03, 0.05, 0.01, 60.0),
        (0.1, 0.03, 0.05, 0.01, 80.0),  # node0: 20 C apart
        (0.1, 0.03, 0.05, 0.01, 62.0),
        (0.1, 0.03, 0.05, 0.01, 70.0, 760.0),
    ]  # node1: 8 C; 760 W
    alerts = det.check(_report(0, ranks))  # fmt: skip
    thermal = [a for a in alerts if a["kind"] == "thermal_imbalance"]
    assert len(thermal) == 1 and thermal[0]["host"] == "node0"
    assert (thermal[0]["hottest_rank"], thermal[0]["coolest_rank"], thermal[0]["spread_c"]) == (1, 0, 20.0)
    power = [a for a in alerts if a["kind"] == "power_over_limit"]
    assert len(power) == 1 and power[0]["rank"] == 3 and power[0]["over"] == pytest.approx(760 / 700 - 1)


def test_the_rate_limit_holds_back_repeats_and_caps_a_step():
    det = AlertDetector(AlertsConfig(repeat_after_steps=10, max_per_step=8))
    det.set_rank_info(INFOS)
    hot = [(0.1, 0.03, 0.05, 0.01, 60.0), (0.1, 0.03, 0.05, 0.01, 80.0)]
    kinds = [[a["kind"] for a in det.check(_report(s, hot))] for s in range(12)]
    assert [s for s, k in enumerate(kinds) if "thermal_imbalance" in k] == [0, 10]
    assert det.suppressed == 10  # steps 1-9 and 11
    det = AlertDetector(AlertsConfig(max_per_step=1))
    det.set_rank_info(INFOS)
    assert len(det.check(_report(0, [(0.1, 0.03, 0.05, 0.01, 60.0, 900.0)] * 4))) == 1
    assert det.suppressed == 3


def test_unknown_figures_raise_nothing():
    det = AlertDetector(AlertsConfig(warmup_steps=0, straggler_steps=1))
    empty = [pack_rank_vector(), pack_rank_vector()]
    rep = StepReport(step=0, loss=None, step_time_s=0.1)
    apply_rank_figures(rep, empty)
    assert det.check(rep) == []
    assert det.check(StepReport(step=1, loss=None, step_time_s=0.1)) == []  # figures not due


def test_the_observer_delivers_to_console_file_sink_and_hooks(tmp_path):
    class Sink:
        def __init__(self):
            self.got = []

        def log_alert(self, step, alert):
            self.got.append((step, alert["kind"]))

    seen, sink, console = [], Sink(), io.StringIO()

    def broken(alert):
        raise RuntimeError("a user's bug")

    obs = alert_observer(
        AlertsConfig(), run_dir=tmp_path, sink=sink, hooks=[seen.append, broken], stream=console
    )
    assert obs is not None and not (tmp_path / ALERTS_FILE).exists()  # made at the first alert
    obs.on_rank_info(INFOS[:2])
    obs.on_step(_report(0, [(0.1, 0.03, 0.05, 0.01, 60.0), (0.1, 0.03, 0.05, 0.01, 90.0)]))
    obs.on_step(_report(1, [(0.1, 0.03, 0.05, 0.01, 60.0, 800.0), (0.1, 0.03, 0.05, 0.01)]))
    obs.close("complete")
    lines = [json.loads(x) for x in (tmp_path / ALERTS_FILE).read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["thermal_imbalance", "power_over_limit"]
    assert all(isinstance(x["wall_ns"], int) for x in lines)
    assert [k for _, k in sink.got] == ["thermal_imbalance", "power_over_limit"]
    assert [a["kind"] for a in seen] == ["thermal_imbalance", "power_over_limit"]
    assert console.getvalue().count("charllm ALERT [") == 2
    assert obs.hooks[1] is None  # the broken hook was dropped after its first failure


def test_a_link_planted_at_alerts_jsonl_is_one_warning_and_alerts_go_on(tmp_path, caplog):
    """A link at ``alerts.jsonl`` mid-run: refused (never followed), said once, and every alert
    still reaches the console, W&B and the hooks (each alert was an ELOOP traceback, and lost)."""

    class Sink:
        def __init__(self):
            self.got = []

        def log_alert(self, step, alert):
            self.got.append(alert["kind"])

    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / ALERTS_FILE).symlink_to(victim)
    console, seen, sink = io.StringIO(), [], Sink()
    obs = alert_observer(AlertsConfig(), run_dir=tmp_path, sink=sink, hooks=[seen.append], stream=console)
    obs.on_rank_info(INFOS[:2])
    obs.on_step(_report(0, [(0.1, 0.03, 0.05, 0.01, 60.0), (0.1, 0.03, 0.05, 0.01, 90.0)]))
    obs.on_step(_report(1, [(0.1, 0.03, 0.05, 0.01, 60.0, 800.0), (0.1, 0.03, 0.05, 0.01)]))
    obs.close("complete")
    assert victim.read_text() == "keep" and (tmp_path / ALERTS_FILE).is_symlink()
    assert console.getvalue().count("charllm ALERT [") == 2
    assert sink.got == [a["kind"] for a in seen] == ["thermal_imbalance", "power_over_limit"]
    said = [r for r in caplog.records if ALERTS_FILE in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING" and not said[0].exc_info


def test_off_installs_nothing_and_bad_settings_name_the_field():
    assert alert_observer(AlertsConfig(enabled=False)) is None
    assert alert_observer(None) is None
    bad = replace(
        AlertsConfig(), straggler_threshold=-1, straggler_steps=0, throttle_reasons=["idle"], hook="x"
    )
    problems = alerts_problems(bad)
    assert any("alerts.straggler_threshold=-1" in p for p in problems)
    assert any("alerts.straggler_steps=0" in p for p in problems)
    assert any("alerts.throttle_reasons=['idle']" in p for p in problems)
    assert any("alerts.hook='x'" in p for p in problems)
    with pytest.raises(ConfigError, match=r"alerts\.straggler_steps"):
        alert_observer(bad)
    with pytest.raises(ConfigError, match="cannot be loaded"):
        alert_observer(replace(AlertsConfig(), hook="no_such_module_x:fn"))


def test_the_config_group_composes_default_and_off():
    from charllm_nemo.train import app

    assert app.load([]).alerts == AlertsConfig()
    assert app.load(["alerts=off"]).alerts == replace(AlertsConfig(), enabled=False)
    assert app.load(["alerts.straggler_steps=5"]).alerts.straggler_steps == 5


def test_sampler_health_deadlines_nulls_and_a_stop():
    det = AlertDetector(AlertsConfig(sampler_missed=10))
    det.set_rank_info(INFOS[:1])

    def rep(step, missed, nulls, stopped):
        r = StepReport(step=step, loss=1.0, step_time_s=0.1)
        apply_rank_figures(
            r,
            [pack_rank_vector(step_time_s=0.1, figures={"duration_s": 0.1}, health=(missed, nulls, stopped))],
        )
        return r

    counts = [(0, 0, 0), (5, 0, 0), (25, 0, 0), (26, 3, 0), (26, 3, 1), (26, 3, 1)]
    seen = [[(a["problem"], a["severity"]) for a in det.check(rep(s, *h))] for s, h in enumerate(counts)]
    assert seen == [
        [],
        [],
        [("deadlines_missed", "warning")],
        [("nulls", "warning")],
        [("stopped", "error")],
        [],
    ]
    unknown = StepReport(step=9, loss=1.0, step_time_s=0.1)
    apply_rank_figures(unknown, [pack_rank_vector(step_time_s=0.1, figures={"duration_s": 0.1})])
    assert det.check(unknown) == []  # not sent (alerts off on that rank): nothing to judge


def test_the_training_thread_only_queues_and_a_thread_behind_drops_and_counts(monkeypatch):
    import threading

    from charllm_nemo.alerts import observer as observer_module

    monkeypatch.setattr(observer_module, "QUEUE_STEPS", 2)
    release, checked = threading.Event(), []
    obs = alert_observer(AlertsConfig(), stream=io.StringIO())
    assert obs is not None

    def slow_check(report):  # the detector of a large job: far slower than a queue put
        release.wait(10.0)
        checked.append(report.step)
        return []

    obs.detector.check = slow_check  # type: ignore[method-assign]
    reports = [_report(s, [(0.1, 0.03, 0.05, 0.01), (0.1, 0.03, 0.05, 0.01)]) for s in range(5)]
    for rep in reports:
        obs.on_step(rep)  # returns at once although no step has been checked
    assert checked == []
    # one report taken by the thread (waiting in check), two queued, the rest dropped and counted
    assert obs.dropped >= 1 and len(checked) + obs.dropped <= 5
    release.set()
    obs.close("complete")
    assert checked == sorted(checked) and len(checked) + obs.dropped == 5
    assert obs._thread is not None and not obs._thread.is_alive()
