"""The grid's gauges in the live export: each device's power swing over the last step and the
rank's iteration frequency (``charllm_step_power_swing_watts``,
``charllm_power_dominant_frequency_hertz``; docs/export.md)."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import pytest
from tests.telemetry.export_endpoint import parse, scrape_at_step, serving_session

from charllm_nemo.telemetry.export.state import FREQUENCY_STEPS, ExportState
from charllm_nemo.telemetry.join import attribute_run
from charllm_nemo.telemetry.reader import load_run


def test_swing_is_the_steps_and_the_frequency_the_reciprocal_median_step_time() -> None:
    st = ExportState([(0, "GPU-abc", "H100"), (1, "GPU-def", "H100")], {"run": "r", "dl_rank": 0}, "node-1")
    st.take_step(0, 0.5, {0: {"power_swing_w": 450.0}, 1: {"power_swing_w": 300.0}}, (0.0, 0.0, 0.0))
    st.take_step(1, 0.5, {0: {"power_swing_w": 420.0}, 1: {"power_swing_w": math.nan}}, (0.0, 0.0, 0.0))
    st.take_step(2, 3.0, {0: {"power_swing_w": 410.0}}, (0.0, 0.0, 0.0))  # a checkpoint's slow step
    s = parse(st.render().decode())
    # device 1 had no swing in step 1 and no figures in step 2: its series keeps step 1's, unknown
    (labels, v), *rest = s["charllm_step_power_swing_watts"]
    assert 'gpu="0"' in labels and v == 410.0 and rest == []
    freq = s["charllm_power_dominant_frequency_hertz"]
    assert 'gpu="0"' in freq[0][0] and freq[0][1] == 2.0  # 1 / median(0.5, 0.5, 3.0)
    for k in range(3, 3 + FREQUENCY_STEPS):  # the window forgets the early steps
        st.take_step(k, 0.25, {0: {"power_swing_w": 1.0}}, (0.0, 0.0, 0.0))
    assert parse(st.render().decode())["charllm_power_dominant_frequency_hertz"][0][1] == 4.0


def test_one_rank_endpoint_serves_the_swing_and_frequency_of_its_stored_steps(tmp_path: Path) -> None:
    session, url = serving_session(tmp_path)
    last = 7
    try:
        for step in range(last + 1):  # the synthetic device follows the marks: high in forward
            with session.windows.window("step", step=step):
                with session.windows.window("phase", "forward", step=step, microbatch=0):
                    time.sleep(0.06)
                time.sleep(0.04)
        s = scrape_at_step(url, last)
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
