"""Compaction: fewer files, the same rows, and no row lost or doubled by a kill at any point."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from charllm_nemo.cli import main
from charllm_nemo.devices.contract import METRICS
from charllm_nemo.telemetry.compact import compact_rank, compact_run
from charllm_nemo.telemetry.layout import scan_run
from charllm_nemo.telemetry.reader import load_run, to_arrays
from charllm_nemo.telemetry.sampler import rows_to_table
from charllm_nemo.telemetry.store import RankStore, windows_to_table
from charllm_nemo.telemetry.windows import WindowRecorder


def _rows(n: int, t0: int) -> list:
    reading = tuple(1.0 if m.kind == "float" else 1 for m in METRICS)
    return [(t0 + i * 10, t0 + i * 10, 1, 0, reading) for i in range(n)]


def make_run(run: Path, segments: int = 6, ranks: int = 2) -> None:
    """``segments`` samples and windows segments a rank, 5 samples (t 0, 10, ...) each, written
    in reverse time order within the rank so that sorting is visible."""
    for r in range(ranks):
        st = RankStore(run, r, {"rank": r, "backend": "test", "world_size": ranks})
        st.segments.compact_every = None
        for k in range(segments):
            st.write_segment("samples", rows_to_table(_rows(5, 1000 * (segments - k)), "test"))
            rec = WindowRecorder()
            with rec.window("step", step=k):
                pass
            st.write_segment("windows", windows_to_table(rec.drain()))
        st.close("complete")


def times(run: Path) -> list[int]:
    return sorted(to_arrays(load_run(run).samples)["t_mono_ns"].tolist())


def test_compaction_keeps_every_row_in_fewer_sorted_files(tmp_path: Path) -> None:
    make_run(tmp_path)
    before = times(tmp_path)
    steps_before = sorted(load_run(tmp_path).windows.column("step").to_pylist())
    compact_run(tmp_path)
    names = sorted(p.name for p in (tmp_path / "rank=0").iterdir())
    assert names == ["manifest.json", "samples-000000-000005.parquet", "windows-000000-000005.parquet"]
    assert times(tmp_path) == before and len(before) == 2 * 6 * 5
    assert sorted(load_run(tmp_path).windows.column("step").to_pylist()) == steps_before
    t = pq.read_table(tmp_path / "rank=0" / "samples-000000-000005.parquet").column("t_mono_ns").to_numpy()
    assert np.all(np.diff(t) >= 0)  # sorted by time
    meta = pq.ParquetFile(tmp_path / "rank=0" / "samples-000000-000005.parquet").metadata
    assert meta.row_group(0).column(0).statistics.has_min_max
    compact_run(tmp_path)  # again: nothing to do, nothing changes
    assert sorted(p.name for p in (tmp_path / "rank=0").iterdir()) == names


def test_a_compaction_interrupted_after_its_rename_reads_each_row_once(tmp_path: Path) -> None:
    make_run(tmp_path, ranks=1)
    before = times(tmp_path)
    folder = tmp_path / "rank=0"
    keep = {p.name: p.read_bytes() for p in folder.glob("samples-*.parquet")}
    compact_rank(folder, kinds=("samples",))
    for name, data in list(keep.items())[:4]:  # as if killed after removing only two of six
        (folder / name).write_bytes(data)
    files = scan_run(tmp_path)
    assert [p.name for p in files.ranks[0].samples] == ["samples-000000-000005.parquet"]
    assert {i.kind for i in files.ignored} == {"superseded"} and files.problems() == []
    assert times(tmp_path) == before
    compact_rank(folder)  # the next compaction removes what the first left
    assert not any(i.kind == "superseded" for i in scan_run(tmp_path).ignored)
    assert times(tmp_path) == before


def test_a_narrower_compacted_file_inside_a_wider_one_is_superseded(tmp_path: Path) -> None:
    make_run(tmp_path, ranks=1)
    folder = tmp_path / "rank=0"
    data = {p.name: p.read_bytes() for p in folder.glob("samples-*.parquet")}
    compact_rank(folder, kinds=("samples",))
    wide = (folder / "samples-000000-000005.parquet").read_bytes()
    for p in folder.glob("samples-*.parquet"):
        p.unlink()
    for name, d in data.items():
        (folder / name).write_bytes(d)
    from charllm_nemo.telemetry.compact import compact_files

    compact_files(folder, "samples", [folder / f"samples-00000{k}.parquet" for k in range(3)])
    (folder / "samples-000000-000005.parquet").write_bytes(wide)
    names = [p.name for p in scan_run(tmp_path).ranks[0].samples]
    assert names == ["samples-000000-000005.parquet"]  # 000000-000002 and 3, 4, 5 superseded
    assert len(times(tmp_path)) == 30


_KILLER = """
import os, signal, sys
from pathlib import Path
from charllm_nemo.telemetry import compact
n = int(sys.argv[2]); calls = [0]
real = Path.unlink
def unlink(self, missing_ok=False):
    if self.name.startswith("samples-") or self.name.startswith("windows-"):
        calls[0] += 1
        if calls[0] > n:
            os.kill(os.getpid(), signal.SIGKILL)
    return real(self, missing_ok=missing_ok)
