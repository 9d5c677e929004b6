"""How a training run that stops early leaves its run directory (``charllm train``, real ranks).

Ctrl-C (SIGINT to the launcher, which forwards it) and a rank killed outright (SIGKILL) must
not lose the steps already reported: rank 0 streams them to ``steps.jsonl`` as it goes, and a
rank that can still unwind writes ``summary.json`` with how the run ended.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.deadline import deadline

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

STEPS = 100_000  # never reached: the test stops the run


def _start(out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "charllm_nemo.cli", "train", "model=tiny_gpt", "telemetry.backend=synthetic",
        f"telemetry.out_dir={out}", f"batch.train_steps={STEPS}", "logger=none", *args,
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def _steps(out: Path) -> list[dict[str, Any]]:
    path = out / "steps.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines()]


def _wait_for_steps(proc: subprocess.Popen[bytes], out: Path, n: int) -> None:
    deadline = time.monotonic() + 120
    while len(_steps(out)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run did not report its first steps in time"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("signum", "status"), [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated")]
)
def test_a_stopped_run_keeps_every_reported_step_and_says_how_it_ended(
    tmp_path: Path, signum: int, status: str
) -> None:
    # Ctrl-C, or a scheduler's SIGTERM (SLURM at the time limit), to the launcher.
    out = tmp_path / "run"
    proc = _start(out)
    try:
        _wait_for_steps(proc, out, 5)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=deadline(60))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err.decode()[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == status
    steps = _steps(out)
    # The same steps (the signal may fall between a step's two records: one more in either)
    n = min(len(steps), len(summary["per_step"]))
    assert n >= 5 and summary["per_step"][:n] == steps[:n] and abs(len(steps) - len(summary["per_step"])) <= 1
    assert [s["step"] for s in steps] == list(range(len(steps)))
    assert summary["steps"] == len(summary["per_step"]) and summary["step_time_s_median"] > 0
    manifest = json.loads((out / "rank=0" / "manifest.json").read_text())
    assert manifest["status"] == status


def test_a_killed_rank_keeps_the_steps_reported_before(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _start(out)
    try:
        _wait_for_steps(proc, out, 3)
        rank_pid = json.loads((out / "rank=0" / "manifest.json").read_text())["pid"]
        os.kill(rank_pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=deadline(60))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGKILL
    assert b"rank 0 failed with killed by SIGKILL" in err, err.decode()[-2000:]
    steps = _steps(out)  # every line whole: each was handed to the kernel as one write
    assert len(steps) >= 3 and [s["step"] for s in steps] == list(range(len(steps)))
    assert all(s["loss"] is not None and s["step_time_s"] > 0 for s in steps)
    assert not (out / "summary.json").exists()  # nothing could run after SIGKILL


def test_sigterm_to_a_rank_launched_in_process_still_writes_the_summary(tmp_path: Path) -> None:
    # launcher=none (and slurm): charllm train is the rank itself, as under srun, where SLURM
    # sends SIGTERM at the time limit straight to every task.
    out = tmp_path / "run"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(29700 + os.getpid() % 200)
    proc = _start(out, "launcher=none", env=env)
    try:
        _wait_for_steps(proc, out, 3)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=deadline(60))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "terminated" and summary["steps"] >= 3
    assert json.loads((out / "rank=0" / "manifest.json").read_text())["status"] == "terminated"
