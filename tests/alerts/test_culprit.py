"""Culprit or victim (issue #41): in data, tensor and expert parallel layouts the rank that waits
at a collective is the victim; the alert names the rank that held the others, and only for its
device where its device says so; a rank held back by a contended host is said to be, and a cost
is never negative. Decision functions on constructed steps (fast); tests/alerts/
test_culprit_train.py runs the real trainer."""

from __future__ import annotations

import math

import pytest

from charllm_nemo.alerts import AlertDetector, AlertsConfig
from charllm_nemo.alerts.culprit import arrival, host_verdict, timing_verdict
from charllm_nemo.steps.host import (
    HostPressure,
    parse_load_1m,
    parse_psi_some_total,
    parse_schedstat,
    parse_stat_cpu,
)
from charllm_nemo.steps.report import StepReport, apply_rank_figures, pack_rank_vector

INFOS = [
    {"rank": r, "local_rank": r, "host": "node0", "gpu_index": r, "gpu_uuid": f"GPU-{r}", "gpu_name": "H200"}
    for r in range(4)
]
CFG = AlertsConfig(warmup_steps=1, straggler_steps=3)
NAN = math.nan


def _rank(
    fwd=0.03,
    bwd=0.05,
    opt=0.01,
    sync=0.001,
    temp=60.0,
    clock=1980.0,
    thermal_s=0.0,
    run_delay=NAN,
    psi=NAN,
    steal=NAN,
    load=NAN,
):
    """One rank's vector: its phases (s), the gradient all-reduce's wait ``sync`` (s), its
    device's figures and its host's pressure (steps/host.py fields)."""
    step_s = fwd + bwd + opt + sync
    figures = {
        "duration_s": step_s,
        "power_avg_w": 500.0,
        "temp_gpu_peak_c": temp,
        "clock_sm_avg_mhz": clock,
        "throttle_sw_thermal_s": thermal_s * step_s,
    }
    timing = (step_s, fwd, bwd, opt, 0.0, sync, run_delay, psi, steal, load)
    return pack_rank_vector(step_time_s=step_s, figures=figures, timing=timing)


def _alerts(det, steps, kind=None):
    out = []
    for step, ranks in enumerate(steps):
        rep = StepReport(step=step, loss=1.0, step_time_s=0.1)
        apply_rank_figures(rep, ranks)
        out += det.check(rep)
    return [a for a in out if a["kind"] == kind or (kind is None and a["kind"] != "thermal_imbalance")]


def _detector(n=2, coupled=False, cfg=CFG):
    det = AlertDetector(cfg, collectives_in_phases=coupled)
    det.set_rank_info(INFOS[:n])
    return det


# -- the decision functions ---------------------------------------------------------------------
def test_the_last_to_arrive_waited_least_and_held_the_others():
    # an all-reduce releases every rank together: each rank's wait is the last one's lateness
    arr = arrival([0, 1, 2], [0.050, 0.002, 0.040], [0.04, 0.09, 0.05], 0.002)
    assert arr is not None and arr.order == (0, 2, 1) and arr.last == 1
    assert arr.held_s == pytest.approx(0.043)  # the others' median wait beyond its own
    assert arr.held_excess == pytest.approx(0.043 / 0.045)  # over the others' median compute
    assert arr.waited_s(0) == pytest.approx(0.048)
    # waits within the noise floor, or one unknown: the marks cannot tell who was late
    assert arrival([0, 1], [0.0011, 0.001], [0.1, 0.1], 0.002) is None
    assert arrival([0, 1], [None, 0.001], [0.1, 0.1], 0.002) is None
    assert arrival([0], [0.05], [0.1], 0.002) is None


def test_what_the_timing_says_of_each_rank():
    arr = arrival([0, 1], [0.050, 0.001], [0.04, 0.09], 0.002)
    assert timing_verdict(1, arr, False, False, 0.15, 0.002) == "held"
    assert timing_verdict(0, arr, True, False, 0.15, 0.002) == "waited"  # its long phase: a victim's
    small = arrival([0, 1], [0.004, 0.001], [0.09, 0.09], 0.002)  # 3 ms on 90 ms: noise
    assert timing_verdict(1, small, False, False, 0.15, 0.002) == "none"
    assert timing_verdict(0, small, True, False, 0.15, 0.002) == "none"
    # no verdict from the marks: the phases, unless the layout puts collectives inside them
    assert timing_verdict(0, None, True, False, 0.15, 0.002) == "over"
    assert timing_verdict(0, None, True, True, 0.15, 0.002) == "unmeasured"
    # collectives inside the phases: the ranks met there; who was last at the gradient all-reduce
    # after them is noise
    assert timing_verdict(1, arr, False, True, 0.15, 0.002) == "unmeasured"
    assert timing_verdict(0, None, False, False, 0.15, 0.002) == "none"


