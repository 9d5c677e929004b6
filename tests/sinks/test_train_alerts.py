"""Done check of issue #29 item 1, on CPU: a real `charllm train` over gloo ranks whose rank 1
has a hot synthetic device raises a throttle alert naming rank 1, its host and the reason, and a
straggler alert naming rank 1, within a few steps of onset, in rank 0's console output,
alerts.jsonl and the offline W&B run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.deadline import deadline
from tests.sinks.wandb_reader import find_wandb_file, read_run

pytest.importorskip("wandb")
pytest.importorskip("megatron.core")

STEPS = 14
INJECT_FROM = 6  # a hw_slowdown window on rank 1 from this step: a straggler whatever the CPU noise


def _train(out, nproc, parallel, extra, env):
    cmd = [sys.executable, "-m", "charllm_nemo.cli", "train", "model=tiny_gpt", "logger=wandb",
           "+logger.settings={console: 'off', x_disable_stats: true}", "telemetry=synthetic",
           f"telemetry.out_dir={out}", f"batch.train_steps={STEPS}", f"nproc={nproc}", f"parallel={parallel}",
           # rank 1 is poorly cooled (0.5 C/W: at 550 W it passes its 87 C limit within ~0.25 s) ...
           "++telemetry.synthetic.devices.1.cooling=0.15", "++telemetry.synthetic.devices.1.tau_s=1.0",
           # ... and slows down hard for a while, so the straggler stands out of this shared VM's noise
           f"++telemetry.synthetic.devices.1.throttle=[{{steps:[{INJECT_FROM},{STEPS}],reasons:[hw_slowdown],"
           "clock_factor:0.3}]",
           "alerts.warmup_steps=3", *extra]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=deadline(600), env={**os.environ, **env}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


def _check(out, proc, rank=1):
    host = socket.gethostname()
    alerts = [json.loads(line) for line in (out / "alerts.jsonl").read_text().splitlines()]
    onset = [a for a in alerts if a["kind"] == "throttle_onset" and a["rank"] == rank]
    assert onset, alerts
    a = onset[0]
    assert a["host"] == host and a["gpu_uuid"] == "SYNTHETIC-0000" and a["gpu_index"] == 0
    assert "sw_thermal" in a["reasons"]  # the heat, as NVML's bit names it
    assert a["step"] <= 4  # the device is over its limit within ~1 s: the first steps
    stragglers = [s for s in alerts if s["kind"] == "straggler" and s["rank"] == rank]
    assert stragglers, alerts
    s = stragglers[0]
    assert s["host"] == host and s["excess"] > 0.15
    # within a few steps of the slowdown (straggler_steps=3 in a row, + the warm-up if earlier)
    assert s["step"] <= INJECT_FROM + 4
    assert s["clock_sm_avg_mhz"] < s["peers_clock_sm_avg_mhz"]  # the telemetry says why
    # the console (rank 0's stderr)
    console = proc.stderr
    # (in a pipeline the stage follows the device: "..., GPU 0 SYNTHETIC-0000, stage 1 of 4)")
    assert f"charllm ALERT [throttle_onset] rank {rank} ({host}, GPU 0 SYNTHETIC-0000" in console
    assert f"charllm ALERT [straggler] rank {rank} ({host}" in console
    # the offline W&B run: wandb.alert records and the alerts/* keys
    wb = read_run(find_wandb_file(out / "wandb"), wait_s=10)
    titles = [x["title"] for x in wb.alerts]
    assert f"charllm throttle_onset: rank {rank}" in titles and f"charllm straggler: rank {rank}" in titles
    assert any(r.get("alerts/throttle_onset") == rank for r in wb.history)
    assert any(r.get("alerts/straggler") == rank for r in wb.history)


def test_a_hot_rank_raises_throttle_and_straggler_alerts_everywhere(tmp_path, wandb_env):
    out = tmp_path / "run"
    proc = _train(out, 2, "dp2", ["batch.global_batch_size=8"], wandb_env)
    _check(out, proc)


def test_alerts_off_writes_no_alerts(tmp_path, wandb_env):
    out = tmp_path / "run"
    _train(out, 2, "dp2", ["batch.global_batch_size=8", "alerts=off", "batch.train_steps=4"], wandb_env)
    assert not (out / "alerts.jsonl").exists()


@pytest.mark.slow
def test_a_hot_pipeline_stage_in_pp4(tmp_path, wandb_env):
    out = tmp_path / "run"
    proc = _train(out, 4, "pp4", ["batch.global_batch_size=4"], wandb_env)
    _check(out, proc)


# -- pipelines (issue #32): like with like --------------------------------------------------------
PIPE_STEPS = 8
UNEVEN = {2: (4, "[3,1]"), 4: (5, "[2,1,1,1]")}  # (model.num_layers, layers per stage): stage 0 heavy
HOT = {
    # poorly cooled: over its 87 C limit within a few steps (sw_thermal, clock -20 %)
    "cooling": ["++telemetry.synthetic.devices.0.cooling=0.15", "++telemetry.synthetic.devices.0.tau_s=0.3"],
    # throttled from the very first step: no unthrottled step of its own to compare with
    "from_the_first_step": [
        f"++telemetry.synthetic.devices.0.throttle=[{{steps:[0,{PIPE_STEPS}],reasons:[sw_thermal],"
        "clock_factor:0.6}]"
    ],
}


TIMING_ATTEMPTS = 3
"""Runs a test may take for a positive verdict that needs timing evidence (retried, never loosened)."""


def _pipeline(out, nproc, extra=()):
    """One pure-pipeline run on CPU (no W&B: the lightest real run), its alerts."""
    layers, layout = UNEVEN[nproc]
    cmd = [sys.executable, "-m", "charllm_nemo.cli", "train", "model=tiny_gpt", f"model.num_layers={layers}",
           f"parallel=pp{nproc}", f"parallel.pipeline_layout={layout}", f"nproc={nproc}",
           "telemetry=synthetic", f"telemetry.out_dir={out}", f"batch.train_steps={PIPE_STEPS}",
           "batch.global_batch_size=4",
           *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    path = out / "alerts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


NO_HOT_RUNS = 3
"""Runs of an uneven pipeline with no hot device (5 until 2026-12-06). A rank alone in its stage
is a straggler only on its device's evidence (a limiting reason its peers lack and a clock that
loses the threshold: alerts/straggler.py, ``StragglerWatch.evidence``), which an unthrottled
synthetic device never gives, whatever the timing: the verdict does not rest on the host's
scheduling, which the runs
sample (3 of them, beside the hot-device runs below, which assert in each attempt that no rank
but the hot one is named: 4 to 12 more runs a layout). The rule itself is decided on constructed
steps in tests/alerts/test_pipeline.py (a stage heavier by design is no straggler)."""


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_an_uneven_pipeline_without_a_hot_device_has_no_straggler_in_3_runs(tmp_path, nproc):
    for run in range(NO_HOT_RUNS):
        alerts = _pipeline(tmp_path / f"run{run}", nproc)
        assert not [a["message"] for a in alerts if a["kind"] == "straggler"], f"run {run}"


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("hot", sorted(HOT))
def test_a_hot_device_in_a_pipeline_is_named_with_its_stage_reason_and_cost(tmp_path, nproc, hot):
    # A rank alone in its stage is a straggler only with timing evidence too (busy while the
    # other stages wait): with 4 ranks on 2 busy cores the scheduler can hide it for the whole
    # run. So the run is tried up to 3 times for the alert; no run may name another rank.
    for attempt in range(TIMING_ATTEMPTS):
        alerts = _pipeline(tmp_path / f"run{attempt}", nproc, HOT[hot])
        named = {a["rank"] for a in alerts if a["kind"] == "straggler"}
        assert named <= {0}, alerts  # never the wrong rank, whatever the load
        if named:
            break
    where = f"rank 0 ({socket.gethostname()}, GPU 0 SYNTHETIC-0000, stage 0 of {nproc})"
    onset = [a for a in alerts if a["kind"] == "throttle_onset" and a["rank"] == 0]
    assert onset, alerts
    a = onset[0]
    assert a["pp_stage"] == 0 and "sw_thermal" in a["reasons"] and a["message"].startswith(where)
    # its cost against a baseline that exists, and which one is said: alone in its stage, with no
    # unthrottled step of its own in the warm-up, the unthrottled ranks' clock
    # (on a loaded host the warm-up can leave two unthrottled steps of its own: that baseline then)
    assert a["baseline"] in ("unthrottled_clock", "own_unthrottled_steps"), a
    if a["baseline"] == "unthrottled_clock":
        assert a["cost"] == a["cost_vs_clock"] and "against the unthrottled clock" in a["message"]
    else:  # a timing: the onset step of a device heating up can be throttled for a sliver only,
        # so its cost may sit within the host's noise (-0.6 % seen in CI); said as measured
        assert a["cost"] == pytest.approx(a["compute_s"] / a["baseline_s"] - 1)
        assert a["lost_s"] == pytest.approx(a["compute_s"] - a["baseline_s"])
        assert "its own median compute" in a["message"]
    if hot == "from_the_first_step":  # throttled the whole step at 0.6x the clock: a real cost
        assert a["step"] == 0 and a["cost_vs_own"] is None
        assert a["cost"] > 0.05 and a["lost_s"] > 0
    # (the cost of a device heating up is the straggler's, below: sw_thermal, time lost > 0)
    stragglers = [s for s in alerts if s["kind"] == "straggler"]
    assert [s["rank"] for s in stragglers] == [0], alerts  # the hot one, and no other
    s = stragglers[0]
    assert s["pp_stage"] == 0 and s["compared_with"] == "unthrottled_clock" and s["lost_to"] == "sw_thermal"
    assert s["lost_s"] > 0 and s["clock_sm_avg_mhz"] < s["baseline_clock_mhz"]
    assert s["message"].startswith(where) and " to sw_thermal (" in s["message"]
