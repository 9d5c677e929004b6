"""A full disk under a training run: steps.jsonl keeps whole lines, summary.json is written
whole or compact (never a 0-byte temporary), one line says so, the run ends ``disk_full``."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from charllm_nemo.steps.observers import StepsFile
from charllm_nemo.steps.summary import write_summary
from charllm_nemo.train.disk_full import RESERVE_NAME, DiskWatch, TelemetryDiskFull
from tests.deadline import deadline


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (root only: skipped elsewhere), unmounted after."""
    where = tmp_path / "disk"
    where.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True, check=False
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def _fill(disk: Path, leave: int) -> None:
    """Fill ``disk`` up to ``leave`` bytes free (tmpfs counts whole 4 KiB pages)."""
    st = os.statvfs(disk)
    free = st.f_bavail * st.f_frsize
    (disk / "filler").write_bytes(bytes(max(free - leave, 0)))


def test_steps_file_keeps_whole_lines_when_the_disk_fills(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _fill(small_disk, 4096)
    f = StepsFile(small_disk / "steps.jsonl")
    row = {"step": 0, "loss": 6.9, "pad": "x" * 900}  # ~1 KB: the fifth line cannot fit whole
    for step in range(10):
        f.write({**row, "step": step})
    f.close()
    assert f.disk_full and f.lines == 4
    lines = (small_disk / "steps.jsonl").read_text().splitlines(keepends=True)
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3]  # every line parses
    assert all(line.endswith("\n") for line in lines)  # no half line at the end
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert (
        len(errors) == 1 and "No space left on device" in errors[0] and "the 4 before are whole" in errors[0]
    )


def test_steps_file_rolls_back_a_short_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Where no tmpfs can be mounted: the kernel's short write, then ENOSPC, injected.
    f = StepsFile(tmp_path / "steps.jsonl")
    f.write({"step": 0})
    real_write = os.write
    calls: list[int] = []

    def short_then_full(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, data[:5])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", short_then_full)
    f.write({"step": 1, "loss": 6.8})
    monkeypatch.undo()
    f.write({"step": 2})  # given up: nothing more
    f.close()
    assert f.disk_full
    assert (tmp_path / "steps.jsonl").read_text() == '{"step": 0}\n'


def test_summary_is_whole_or_compact_and_never_leaves_a_temporary(small_disk: Path) -> None:
    data = {
        "status": "complete",
        "steps": 500,
        "per_step": [{"step": i, "pad": "y" * 200} for i in range(500)],
    }
    _fill(small_disk, 16 * 1024)
    assert write_summary(small_disk / "summary.json", data) == "compact"
    written = json.loads((small_disk / "summary.json").read_text())
    assert written["steps"] == 500 and "per_step" not in written and "per_step_omitted" in written
    assert not list(small_disk.glob(".*.tmp"))
    (small_disk / "summary.json").unlink()
    (small_disk / "filler").unlink()
    _fill(small_disk, 0)  # not even the compact one fits now
    with pytest.raises(OSError):
        write_summary(small_disk / "summary.json", data)
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]  # no 0-byte temporary


class _Session:
    disk_full = False


def test_disk_watch_says_it_once_or_stops_the_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    session = _Session()
    watch = DiskWatch(tmp_path, required=False, rank=0)
    assert (tmp_path / RESERVE_NAME).stat().st_size == 64 * 1024  # room kept for summary.json
    watch.check(session, None, step=3)
    assert not watch.full and capsys.readouterr().err == ""
    session.disk_full = True
    watch.check(session, None, step=4)
    watch.check(session, None, step=5)
    err = capsys.readouterr().err
    assert err.count("is full (telemetry store, at step 4)") == 1 and "training goes on" in err
    watch.release()
    assert not (tmp_path / RESERVE_NAME).exists()
    strict = DiskWatch(tmp_path, required=True, rank=1)
    assert not (tmp_path / RESERVE_NAME).exists()  # only rank 0 writes summary.json
    with pytest.raises(TelemetryDiskFull, match=r"telemetry\.required=true"):
        strict.check(session, None, step=7)


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "charllm_nemo.cli", "train", "model=tiny_gpt", "telemetry=synthetic"]
    argv += [f"telemetry.out_dir={out}", "batch.train_steps=400", "logger=console", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=deadline(600))


@pytest.mark.parametrize("required", [False, True])
def test_a_training_run_on_a_disk_that_fills_up(tmp_path: Path, required: bool) -> None:
    pytest.importorskip("megatron.core")
    disk = tmp_path / "disk"
    disk.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(disk)], check=False)
    if made.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        out = disk / "run"
        proc = _train(out, f"telemetry.required={str(required).lower()}")
        summary = json.loads((out / "summary.json").read_text())
        manifest = json.loads((out / "rank=0" / "manifest.json").read_text() or "{}")
        steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
        leftovers = [p.name for p in out.rglob(".*") if p.is_file()]
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    err = proc.stderr
    assert summary["status"] == "disk_full", err[-3000:]
    assert steps and all("step" in s for s in steps)  # every line whole
    assert RESERVE_NAME not in leftovers and ".summary.json.tmp" not in leftovers
    # The store's side (its manifest on a full disk, no traceback at close) is the telemetry
    # session's: checked where it knows a full disk (TelemetrySession.disk_full).
    from charllm_nemo.telemetry.session import TelemetrySession

    store_side = hasattr(TelemetrySession, "disk_full")
    if store_side:
        assert manifest["status"] == "disk_full", err[-3000:]
    if required:
        assert proc.returncode == 2 or not store_side, err[-3000:]
        assert "telemetry.required=true, so training stops here" in err
        assert summary["steps"] < 400
    else:
        assert proc.returncode == 0, err[-3000:]
        assert err.count("training goes on (telemetry.required=false)") == 1
        assert summary["steps"] == 400


def _limit_file_size() -> None:
    """In the child: ``ulimit -f 100`` (100 KiB a file); SIGXFSZ ignored (Python does so too), so
    a write past the limit fails with EFBIG instead of killing the process."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100 * 1024, 100 * 1024))


def test_a_file_size_limit_is_a_full_disk_with_a_true_status(tmp_path: Path) -> None:
    """Issue 33: ``ulimit -f 100`` then 400 steps lost summary.json and ended ``complete``."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "charllm_nemo.cli", "train", "model=tiny_gpt", "telemetry=synthetic"]
    argv += [f"telemetry.out_dir={out}", "batch.train_steps=400", "logger=console"]
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=deadline(900), preexec_fn=_limit_file_size
    )
    err = proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())  # not lost: the compact one at least
    assert summary["status"] == "disk_full", err
    assert summary["steps"] == 400  # training went on (telemetry.required=false)
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert steps and [s["step"] for s in steps] == sorted(s["step"] for s in steps)  # every line whole
    assert len(steps) < 400  # the limit stopped steps.jsonl before the end
    assert not [p.name for p in out.rglob(".*.tmp")]
    assert "Traceback" not in proc.stderr, err
