"""A real subprocess samples and writes; we kill it. SIGKILL of everything may lose at most the
last second; SIGKILL of the training process alone (process mode), SIGTERM (what SLURM sends
first) and a normal exit lose nothing."""

from __future__ import annotations

import mmap
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tests.deadline import deadline

from charllm_nemo.telemetry.process import ring as shm
from charllm_nemo.telemetry.reader import load_run


def _cmd(out: Path, seconds: float, step_s: float, sampler: str = "auto") -> list[str]:
    return [sys.executable, "-m", "charllm_nemo.cli", "telemetry", "--backend", "synthetic", "--hz", "100",
            "--seconds", str(seconds), "--step-s", str(step_s), "--out", str(out),
            "--sampler", sampler]  # fmt: skip


def _start(out: Path, seconds: float = 30.0, sampler: str = "auto") -> subprocess.Popen[bytes]:
    # Its own session (process group), so that a test can kill the group as a cgroup kill would.
    return subprocess.Popen(
        _cmd(out, seconds, 0.2, sampler),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _wait_for_segments(out: Path, n: int, timeout: float = 20.0, rows: int = 0) -> None:
    """Until ``n`` sample segments, holding ``rows`` samples in all, are stored (a loaded machine
    samples fewer than 100 a second: the count is waited for, not assumed)."""
    import pyarrow.parquet as pq

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        files = list(out.glob("rank=0/samples-*.parquet"))
        if len(files) >= n and (not rows or sum(pq.read_metadata(f).num_rows for f in files) >= rows):
            return
        time.sleep(0.05)
    raise AssertionError(f"no {n} segments of {rows} samples appeared in {out}")


def _kill_between_flushes(out: Path, proc: subprocess.Popen[bytes], group: bool) -> int:
    _wait_for_segments(out, 3, deadline(20), rows=100)
    time.sleep(0.7)  # land somewhere between two flushes
    killed_at = time.monotonic_ns()  # CLOCK_MONOTONIC is system-wide: comparable with samples
    if group:
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    return killed_at


def _header(pid: int) -> mmap.mmap:
    """The header words of process ``pid``'s shared block (telemetry/process/ring.py), read-only."""
    [path] = Path(shm.SHM_DIR).glob(f"{shm.BLOCK_PREFIX}{pid}-*")
    with path.open("rb") as f:
        return mmap.mmap(f.fileno(), 128 * 8, prot=mmap.PROT_READ)


def _word(header: mmap.mmap, index: int) -> int:
    return int(struct.unpack_from("<q", header, 8 * index)[0])


def _wait_for_status(out: Path, status: str, timeout: float = 10.0) -> None:
    path = out / "rank=0" / "manifest.json"
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if f'"status": "{status}"' in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never said status {status}")


@pytest.mark.parametrize(
    ("sampler", "group"),
    [("thread", False), ("process", True)],
    ids=["thread-mode", "process-mode-whole-group"],
)
def test_sigkill_of_everything_leaves_a_readable_run_missing_at_most_one_second(tmp_path, sampler, group):
    # Thread mode: the training process holds everything. Process mode, group killed (a cgroup
    # kill): both processes die at once. Either way at most one flush interval (0.5 s) is lost.
    out = tmp_path / "run"
    proc = _start(out, sampler=sampler)
    killed_at = _kill_between_flushes(out, proc, group)
    run = load_run(out)
    t = run.samples.column("t_mono_ns").to_numpy()
    assert run.samples.num_rows >= 100
    assert (np.diff(t) > 0).all()
    lost_s = (killed_at - t.max()) / 1e9
    assert 0 <= lost_s <= 1.0, f"lost {lost_s:.3f} s of samples"
    # the writer never finished: the reader says so, and everything flushed is there
    assert run.manifests[0]["status"] == "running"
    assert run.manifests[0]["sampler_mode"] == sampler
    assert any("running" in p for p in run.problems)
    assert run.windows.num_rows > 0
    if sampler == "process":
        # Nobody was left to unlink the shared block; the next sampling process's sweep does.
        left = sorted(Path(shm.SHM_DIR).glob(f"{shm.BLOCK_PREFIX}{proc.pid}-*"))
        assert len(left) == 1
        end = time.monotonic() + 5.0  # the killed telemetry process may take a moment to go
        swept: list[str] = []
        while time.monotonic() < end and left[0].name not in swept:
            swept += shm.sweep_stale()
            time.sleep(0.05)
        assert left[0].name in swept and not left[0].exists()


def test_sigkill_of_the_training_process_alone_loses_nothing_it_marked(tmp_path):
    # Process mode, only the training process killed (a segfault, the OOM killer): its telemetry
    # process notices, stores every window finished before the death, and marks the manifest.
    out = tmp_path / "run"
    proc = _start(out, sampler="process")
    _wait_for_segments(out, 1, deadline(20))
    header = _header(proc.pid)  # mapped now: the block is unlinked once the run is closed
    killed_at = _kill_between_flushes(out, proc, group=False)
    _wait_for_status(out, "killed")
    run = load_run(out)
    m = run.manifests[0]
    t = run.samples.column("t_mono_ns").to_numpy()
    assert (np.diff(t) > 0).all()
    assert t.max() >= killed_at - 20_000_000  # sampled up to the kill (100 Hz: within 2 periods)
    assert m["rows"] == {"samples": run.samples.num_rows, "windows": run.windows.num_rows}
    assert "killed_note" in m and any("killed" in p for p in run.problems)
    # the telemetry process closed the clock mapping too (same host, same clocks)
    assert isinstance(m["clock"]["wall_minus_monotonic_ns_end"], int)
    # Every record the training process wrote into the mark ring before it died (finished
    # windows, step logs) is stored, none dropped: the ring's own counters, whatever the load
    # (a bound on the time from the last stored window to the kill failed beside two busy loops:
    # the training process, not scheduled, had marked nothing in its last 0.33 s).
    written, flushed, dropped = (
        _word(header, i) for i in (shm.H_MARK_WRITE, shm.H_MARKS_FLUSHED, shm.H_MARKS_DROPPED)
    )
    assert written > 0 and flushed == written and dropped == 0, (written, flushed, dropped)
    assert run.windows.num_rows > 0
    assert not list(Path("/dev/shm").glob(f"charllm-sampler-{proc.pid}-*"))


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
        timeout=deadline(60),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    run = load_run(out)
    assert run.manifests[0]["status"] == "complete"
    assert run.manifests[0]["synthetic"] is True
    assert 100 <= run.samples.num_rows <= 125
    assert set(run.samples.column("source").to_pylist()) == {"synthetic"}
    assert "synthetic device" in proc.stdout and "step" in proc.stdout


_SIGTERM_IN_A_MARK = """
import os, signal, sys, time
from charllm_nemo.telemetry.session import TelemetrySession
from charllm_nemo.telemetry.session_options import SessionOptions

prev = {prev}
if prev is not None:
    signal.signal(signal.SIGTERM, prev)
options = SessionOptions(backend="synthetic", hz=100, sampler=sys.argv[2])
session = TelemetrySession(sys.argv[1], options).start()
with session.windows.window("step", step=0):
    pass
# SIGTERM while the training thread is inside the recorder, holding its lock (as in any mark):
# the handler runs right here, on this thread.
with session.windows._lock:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
print("went on", flush=True)
session.close()
"""


@pytest.mark.parametrize("sampler", ["thread", "process"])
def test_sigterm_inside_a_mark_does_not_deadlock_and_still_dies_by_the_signal(tmp_path, sampler):
    out = tmp_path / "run"
    code = _SIGTERM_IN_A_MARK.format(prev=None)
    proc = subprocess.run(
        [sys.executable, "-c", code, str(out), sampler], capture_output=True, timeout=deadline(30)
    )
    assert proc.returncode == -signal.SIGTERM, proc.stderr.decode()
    assert b"went on" not in proc.stdout
    run = load_run(out)
    assert run.manifests[0]["status"] == "terminated"
    assert run.windows.num_rows >= 1 and run.problems == []


def test_sigterm_ignored_before_the_session_stays_ignored_and_the_close_says_terminated(tmp_path):
    out = tmp_path / "run"
    code = _SIGTERM_IN_A_MARK.format(prev="signal.SIG_IGN")
    proc = subprocess.run(
        [sys.executable, "-c", code, str(out), "process"], capture_output=True, timeout=deadline(30)
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"went on" in proc.stdout
    assert load_run(out).manifests[0]["status"] == "terminated"


_SIGTERM_DURING_CLOSE = """
import os, signal, sys
from charllm_nemo.telemetry import session as session_module
from charllm_nemo.telemetry.session import TelemetrySession
from charllm_nemo.telemetry.session_options import SessionOptions

def earlier(signum, frame):  # the trainer's: unwind the rank
    raise SystemExit(143)

signal.signal(signal.SIGTERM, earlier)
options = SessionOptions(backend="synthetic", hz=100, sampler=sys.argv[2])
session = TelemetrySession(sys.argv[1], options).start()
with session.windows.window("step", step=0):
    pass
close_store = session.store.close

def close_store_during_sigterm(*args, **kwargs):  # SIGTERM lands while the session closes
    os.kill(os.getpid(), signal.SIGTERM)
    return close_store(*args, **kwargs)

session.store.close = close_store_during_sigterm
try:
    session.close("failed")  # a rank failing (its peer died), then the launcher's SIGTERM
finally:
    print("closed", session._closed_fully, flush=True)
"""


@pytest.mark.parametrize("sampler", ["thread", "process"])
def test_sigterm_during_a_close_waits_for_it_then_reaches_the_earlier_handler(tmp_path, sampler):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", _SIGTERM_DURING_CLOSE, str(out), sampler],
        capture_output=True,
        timeout=deadline(30),
    )
    assert proc.returncode == 143, proc.stderr.decode()  # the earlier handler's SystemExit, after the close
    assert b"closed True" in proc.stdout
    m = load_run(out).manifests[0]
    assert m["status"] == "failed" and "ended_wall_ns" in m  # finished, with why it was closing


_PARENT_DEATH_TWICE = """
import os, signal, sys
from charllm_nemo.train.worker import sigterm_unwinds
from charllm_nemo.telemetry.session import TelemetrySession
from charllm_nemo.telemetry.session_options import SessionOptions

with sigterm_unwinds():  # as a locally launched rank runs
    options = SessionOptions(backend="synthetic", hz=100, sampler=sys.argv[2])
    session = TelemetrySession(sys.argv[1], options).start()
    close_store = session.store.close

    def close_store_during_sigterm(*args, **kwargs):  # the second delivery lands while it closes
        os.kill(os.getpid(), signal.SIGTERM)
        return close_store(*args, **kwargs)

    session.store.close = close_store_during_sigterm
    try:
        with session.windows.window("step", step=0):
            os.kill(os.getpid(), signal.SIGTERM)  # the first parent-death SIGTERM
            print("went on", flush=True)
    finally:
        try:
            session.close("failed")
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # a third, while the trainer writes its summary
            print("summary written", flush=True)
"""


@pytest.mark.parametrize("sampler", ["thread", "process"])
def test_the_launchers_death_sigterm_twice_leaves_a_closed_store_and_the_summary(tmp_path, sampler):
    # kill -9 of the local launcher: each rank gets PR_SET_PDEATHSIG's SIGTERM once per launcher
    # thread that exits. The first unwinds the rank; the later ones must not kill it mid-close.
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", _PARENT_DEATH_TWICE, str(out), sampler],
        capture_output=True,
        timeout=deadline(30),
    )
    assert proc.returncode == 143, proc.stderr.decode()  # SystemExit(143) from the first SIGTERM
    assert b"went on" not in proc.stdout and b"summary written" in proc.stdout
    run = load_run(out)
    assert run.manifests[0]["status"] == "terminated" and "ended_wall_ns" in run.manifests[0]
    assert run.windows.num_rows == 1 and run.problems == []


