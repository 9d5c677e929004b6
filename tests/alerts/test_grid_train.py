"""The job power swing / ramp alerts through a real `charllm train` over 2 gloo ranks on the
synthetic device (its power follows the phases: forward and backward high, the rest low): the
alerts fire with limits set, and the swing they state is the sum over ranks of each rank's
highest minus lowest stored sample in that step window, as the step's steps.jsonl line says."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow.compute as pc
import pytest

from charllm_nemo.telemetry.reader import load_run
from tests.deadline import deadline

pytest.importorskip("megatron.core")


def test_swing_and_ramp_limits_raise_alerts_that_rest_on_the_stored_samples(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "charllm_nemo.cli", "train", "model=tiny_gpt", "parallel=dp2", "nproc=2",
           "telemetry=synthetic", f"telemetry.out_dir={out}", "batch.train_steps=6", "telemetry.hz=500",
           "batch.global_batch_size=2", "logger=none", "alerts.power_swing_limit_w=1",
           "alerts.power_ramp_limit_w_s=1", "alerts.power_limit_steps=2",
           "alerts.power_limit_window=3"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=deadline(300))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    alerts = [json.loads(line) for line in (out / "alerts.jsonl").read_text().splitlines()]
    swing = [a for a in alerts if a["kind"] == "power_swing"]
    ramp = [a for a in alerts if a["kind"] == "power_ramp"]
    assert len(swing) == 1 and len(ramp) == 1, alerts  # once each: the rate limit holds the rest
    assert "charllm ALERT [power_swing] job power swing" in proc.stderr
    a = swing[0]
    assert a["steps_over"] >= 2 and a["world_size"] == 2 and a["job_swing_w"] > 1
    steps = {s["step"]: s for s in map(json.loads, (out / "steps.jsonl").read_text().splitlines())}
    assert steps[a["step"]]["power_swing_w"] == pytest.approx(a["job_swing_w"])
    assert steps[a["step"]]["power_ramp_down_w_s"] == pytest.approx(ramp[0]["job_ramp_down_w_s"])
    # from the stored samples: per rank, max - min of the power sampled inside the step window
    run = load_run(out)
    win = run.windows.filter(
        pc.and_(pc.equal(run.windows["kind"], "step"), pc.equal(run.windows["step"], a["step"]))
    )
    total, sampled = 0.0, 0
    for w in win.to_pylist():
        s = run.samples.filter(pc.equal(run.samples["rank"], w["rank"]))
        t = s.column("t_mono_ns").to_numpy()
        p = s.column("power_instant_w").to_numpy(zero_copy_only=False)
        inside = p[(t >= w["t_begin_mono_ns"]) & (t < w["t_end_mono_ns"]) & ~np.isnan(p)]
        if inside.size:  # a rank with no sample in the step (a loaded host) gives no swing
            total += float(inside.max() - inside.min())
            sampled += 1
    # the sum is over the ranks that sampled the step, and the alert says how many those were
    assert len(win) == 2 and sampled >= 1 and a["ranks"] == sampled
    assert total == pytest.approx(a["job_swing_w"])
