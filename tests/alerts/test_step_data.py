"""What the step API carries for the alerts: each rank's phase sums of the reported step, and its
static facts once."""

from __future__ import annotations

import math
import os
import socket
import time

from charllm_nemo.steps import FunctionObserver, StepOptions, StepTelemetry
from charllm_nemo.steps.telemetry import ALERT_FIGURES, THREAD_MODE_FIGURES
from charllm_nemo.telemetry.config import Placement
from charllm_nemo.telemetry.windows import WindowRecorder


class InfoObserver(FunctionObserver):
    def __init__(self, reports):
        super().__init__(reports.append)
        self.infos = []

    def on_rank_info(self, infos):
        self.infos.append(infos)


def _busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _run(phase_times, rank_info, steps=3):
    reports = []
    obs = InfoObserver(reports)
    st = StepTelemetry(
        None, Placement(), options=StepOptions(num_microbatches=2, phase_times=phase_times,
        rank_info=rank_info), observers=[obs], recorder=WindowRecorder(),
    )  # fmt: skip
    timers = st.timers()
    for step in range(steps):
        st.begin_step(step)
        for _ in range(2):
            for name, s in (("forward-compute", 0.004), ("backward-compute", 0.006)):
                t = timers(name)
                t.start()
                _busy(s)
                t.stop()
        with st.phase("optimizer"):
            _busy(0.002)
        st.end_step(loss=1.0)
    st.finish("complete")
    return reports, obs.infos


def test_each_rank_sends_its_phase_sums_of_the_reported_step():
    reports, _ = _run(True, False)
    assert [r.step for r in reports] == [0, 1, 2]
    for r in reports:
        (t,) = r.per_rank_timing
        # at least the busy time (a loaded machine only adds): 2 x 4 ms, 2 x 6 ms, 2 ms
        assert 0.008 <= t["forward_s"] < 1 and 0.012 <= t["backward_s"] < 1
        assert 0.002 <= t["optimizer_s"] < 1 and t["pp_wait_s"] == 0.0
        assert t["step_time_s"] >= t["forward_s"] + t["backward_s"] + t["optimizer_s"]


def test_without_phase_times_only_the_step_time_travels():
    reports, infos = _run(False, False, steps=2)
    (t,) = reports[0].per_rank_timing
    assert t["step_time_s"] > 0.02 and math.isnan(t["forward_s"])
    assert infos == []


def test_the_ranks_facts_come_once_before_the_first_report():
    _, infos = _run(True, True)
    assert len(infos) == 1
    (me,) = infos[0]
    assert me["rank"] == 0 and me["host"] == socket.gethostname()
    assert me["gpu_uuid"] is None  # no session, no device


def test_thread_mode_computes_what_the_alerts_read():
    class Session:
        sampler_mode, hz, counter_every, rank, local_rank, world_size = "thread", 100.0, 1, 0, 0, 1
        windows = WindowRecorder()

    assert StepTelemetry(Session()).figures == THREAD_MODE_FIGURES
    with_alerts = StepTelemetry(Session(), options=StepOptions(phase_times=True)).figures
    assert set(ALERT_FIGURES) <= set(with_alerts) and "throttle_sw_thermal_s" in with_alerts


def test_the_sampler_health_travels_with_phase_times():
    from charllm_nemo.telemetry.sample_loop import SamplerHealth

    class Session:
        sampler_mode, hz, counter_every, rank, local_rank, world_size = "process", 100.0, 1, 0, 0, 1
        windows = WindowRecorder()

        @property  # as TelemetrySession's
        def health(self):
            h = SamplerHealth(hz=100.0, deadlines_missed=7)
            h.nulls[0] = 2
            return h

        def request_figures(self, *a, **k):
            pass

        def step_figures(self, *a, **k):
            return None

    reports = []
    st = StepTelemetry(
        Session(), options=StepOptions(phase_times=True), observers=[FunctionObserver(reports.append)]
    )
    for step in range(3):
        st.begin_step(step)
        st.end_step(loss=1.0)
    st.finish("complete", close_session=False)
    assert reports and reports[0].per_rank_health == [
        {"sampler_deadlines_missed": 7.0, "sampler_nulls": 2.0, "sampler_stopped": 0.0}
    ]


def test_each_rank_sends_its_hosts_cpu_pressure_with_phase_times():
    # issue #41: host contention is told from a slow device by these (steps/host.py)
    reports, _ = _run(True, False)
    for r in reports:
        (t,) = r.per_rank_timing
        if os.path.exists("/proc/self/schedstat"):  # Linux with schedstats: the run queue, s
            assert 0.0 <= t["run_delay_s"] < 10
        if os.path.exists("/proc/pressure/cpu"):
            assert 0.0 <= t["cpu_pressure_s"] < 10
        assert math.isnan(t["load_1m"]) or t["load_1m"] >= 0
    reports, _ = _run(False, False, steps=2)
    (t,) = reports[0].per_rank_timing
    assert math.isnan(t["run_delay_s"]) and math.isnan(t["cpu_pressure_s"])  # not read without alerts
