"""A real subprocess samples and writes; we kill it. SIGKILL may lose at most the last
second; SIGTERM (what SLURM sends first) and a normal exit lose nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from charllm_nemo.telemetry.reader import load_run


def _cmd(out: Path, seconds: float, step_s: float) -> list[str]:
    return [sys.executable, "-m", "charllm_nemo.cli", "telemetry", "--backend", "synthetic", "--hz", "100",
            "--seconds", str(seconds), "--step-s", str(step_s), "--out", str(out)]  # fmt: skip


def _start(out: Path, seconds: float = 30.0) -> subprocess.Popen[bytes]:
    return subprocess.Popen(_cmd(out, seconds, 0.2), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_segments(out: Path, n: int, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if len(list(out.glob("rank=0/samples-*.parquet"))) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {n} segments appeared in {out}")


def test_sigkill_leaves_a_readable_run_missing_at_most_one_second(tmp_path):
    out = tmp_path / "run"
    proc = _start(out)
    _wait_for_segments(out, 3)
    time.sleep(0.7)  # land somewhere between two flushes
    killed_at = time.monotonic_ns()  # CLOCK_MONOTONIC is system-wide: comparable with samples
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    run = load_run(out)
    t = run.samples.column("t_mono_ns").to_numpy()
    assert run.samples.num_rows >= 100
    assert (np.diff(t) > 0).all()
    lost_s = (killed_at - t.max()) / 1e9
    assert 0 <= lost_s <= 1.0, f"lost {lost_s:.3f} s of samples"
    # the writer never finished: the reader says so, and everything flushed is there
    assert run.manifests[0]["status"] == "running"
    assert any("running" in p for p in run.problems)
    assert run.windows.num_rows > 0


def test_sigterm_flushes_everything_and_marks_the_run_terminated(tmp_path):
    out = tmp_path / "run"
    proc = _start(out)
    _wait_for_segments(out, 2)
    time.sleep(0.3)
    termed_at = time.monotonic_ns()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(10)
    assert rc == -signal.SIGTERM  # died by the signal, after flushing
    run = load_run(out)
    m = run.manifests[0]
    assert m["status"] == "terminated"
    t = run.samples.column("t_mono_ns").to_numpy()
    # nothing lost: the last sample is within a couple of periods of the signal
    assert (termed_at - t.max()) / 1e9 < 0.1
    assert m["rows"]["samples"] == run.samples.num_rows
    assert m["sampler"]["samples"] == run.samples.num_rows
    assert run.problems == []


def test_a_normal_exit_writes_a_complete_run(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        _cmd(out, 1.2, 0.3),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    run = load_run(out)
    assert run.manifests[0]["status"] == "complete"
    assert run.manifests[0]["synthetic"] is True
    assert 100 <= run.samples.num_rows <= 125
    assert set(run.samples.column("source").to_pylist()) == {"synthetic"}
    assert "synthetic device" in proc.stdout and "step" in proc.stdout
