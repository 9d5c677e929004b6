"""A device lost mid-run: its samples stop, the user's windows do not (docs/telemetry.md)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from tests.deadline import deadline
from tests.fakes import nvml_stub

from charllm_nemo.telemetry.reader import load_run


@pytest.mark.parametrize("sampler", ["process", "thread"])
def test_windows_marked_after_the_only_device_is_lost_are_all_kept(tmp_path, sampler):
    # `charllm telemetry` on the stand-in NVML, whose GPU is lost after 900 device calls (~100
    # samples, ~1 s of sampling; by calls, not by time since the first nvmlInit: on a loaded
    # machine the session's start took longer than a time-based loss, and no sample was stored):
    # every window the command marked (4 a step) is stored, those after the loss with no samples.
    try:
        env = nvml_stub.subprocess_env(["0 lose_after_calls 900"], tmp_dir=tmp_path)
    except nvml_stub.StubUnavailable as exc:
        pytest.skip(str(exc))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "charllm_nemo.cli", "telemetry", "--backend", "nvml", "--hz", "100",
           "--seconds", "4", "--step-s", "0.1", "--out", str(out), "--sampler", sampler]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=deadline(120))
    assert done.returncode == 0, done.stderr
    assert "device 0 lost" in done.stderr
    steps = int(re.search(r"(\d+) steps marked", done.stdout).group(1))  # type: ignore[union-attr]
    run = load_run(out)
    m = run.manifests[0]
    assert m["status"] == "complete" and m["sampler"]["devices_lost"] == 1
    assert run.windows.num_rows == 4 * steps == m["windows_recorded"]
    assert m.get("store_process", {}).get("marks_dropped", 0) == 0
    last_sample = max(run.samples.column("t_mono_ns").to_pylist())
    after = [t for t in run.windows.column("t_begin_mono_ns").to_pylist() if t > last_sample]
    assert len(after) >= 4 * 10  # 4 s of 0.1 s steps, the device gone ~1 s into sampling