def test_host_contention_needs_a_reading_that_shows_it():
    quiet = {"step_time_s": 0.1, "run_delay_s": 0.001, "cpu_pressure_s": 0.002, "cpu_steal_share": 0.0}
    busy = {**quiet, "cpu_pressure_s": 0.06, "load_1m": 2.5}
    queued = {**quiet, "run_delay_s": 0.03}
    stolen = {**quiet, "cpu_steal_share": 0.2}
    assert host_verdict(0, [1], [quiet, quiet], 0.04, 0.1, 0.002) is None
    facts = host_verdict(0, [1], [busy, quiet], 0.04, 0.1, 0.002)
    assert facts is not None and facts["cpu_pressure_share"] == pytest.approx(0.6)
    assert facts["said"][0] == "some task on its host waited for a CPU 60% of the step (PSI)"
    assert facts["said"][-1] == "load 2.5 per CPU"
    facts = host_verdict(0, [1], [queued, quiet], 0.04, 0.1, 0.002)
    assert facts is not None and "its training thread waited 30 ms for a CPU (run queue" in facts["said"][0]
    assert facts["peers_run_delay_s"] == 0.001
    assert host_verdict(0, [1], [queued, queued], 0.04, 0.1, 0.002) is None  # its peers waited as long
    assert "(steal)" in host_verdict(0, [1], [stolen, quiet], 0.04, 0.1, 0.002)["said"][0]
    nothing = {"step_time_s": 0.1, "run_delay_s": NAN, "cpu_pressure_s": NAN}
    assert host_verdict(0, [1], [nothing, nothing], 0.04, 0.1, 0.002) is None  # not known: no verdict


def test_the_host_counters_as_linux_writes_them():
    assert parse_schedstat(b"11325952 4923827 7\n") == pytest.approx(0.004923827)
    psi = b"some avg10=94.94 avg60=96.94 avg300=60.90 total=287464880\nfull avg10=0.00 total=0\n"
    assert parse_psi_some_total(psi) == pytest.approx(287.46488)
    assert parse_stat_cpu(b"cpu  75644 66 21179 54411 1406 0 286 170 0 0\ncpu0 1 2 3\n") == (170, 153162)
    assert parse_load_1m(b"9.16 5.82 2.62 10/281 13468\n") == 9.16
    for parse in (parse_schedstat, parse_psi_some_total, parse_stat_cpu, parse_load_1m):
        assert parse(None) is None and parse(b"") is None
    h = HostPressure(pid=2**22 + 7)  # no such process: its counters are unknown, the host's still read
    delay, *_ = h.sample()
    assert math.isnan(delay)
    h.close()
    assert all(math.isnan(x) for x in h.sample())


# -- the detector: data parallel ----------------------------------------------------------------
COOL = {}
HOT = {"clock": 1500.0, "temp": 92.0, "thermal_s": 1.0}  # sw_thermal all the step, clock -24 %


def test_a_hot_rank_that_holds_its_peers_at_the_all_reduce_is_the_culprit():
    # rank 1 computes 40 % longer at a lower clock; rank 0 waits for it in the all-reduce
    steps = [[_rank(), _rank(**HOT, fwd=0.042, bwd=0.07, opt=0.014, sync=0.001)]] * 5
    steps = [[_rank(sync=0.037), s[1]] for s in steps]
    (s,) = _alerts(_detector(), steps, "straggler")
    assert (s["rank"], s["cause"], s["timing"]) == (1, "device", "held")
    assert s["compared_with"] == "same_stage_peers" and s["excess"] == pytest.approx(0.4)  # its compute
    assert s["arrived_last"] is True and s["held_peers_s"] == pytest.approx(0.036)
    assert s["lost_to"] == "sw_thermal" and s["lost_s"] > 0
    assert "arrived last at the step's collectives: its 1 peer(s) waited 36 ms for it" in s["message"]


def test_the_cool_rank_that_waits_is_never_named_and_a_busy_host_is_said_to_be():
    # The run: rank 0 (cool) held back by the host's CPUs arrives last; the hot rank 1
    # waits for it in the all-reduce. Timing alone named rank 0 a straggler ("forward +243 %").
    held_back = _rank(fwd=0.10, sync=0.001, run_delay=0.04, psi=0.1, load=3.0)
    hot_waiting = _rank(**HOT, fwd=0.035, sync=0.066, run_delay=0.002, psi=0.1)
    alerts = _alerts(_detector(), [[held_back, hot_waiting]] * 5)
    # the hot rank waits only because the host held rank 0 longer than its clock cost it: its
    # device (sw_thermal, -24 % clock) names it; the cool rank is never a device straggler
    assert [(a["rank"], a["timing"]) for a in alerts if a["kind"] == "straggler"] == [(1, "masked")]
    (h,) = [a for a in alerts if a["kind"] == "host_contention"]
    assert (h["rank"], h["cause"], h["step"], h["host"]) == (0, "host_cpu", 3, "node0")
    assert h["run_delay_s"] == 0.04 and h["held_s"] == pytest.approx(0.065)
    assert "not the device; host CPU contention" in h["message"]
    assert "its training thread waited 40 ms for a CPU" in h["message"]