_HANDLER_RESETS_TO_DEFAULT = """
import os, signal, sys
from charllm_nemo.telemetry.session import TelemetrySession
from charllm_nemo.telemetry.session_options import SessionOptions

def earlier(signum, frame):  # "unwind, and a second SIGTERM kills at once"
    signal.signal(signum, signal.SIG_DFL)
    raise SystemExit(143)

signal.signal(signal.SIGTERM, earlier)
session = TelemetrySession(sys.argv[1], SessionOptions(backend="synthetic", hz=100, sampler="thread")).start()
close_store = session.store.close

def close_store_during_sigterm(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return close_store(*args, **kwargs)

session.store.close = close_store_during_sigterm
try:
    os.kill(os.getpid(), signal.SIGTERM)
finally:
    session.close("failed")
    print("not reached", flush=True)
"""


def test_a_handler_that_resets_sigterm_to_default_still_lets_the_close_finish(tmp_path):
    # The earlier handler replaced the session's with SIG_DFL; the second SIGTERM, during the
    # close, is held back until the close is done and then kills by the signal, as it asked.
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", _HANDLER_RESETS_TO_DEFAULT, str(out)],
        capture_output=True,
        timeout=deadline(30),
    )
    assert proc.returncode == -signal.SIGTERM, proc.stderr.decode()
    assert b"not reached" not in proc.stdout
    m = load_run(out).manifests[0]
    assert m["status"] == "terminated" and "ended_wall_ns" in m
