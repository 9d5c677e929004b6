"""A metric that fails for a while mid-run: null in those samples, one log line per (device,
metric) in either sampler mode, and the count per metric in the manifest (docs/store.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tests.deadline import deadline
from tests.fakes import nvml_stub

from charllm_nemo.telemetry.reader import load_run

FI_POWER_INSTANT = 186


@pytest.mark.parametrize("sampler", ["process", "thread"])
def test_a_metric_failing_for_a_while_is_logged_once_and_counted(tmp_path, sampler):
    # Instant power (scope 0: the GPU; scope 1 is the memory) answers NOT_SUPPORTED in the
    # device's field reads 40 to 59: a window counted in reads, not time (one counted from the
    # library's init was missed whole when a loaded machine started sampling late).
    script = [f"0 field:{FI_POWER_INSTANT}:0 NOT_SUPPORTED", "0 field_rules_from_call 40"]
    script.append("0 field_rules_until_call 60")
    try:
        env = nvml_stub.subprocess_env(script, tmp_dir=tmp_path)
    except nvml_stub.StubUnavailable as exc:
        pytest.skip(str(exc))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "charllm_nemo.cli", "telemetry", "--backend", "nvml", "--hz", "100",
           "--seconds", "2", "--step-s", "0.1", "--out", str(out), "--sampler", sampler]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=deadline(120))
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("power_instant_w read null while sampling") == 1, done.stderr
    run = load_run(out)
    nulls = run.manifests[0]["sampler"]["nulls"]
    stored = run.samples.column("power_instant_w").null_count
    assert set(nulls) == {"power_instant_w"}  # nothing else counted: not the unsupported metrics
    assert nulls["power_instant_w"] == stored  # every null sample counted, no more
    # At most one null sample per failing read (a sample may take more than one read), one
    # unbroken run of them, whole samples before and after it.
    assert 1 <= stored <= 20
    rows = run.samples.sort_by("t_mono_ns").select(["device_index", "power_instant_w"]).to_pylist()
    power = [r["power_instant_w"] for r in rows if r["device_index"] == 0]
    null_at = [i for i, v in enumerate(power) if v is None]
    assert null_at == list(range(null_at[0], null_at[-1] + 1))
    assert power[0] is not None and power[-1] is not None
