"""Issue #32: a real session whose sampler stalls for ~1 s raises the sampler-health alert, through
the step API, in both engines: the telemetry process paused (SIGSTOP / SIGCONT), and the thread
sampler held off by a C call that keeps the GIL (what a badly behaved extension does)."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import time
from pathlib import Path

import pytest

from charllm_nemo.alerts import ALERTS_FILE, AlertsConfig, alert_observer
from charllm_nemo.steps import StepOptions, StepTelemetry
from charllm_nemo.telemetry.config import Placement, TelemetryConfig, open_session
from tests.deadline import deadline

HZ = 100.0
STALL_S = 1.0
STEPS = 8
STALL_AT = 3


def _pause_process(session) -> None:
    pid = session.engine.pid
    assert pid is not None and pid != os.getpid()  # the telemetry process, not this one
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(STALL_S)
    finally:
        os.kill(pid, signal.SIGCONT)


def _hold_the_gil(session) -> None:
    # PyDLL calls keep the GIL: the sampler thread cannot run until usleep returns.
    libc = ctypes.PyDLL(None)
    libc.usleep(ctypes.c_uint(int(STALL_S * 1e6)))


@pytest.mark.parametrize(("sampler", "stall"), [("process", _pause_process), ("thread", _hold_the_gil)])
def test_a_stalled_sampler_raises_the_sampler_health_alert(tmp_path: Path, sampler, stall) -> None:
    cfg = TelemetryConfig(out_dir=str(tmp_path), backend="synthetic", sampler=sampler, hz=HZ)
    session = open_session(cfg, Placement(), handle_signals=False)
    assert session.sampler_mode == sampler
    # The stall must come while the sampler samples: its process took 5.4 s to start at load 35
    # (two busy loops beside), after all 8 steps and the stall (1 sample, 0 deadlines missed).
    until = time.monotonic() + deadline(60)
    while session.health.samples < 2:
        assert time.monotonic() < until, session.health
        time.sleep(0.02)
    obs = alert_observer(AlertsConfig(console=False), run_dir=tmp_path)
    assert obs is not None
    options = StepOptions(phase_times=True, rank_info=True, total_steps=STEPS)
    st = StepTelemetry(session, Placement(), options=options, observers=[obs])
    for step in range(STEPS):
        st.begin_step(step)
        time.sleep(0.03)
        if step == STALL_AT:
            stall(session)
        st.end_step(loss=1.0)
    st.finish("complete")
    missed = session.health.deadlines_missed
    # ~1 s without a sample at 100 Hz: about 100 deadlines (a loaded machine only adds)
    assert missed >= 0.5 * STALL_S * HZ, session.health
    health = [a for a in obs.alerts if a["kind"] == "sampler_health"]
    assert health, obs.alerts
    a = health[0]
    assert a["problem"] == "deadlines_missed" and a["rank"] == 0
    assert a["deadlines_missed_new"] >= 0.5 * STALL_S * HZ
    # with the report that was due at the stall's end: figures arrive a few steps late
    assert 0 <= a["step"] <= STALL_AT
    assert "missed" in a["message"]
    lines = [json.loads(x) for x in (tmp_path / ALERTS_FILE).read_text().splitlines()]
    assert any(x["kind"] == "sampler_health" and x["problem"] == "deadlines_missed" for x in lines)