def test_no_hot_device_a_late_rank_with_no_host_reading_is_held_not_blamed():
    det = _detector()
    alerts = _alerts(det, [[_rank(fwd=0.06), _rank(sync=0.031)]] * 5)
    assert alerts == [] and det.held == 1  # once: 3 steps in a row, then counted anew
    assert "the evidence cannot say why" in det.held_last and "rank 0 held its peers" in det.held_last


def test_in_steps_the_host_decided_the_hot_ranks_device_decides():
    # rank 1 is hot (its device costs it ~28 ms a step) and arrives last, until the host holds
    # rank 0 back far longer (run queue 300 ms): then rank 1 waits, which says nothing of its
    # device; its device's evidence decides, as where no arrival can be seen
    late = _rank(**HOT, fwd=0.042, bwd=0.07, opt=0.014, sync=0.001, run_delay=0.01)
    peer = _rank(sync=0.037, run_delay=0.01)
    hot_waits = _rank(**HOT, fwd=0.042, bwd=0.07, opt=0.014, sync=0.25, run_delay=0.01)
    queued = _rank(fwd=0.35, sync=0.001, run_delay=0.3)
    (s,) = _alerts(_detector(), [[peer, late]] * 2 + [[queued, hot_waits]] * 2, "straggler")
    assert (s["rank"], s["step"], s["timing"], s["arrived_last"]) == (1, 3, "masked", False)
    assert "who arrived last was the host's doing this step" in s["message"]
    alerts = _alerts(_detector(), [[queued, hot_waits]] * 4)
    named = {(a["kind"], a["rank"]) for a in alerts if a["kind"] in ("straggler", "host_contention")}
    assert named == {("straggler", 1), ("host_contention", 0)}  # what held the group: rank 0's host
    # without the host's readings the steps rank 1 waited reset it: no straggler
    hot = dict(**HOT, fwd=0.042, bwd=0.07, opt=0.014)
    plain = [[_rank(sync=0.037), _rank(**hot, sync=0.001)]] * 2
    plain += [[_rank(fwd=0.35, sync=0.001), _rank(**hot, sync=0.25)]]
    assert _alerts(_detector(), plain * 2, "straggler") == []
    # and a straggler whose own times the host stretched says so
    steps = [[_rank(sync=0.037, run_delay=0.0), _rank(**hot, sync=0.001, run_delay=0.02)]] * 4
    (s,) = _alerts(_detector(), steps, "straggler")
    assert "its host also held it: 20 ms more than its peers waiting for a CPU" in s["message"]
    assert s["run_delay_beyond_peers_s"] == pytest.approx(0.02)


def test_a_throttled_rank_measured_faster_than_its_peers_costs_the_clock_not_a_negative():
    # The throttle's onset step: the peers' compute held host noise; timing says -20 %
    det = _detector()
    (a,) = _alerts(det, [[_rank(fwd=0.05), _rank(**HOT)]], "throttle_onset")
    assert a["baseline"] == "unthrottled_clock" and a["cost"] == pytest.approx(1980 / 1500 - 1)
    assert a["cost"] >= 0 and a["lost_s"] >= 0
    assert "measured 18% faster than its stage's 1 unthrottled rank(s)' median compute" in a["cost_note"]
    assert "cost from the clock instead" in a["message"]


# -- the detector: tensor / expert parallel (collectives inside the phases) ---------------------
def test_coupled_ranks_the_device_decides_and_the_cost_is_the_clocks():
    # In tensor parallel the cool rank waits inside its own forward: both phases are as long
    same = dict(fwd=0.045, bwd=0.075, opt=0.015)
    steps = [[_rank(**same), _rank(**HOT, **same)]] * 5
    det = _detector(coupled=True)
    alerts = _alerts(det, steps)
    onset = [a for a in alerts if a["kind"] == "throttle_onset"]
    assert len(onset) == 1 and onset[0]["baseline"] == "unthrottled_clock"  # not the peers' +0 %
    assert onset[0]["cost"] == pytest.approx(1980 / 1500 - 1)
    (s,) = [a for a in alerts if a["kind"] == "straggler"]
    assert (s["rank"], s["compared_with"], s["timing"]) == (1, "unthrottled_clock", "unmeasured")
    assert "its peers wait for it inside the phases" in s["message"]
    # no hot device: a phase over the peers' says nothing there
    det = _detector(coupled=True)
    assert _alerts(det, [[_rank(fwd=0.07, run_delay=0.05, psi=0.1), _rank()]] * 6) == []
    assert det.held == 0