Path.unlink = unlink
real_replace = os.replace
def replace(a, b, **kw):
    if n < 0:
        os.kill(os.getpid(), signal.SIGKILL)  # killed before the rename: only a temporary exists
    return real_replace(a, b, **kw)
compact.os.replace = replace
compact.compact_run(sys.argv[1])
"""


@pytest.mark.parametrize("kill_after", [-1, 0, 1, 5, 11])
def test_sigkill_at_any_point_of_a_compaction_loses_nothing(tmp_path: Path, kill_after: int) -> None:
    make_run(tmp_path)
    before, steps = times(tmp_path), sorted(load_run(tmp_path).windows.column("step").to_pylist())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", _KILLER, str(tmp_path), str(kill_after)], env=env, timeout=300
    )
    assert done.returncode == -signal.SIGKILL
    assert times(tmp_path) == before
    assert sorted(load_run(tmp_path).windows.column("step").to_pylist()) == steps
    compact_run(tmp_path)  # and a later compaction finishes the job
    assert times(tmp_path) == before
    assert all(len(rf.samples) == 1 for rf in scan_run(tmp_path).ranks.values())


def test_live_compaction_bounds_the_file_count(tmp_path: Path) -> None:
    st = RankStore(tmp_path, 0, {"rank": 0, "backend": "test"})
    st.segments.compact_every = 3
    st.segments.compact_period_s = 0.0  # (by count alone here; by time: the test below)
    for k in range(7):
        st.write_segment("samples", rows_to_table(_rows(2, 100 * k), "test"))
    names = sorted(p.name for p in st.dir.glob("samples-*.parquet"))
    assert names == [
        "samples-000000-000002.parquet",
        "samples-000003-000005.parquet",
        "samples-000006.parquet",
    ]
    st.close("complete")
    assert len(times(tmp_path)) == 14


def test_a_planted_link_at_the_temporary_name_is_not_followed(tmp_path: Path) -> None:
    make_run(tmp_path, ranks=1)
    victim = tmp_path.parent / f"{tmp_path.name}-victim.txt"
    victim.write_text("mine")
    (tmp_path / "rank=0" / ".samples-000000-000005.parquet.tmp").symlink_to(victim)
    compact_run(tmp_path)
    assert victim.read_text() == "mine"
    assert len(times(tmp_path)) == 30


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_run(tmp_path)
    assert main(["compact", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "24 segment file(s) -> 4" in out
    # every row of both ranks rewritten: 2 x (30 samples + 6 windows) (was always "0 rows")
    assert "; 72 rows read, 72 rows written\n" in out, out
    assert "nothing to merge" not in out
    assert main(["compact", str(tmp_path)]) == 0  # already compacted: says so, not only "0 rows"
    again = capsys.readouterr().out
    assert "4 segment file(s) -> 4; 0 rows read, 0 rows written (nothing to merge" in again, again
    assert main(["compact", str(tmp_path / "nope")]) == 2
    assert json.loads((tmp_path / "rank=0" / "manifest.json").read_text())["status"] == "complete"


def test_live_compaction_makes_one_file_a_period_however_fast_segments_come(tmp_path: Path) -> None:
    # Issue 48: windows flushed faster than every 0.5 s made a compacted file per 120 segments,
    # more than 60 a rank-hour. Scaled down tenfold here (12 segments, 6 s, at most 48 waiting):
    # segments twice as fast as the flush interval still make one file a period.
    st = RankStore(tmp_path, 0, {"rank": 0, "backend": "test"})
    w = st.segments
    w.compact_every, w.compact_period_s, w.compact_max = 12, 6.0, 48
    clock = [0.0]
    w.clock = lambda: clock[0]
    w._since = 0.0
    for k in range(96):  # four periods, a segment every 0.25 s
        clock[0] = (k + 1) * 0.25
        st.write_segment("samples", rows_to_table(_rows(1, k), "test"))
    compacted = sorted(p.name for p in st.dir.glob("samples-*-*.parquet"))
    assert len(compacted) == 4  # one a period, not 8 (one per 12 segments)
    # ... and never more than compact_max segments wait, however fast they come
    w.compact_period_s = 1e9
    for k in range(96, 96 + 49):
        st.write_segment("samples", rows_to_table(_rows(1, k), "test"))
    waiting = [p for p in st.dir.glob("samples-*.parquet") if p.name.count("-") == 1]
    assert len(waiting) < 48 and len(list(st.dir.glob("samples-*-*.parquet"))) == 5
    st.close("complete")
    assert len(times(tmp_path)) == 96 + 49


def _overlapping(run: Path) -> int:
    """Rank 0's samples as segment 0 and two compacted files whose ranges overlap (1-3 and 2-4:
    segments 2 and 3 in both); returns the number of distinct samples."""
    make_run(run, segments=5, ranks=1)
    folder = run / "rank=0"
    segs = {k: pq.read_table(folder / f"samples-{k:06d}.parquet") for k in range(5)}
    for k in range(1, 5):
        (folder / f"samples-{k:06d}.parquet").unlink()
    pq.write_table(pa.concat_tables([segs[1], segs[2], segs[3]]), folder / "samples-000001-000003.parquet")
    pq.write_table(pa.concat_tables([segs[2], segs[3], segs[4]]), folder / "samples-000002-000004.parquet")
    return sum(t.num_rows for t in segs.values())


def test_overlapping_compacted_ranges_are_read_once_and_said(tmp_path: Path) -> None:
    """Issue 43: samples 1-3 and 2-4 were both read (segments 2-3 twice), and compaction wrote
    the doubling into one file for good."""
    unique = _overlapping(tmp_path)
    run = load_run(tmp_path)
    assert run.samples.num_rows == unique == 25
    assert sorted(times(tmp_path)) == sorted(set(times(tmp_path)))
    assert any(
        "overlap samples-000001-000003.parquet" in p and "10 samples row(s)" in p for p in run.problems
    )
    problems: list[str] = []
    compact_run(tmp_path, problems)
    assert any("overlap" in p for p in problems)
    assert [p.name for p in scan_run(tmp_path).ranks[0].samples] == ["samples-000000-000004.parquet"]
    assert load_run(tmp_path).samples.num_rows == unique  # one copy, for good


def test_compact_counts_rows_held_twice_by_overlapping_files_once_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 43: "rows rewritten" was the rows written, which leave out the copies overlapping
    files both held, without a word: now the rows read and written, and the difference said."""
    unique = _overlapping(tmp_path)
    folder = tmp_path / "rank=0"
    files = scan_run(tmp_path).ranks[0]
    held = {k: sum(pq.read_metadata(p).num_rows for p in getattr(files, k)) for k in ("samples", "windows")}
    assert held["samples"] == unique + 10  # segments 2 and 3 (5 samples each) in both files
    assert main(["compact", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    read, written = held["samples"] + held["windows"], unique + held["windows"]
    assert (
        f"; {read} rows read, {written} rows written (10 held twice by files with overlapping "
        "segment ranges, written once)"
    ) in out, out
    assert pq.read_metadata(folder / "samples-000000-000004.parquet").num_rows == unique


def test_every_compacted_file_is_one_a_reader_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A compacted file could hold 8,388,608 rows while every reader refuses a file of more than
    # 4,000,000: compaction of a long run made it unreadable. Scaled down: readers accept 24 rows
    # a file, the run holds 6 segments of 5 samples (30 rows).
    from charllm_nemo.telemetry import layout

    make_run(tmp_path, segments=6, ranks=1)
    before = sorted(times(tmp_path))
    monkeypatch.setattr(layout, "MAX_SEGMENT_ROWS", 24)
    compact_run(tmp_path, [])
    files = scan_run(tmp_path).ranks[0].samples
    assert 1 < len(files) < 6  # merged, but not into one file a reader would refuse
    run = load_run(tmp_path)
    assert not [p for p in run.problems if "not read" in p], run.problems
    assert sorted(times(tmp_path)) == before  # every sample still read back
