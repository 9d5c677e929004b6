"""The grid's gauges in the live export: each device's power swing over the last step and the
rank's iteration frequency (``charllm_step_power_swing_watts``,
``charllm_power_dominant_frequency_hertz``; docs/export.md)."""

from __future__ import annotations

import math
import statistics
import time
import urllib.error
from pathlib import Path

import pytest
from tests.telemetry.test_export import _free_port, _metrics, _parse

from charllm_nemo.telemetry.config import Placement, TelemetryConfig, open_session
from charllm_nemo.telemetry.export.state import FREQUENCY_STEPS, ExportState
from charllm_nemo.telemetry.join import attribute_run
from charllm_nemo.telemetry.reader import load_run


def test_swing_is_the_steps_and_the_frequency_the_reciprocal_median_step_time() -> None:
    st = ExportState([(0, "GPU-abc", "H100"), (1, "GPU-def", "H100")], {"run": "r", "dl_rank": 0}, "node-1")
    st.take_step(0, 0.5, {0: {"power_swing_w": 450.0}, 1: {"power_swing_w": 300.0}}, (0.0, 0.0, 0.0))
    st.take_step(1, 0.5, {0: {"power_swing_w": 420.0}, 1: {"power_swing_w": math.nan}}, (0.0, 0.0, 0.0))
    st.take_step(2, 3.0, {0: {"power_swing_w": 410.0}}, (0.0, 0.0, 0.0))  # a checkpoint's slow step
    s = _parse(st.render().decode())
    # device 1 had no swing in step 1 and no figures in step 2: its series keeps step 1's, unknown
    (labels, v), *rest = s["charllm_step_power_swing_watts"]
    assert 'gpu="0"' in labels and v == 410.0 and rest == []
    freq = s["charllm_power_dominant_frequency_hertz"]
    assert 'gpu="0"' in freq[0][0] and freq[0][1] == 2.0  # 1 / median(0.5, 0.5, 3.0)
    for k in range(3, 3 + FREQUENCY_STEPS):  # the window forgets the early steps
        st.take_step(k, 0.25, {0: {"power_swing_w": 1.0}}, (0.0, 0.0, 0.0))
    assert _parse(st.render().decode())["charllm_power_dominant_frequency_hertz"][0][1] == 4.0


def test_one_rank_endpoint_serves_the_swing_and_frequency_of_its_stored_steps(tmp_path: Path) -> None:
    port = _free_port()
    cfg = TelemetryConfig(
        backend="synthetic",
        sampler="process",
        out_dir=str(tmp_path / "run"),
        export="prometheus",
        export_port=port,
    )
    session = open_session(cfg, Placement(0, 0, 1, 1, {"pp_stage": 0}))
    last = 7
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 60
        while True:  # the telemetry process up and serving (it starts slowly on a loaded machine)
            try:
                _metrics(url)
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline, "the endpoint did not come up"
                time.sleep(0.2)
        for step in range(last + 1):  # the synthetic device follows the marks: high in forward
            with session.windows.window("step", step=step):
                with session.windows.window("phase", "forward", step=step, microbatch=0):
                    time.sleep(0.06)
                time.sleep(0.04)
        deadline = time.monotonic() + 30
        s: dict[str, list[tuple[str, float]]] = {}
        while time.monotonic() < deadline:
            s = _metrics(url)
            if s.get("charllm_step", [("", -1)])[0][1] == last:
                break
            time.sleep(0.1)
    finally:
        session.close()
    assert s["charllm_step"][0][1] == last
    table = attribute_run(load_run(tmp_path / "run"), kinds=("step",))
    rows = sorted(table.select(["step", "duration_s", "power_swing_w"]).to_pylist(), key=lambda r: r["step"])
    assert s["charllm_step_power_swing_watts"][0][1] == pytest.approx(rows[last]["power_swing_w"], rel=0.01)
    # forward at full activity against the idle rest: on some step (on a loaded machine a step's
    # 0.1 s may hold one sample or none, and then no swing)
    assert max(r["power_swing_w"] or 0.0 for r in rows) > 100
    want = 1.0 / statistics.median(r["duration_s"] for r in rows[-FREQUENCY_STEPS:])
    assert s["charllm_power_dominant_frequency_hertz"][0][1] == pytest.approx(want, rel=0.01)
