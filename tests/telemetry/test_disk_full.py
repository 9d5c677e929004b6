"""A full disk mid-run: telemetry stops writing with one clear line, what it wrote stays readable,
and the session ends with status ``disk_full`` (docs/store.md)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from charllm_nemo.telemetry import store as store_module
from charllm_nemo.telemetry.reader import load_run
from charllm_nemo.telemetry.sampler import rows_to_table
from charllm_nemo.telemetry.schema import METRICS
from charllm_nemo.telemetry.session import TelemetrySession
from charllm_nemo.telemetry.session_options import SessionOptions, StoreOptions
from charllm_nemo.telemetry.store import DISK_FULL, SegmentWriter


def _rows(n: int, t0: int = 0) -> list[tuple[object, ...]]:
    reading = tuple(1.0 if m.kind == "float" else 1 for m in METRICS)
    return [(t0 + i, t0 + i, 1, 0, reading) for i in range(n)]


def _step_until_disk_full(session: TelemetrySession, seconds: float = 10) -> None:
    """Steps of 20 ms on ``session`` until its store finds the disk full or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while not session.disk_full and time.monotonic() < deadline:
        with session.windows.window("step", step=0):
            time.sleep(0.02)


@pytest.fixture
def enospc_after(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Parquet writes succeed ``budget[0]`` times, then fail as a full disk does: part of the
    temporary written, then ENOSPC."""
    budget = [2]
    real = pq.write_table

    def write_table(table: object, where: object, **kw: object) -> None:
        if budget[0] <= 0:
            where.write(b"PAR1")  # type: ignore[attr-defined]  # a partial temporary, as a full disk leaves
            raise OSError(errno.ENOSPC, "No space left on device")
        budget[0] -= 1
        real(table, where, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(store_module.pq, "write_table", write_table)
    yield budget


def test_a_full_disk_stops_the_writer_with_one_line_and_no_temporary(tmp_path, enospc_after, caplog):
    writer = SegmentWriter(tmp_path)
    with caplog.at_level(logging.ERROR, "charllm_nemo.store"):
        for i in range(6):
            writer.write_segment("samples", rows_to_table(_rows(10, 100 * i), "synthetic"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["samples-000000.parquet", "samples-000001.parquet"]
    assert [r.levelno for r in caplog.records] == [logging.ERROR]  # one line, not one per flush
    assert "disk is full" in caplog.records[0].getMessage() and DISK_FULL in caplog.records[0].getMessage()
    counts = writer.counts()
    assert counts["rows"]["samples"] == 20 and counts["rows_unwritten"]["samples"] == 40
    assert counts["segments"]["samples"] == 2 and counts["disk_full"] is True


def test_a_session_that_hits_a_full_disk_ends_disk_full_and_stays_readable(tmp_path, enospc_after, caplog):
    enospc_after[0] = 10**9  # the start (its warm-up write) is not the disk's problem
    session = TelemetrySession(
        tmp_path,
        SessionOptions(
            backend="synthetic", hz=200, sampler="thread", store=StoreOptions(flush_interval_s=0.05)
        ),
    )
    session.start()
    time.sleep(0.3)
    assert not session.disk_full
    enospc_after[0] = 0
    with caplog.at_level(logging.ERROR, "charllm_nemo"):
        _step_until_disk_full(session)
        time.sleep(0.3)  # more flushes on the full disk
        assert session.disk_full
        assert session.close("complete") == DISK_FULL
    assert session.close("complete") == DISK_FULL  # idempotent
    assert len([r for r in caplog.records if "disk is full" in r.getMessage()]) == 1
    assert not [r for r in caplog.records if r.exc_info]  # no traceback
    assert "choose another telemetry.out_dir / --out" in caplog.text  # charllm train's words
    run = load_run(tmp_path)
    m = run.manifests[0]
    assert m["status"] == DISK_FULL and m["disk_full"] is True and m["rows_unwritten"]["samples"] > 0
    assert run.samples.num_rows > 0 and run.problems == []
    assert not list((tmp_path / "rank=0").glob(".*"))  # no temporary, no reserve after close


def test_the_disk_full_line_names_the_integrations_keyword(tmp_path, enospc_after, caplog):
    # #40: a callback's user wrote out_dir=..., not telemetry.out_dir / --out
    from charllm_nemo.telemetry.store import out_dir_option

    assert (
        out_dir_option({"integration": {"owner": "PowerThermalCallback"}})
        == "PowerThermalCallback(out_dir=...)"
    )
    assert out_dir_option(None) == out_dir_option({"telemetry": {}}) == "telemetry.out_dir / --out"
    config = {"integration": {"owner": "MegatronLMTelemetry"}}
    session = TelemetrySession(
        tmp_path,
        SessionOptions(
            backend="synthetic", hz=200, sampler="thread", store=StoreOptions(flush_interval_s=0.05)
        ),
        config=config,
    )
    session.start()
    enospc_after[0] = 0
    with caplog.at_level(logging.ERROR, "charllm_nemo"):
        _step_until_disk_full(session)
        session.close("complete")
    line = next(r.getMessage() for r in caplog.records if "disk is full" in r.getMessage())
    assert line.endswith("Free space or choose another MegatronLMTelemetry(out_dir=...)"), line


@contextlib.contextmanager
def _small_tmpfs(tmp_path: Path, size: str) -> Iterator[Path]:
    where = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]
    done = subprocess.run(cmd, capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(folder: Path, leave_bytes: int) -> None:
    """Fill the filesystem of ``folder`` until about ``leave_bytes`` are free."""
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    with open(folder / "filler", "wb") as f, contextlib.suppress(OSError):
        f.write(b"\0" * max(0, free - leave_bytes))


@pytest.mark.parametrize("sampler", ["thread", "process"])
def test_a_real_full_disk_in_either_mode(tmp_path, sampler, capfd, caplog):
    # A 4 MiB tmpfs, filled to ~40 KB free once the session started: the segments run out of
    # room within a second; the final manifest still fits (the store's reserve).
    with _small_tmpfs(tmp_path, "4m") as disk:
        out = disk / "run"
        session = TelemetrySession(
            out,
            SessionOptions(
                backend="synthetic", hz=500, sampler=sampler, store=StoreOptions(flush_interval_s=0.05)
            ),
        )
        session.start()
        _fill(disk, 40_000)
        deadline = time.monotonic() + 20
        step = 0
        while not session.disk_full and time.monotonic() < deadline:
            with session.windows.window("step", step=step):
                time.sleep(0.01)
            step += 1
        assert session.disk_full, "the store never noticed the full disk"
        for i in range(20):  # training goes on after it
            with session.windows.window("step", step=step + i):
                time.sleep(0.01)
        assert session.close("complete") == DISK_FULL
        err = capfd.readouterr().err + caplog.text  # the telemetry process's stderr, or this one's log
        assert err.count("disk is full") == 1, err
        assert "Traceback" not in err, err
        manifest = json.loads((out / "rank=0" / "manifest.json").read_text())
        assert manifest["status"] == DISK_FULL and "ended_wall_ns" in manifest
        (disk / "filler").unlink()
        run = load_run(out)
        assert run.samples.num_rows > 0 and run.problems == []
        hidden = [p.name for p in (out / "rank=0").iterdir() if p.name.startswith(".")]
        assert hidden == []  # no temporary; the reserve went at close
