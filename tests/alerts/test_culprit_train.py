"""Issue #41's done check on CPU: a real `charllm train` over 2 gloo ranks in data, tensor and
expert parallel layouts, with a CPU hog beside it (a busy host). Until rank 1's device slows
down no rank is named a device straggler (a rank held back by the host is named host
contention, with the readings that say so, or the verdict is held); once it slows, rank 1 is the
straggler named, never the cool rank 0; no cost is negative. The decisions themselves are
tested on constructed steps in tests/alerts/test_culprit.py."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.deadline import deadline

pytest.importorskip("megatron.core")

STEPS = 14
INJECT_FROM = 7  # rank 1's device at half its clock (hw_slowdown) from this step to the end
LAYOUTS = {"dp2": "tiny_gpt", "tp2": "tiny_gpt", "ep2": "tiny_moe"}


@pytest.fixture
def cpu_hog() -> Iterator[subprocess.Popen[bytes]]:
    """A process that keeps one CPU busy for the test (the host contention the alerts must not
    blame on a device)."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield hog
    finally:
        hog.kill()
        hog.wait()


def _train(out, layout, extra=()):
    cmd = [sys.executable, "-m", "charllm_nemo.cli", "train", f"model={LAYOUTS[layout]}",
           f"parallel={layout}", "nproc=2", "telemetry=synthetic", f"telemetry.out_dir={out}",
           f"batch.train_steps={STEPS}",
           "batch.global_batch_size=2", "logger=none", "alerts.warmup_steps=3", *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=deadline(300))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    path = out / "alerts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _costs(alert):
    return {k: v for k, v in alert.items() if (k == "cost" or k == "lost_s") and v is not None}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_hot_rank_is_the_culprit_and_a_busy_host_is_no_device_straggler(tmp_path, layout, cpu_hog):
    hot = (
        f"++telemetry.synthetic.devices.1.throttle=[{{steps:[{INJECT_FROM},{STEPS}],reasons:[hw_slowdown],"
        "clock_factor:0.5}]"
    )
    alerts = _train(tmp_path / "run", layout, [hot])
    stragglers = [a for a in alerts if a["kind"] == "straggler"]
    # no hot device until INJECT_FROM: no device straggler, whatever the host did meanwhile
    assert not [s["message"] for s in stragglers if s["step"] < INJECT_FROM], alerts
    # then the hot rank, and never the cool one. Or none, where the host was loaded beyond the
    # hog and said so: beside two more busy loops (CI under load) rank 1 waited for a descheduled
    # rank 0 in some steps, the straggler_steps in a row were not reached and the verdict was
    # held (no guess), while rank 0's sampler missed its deadlines (sampler_health).
    named = [s["rank"] for s in stragglers]
    assert named == [1] or (not named and "sampler_health" in {a["kind"] for a in alerts}), alerts
    for s in stragglers:
        assert s["cause"] == "device" and s["lost_to"] == "hw_slowdown" and s["lost_s"] > 0
        if layout in ("tp2", "ep2"):  # its peer waits for it inside the phases: its device decides
            assert s["timing"] == "unmeasured" and s["compared_with"] == "unthrottled_clock"
        else:  # it arrives last at the gradient all-reduce, or its phases are over its peer's
            assert s["timing"] in ("held", "over", "masked"), s  # masked: the host decided the step
    for a in alerts:
        assert all(v >= 0 for v in _costs(a).values()), a  # no negative cost anywhere
        if a["kind"] == "host_contention":  # said as the host's, with what showed it
            assert a["cause"] == "host_cpu" and "not the device; host CPU contention" in a["message"]
            assert a["cpu_pressure_share"] is not None or a["run_delay_s"] is not None
    onset = [a for a in alerts if a["kind"] == "throttle_onset"]
    assert [a["rank"] for a in onset] == [1] and onset[0]["step"] >= INJECT_FROM
    assert onset[0]["cost"] is not None and onset[0]["cost"] > 0
