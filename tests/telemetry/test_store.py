"""The per-rank store and its reader: atomic segments, manifests, corrupt files skipped."""

from __future__ import annotations

import json
import os

import pytest

from charllm_nemo.errors import StoreError
from charllm_nemo.telemetry.reader import CorruptSegmentWarning, list_ranks, load_rank, load_run
from charllm_nemo.telemetry.sampler import rows_to_table
from charllm_nemo.telemetry.schema import METRICS
from charllm_nemo.telemetry.store import RankStore, windows_to_table
from charllm_nemo.telemetry.windows import WindowRecorder


def _rows(n: int, t0: int = 0):
    reading = tuple(1.0 if m.kind == "float" else 1 for m in METRICS)
    return [(t0 + i * 10, t0 + i * 10, 1, 0, reading) for i in range(n)]


def _store(tmp_path, rank=0):
    return RankStore(tmp_path, rank, {"rank": rank, "backend": "test"})


def test_segments_and_manifest_round_trip(tmp_path):
    st = _store(tmp_path)
    st.write_segment("samples", rows_to_table(_rows(5), "test"))
    st.write_segment("samples", rows_to_table(_rows(7, 1000), "test"))
    rec = WindowRecorder()
    with rec.window("step", step=3):
        pass
    st.write_segment("windows", windows_to_table(rec.drain()))
    assert st.write_segment("samples", rows_to_table([], "test")) is None
    st.close("complete")
    names = sorted(p.name for p in (tmp_path / "rank=0").iterdir())
    assert names == [
        "manifest.json",
        "samples-000000.parquet",
        "samples-000001.parquet",
        "windows-000000.parquet",
    ]
    rd = load_rank(tmp_path, 0)
    assert rd.samples.num_rows == 12 and rd.windows.num_rows == 1
    assert rd.windows.column("step").to_pylist() == [3]
    assert rd.manifest["status"] == "complete" and rd.manifest["rows"] == {"samples": 12, "windows": 1}
    assert rd.problems == []


def test_a_whole_run_loads_as_one_table_with_a_rank_column(tmp_path):
    for r in (0, 1, 2):
        st = _store(tmp_path, r)
        st.write_segment("samples", rows_to_table(_rows(4 + r), "test"))
        st.close("complete")
    run = load_run(tmp_path)
    assert run.ranks == [0, 1, 2]
    assert run.samples.num_rows == 4 + 5 + 6
    assert sorted(set(run.samples.column("rank").to_pylist())) == [0, 1, 2]
    assert run.samples.column_names[0] == "rank"


def test_a_corrupt_segment_is_skipped_and_reported_not_fatal(tmp_path):
    st = _store(tmp_path)
    st.write_segment("samples", rows_to_table(_rows(5), "test"))
    bad = st.write_segment("samples", rows_to_table(_rows(5, 100), "test"))
    st.write_segment("samples", rows_to_table(_rows(5, 200), "test"))
    st.close("complete")
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])  # truncated, as a full disk leaves it
    with pytest.warns(CorruptSegmentWarning):
        rd = load_rank(tmp_path, 0)
    assert rd.samples.num_rows == 10
    assert len(rd.problems) == 1 and bad.name in rd.problems[0] and "skipped" in rd.problems[0]


def test_leftover_temporary_files_of_a_killed_writer_are_ignored(tmp_path):
    st = _store(tmp_path)
    st.write_segment("samples", rows_to_table(_rows(3), "test"))
    (st.dir / ".samples-000001.parquet.tmp").write_bytes(b"half a file")
    rd = load_rank(tmp_path, 0)
    assert rd.samples.num_rows == 3
    # status stays "running" without close(): the reader says the writer did not finish
    assert any("running" in p for p in rd.problems)


def test_an_unwritable_output_directory_is_a_clear_error(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    os.chmod(target, 0o500)
    try:
        if os.access(target, os.W_OK):  # root ignores permissions: use a path under a file
            target = tmp_path / "file"
            target.write_text("x")
        with pytest.raises(StoreError, match=r"not writable.*--out"):
            _store(target)
    finally:
        os.chmod(tmp_path / "ro", 0o700)


def test_a_folder_holding_an_earlier_run_is_refused_or_replaced(tmp_path):
    # A second run writing fewer segments than the first would leave the first run's later
    # segments behind, read as its own: refused unless told to replace it.
    first = _store(tmp_path)
    for i in range(3):
        first.write_segment("samples", rows_to_table(_rows(2, i * 100), "test"))
    first.close("complete")
    folder = tmp_path / "rank=0"
    (folder / ".windows-000009.parquet.tmp").write_bytes(b"half")  # a killed writer's temporary
    (folder / "notes.txt").write_text("mine")  # not the store's: never touched
    with pytest.raises(
        StoreError, match=r"rank=0 already holds a run \(rank=0/\.windows-000009.*\(5 files\)"
    ):
        _store(tmp_path)
    assert len(list(folder.glob("samples-*.parquet"))) == 3  # refusing removes nothing
    second = RankStore(tmp_path, 0, {"rank": 0}, overwrite=True)
    second.write_segment("samples", rows_to_table(_rows(2, 5000), "test"))
    second.close("complete")
    assert sorted(p.name for p in folder.iterdir()) == [
        "manifest.json",
        "notes.txt",
        "samples-000000.parquet",
    ]
    assert load_rank(tmp_path, 0).samples.column("t_mono_ns").to_pylist() == [5000, 5010]


def test_reading_something_that_is_not_a_run_directory(tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        list_ranks(tmp_path / "nope")
    with pytest.raises(StoreError, match="not a charllm run directory"):
        load_run(tmp_path)


def test_the_manifest_is_valid_json_at_every_moment(tmp_path):
    st = _store(tmp_path)
    assert json.loads((st.dir / "manifest.json").read_text())["status"] == "running"
    st.close("terminated", {"note": 1})
    m = json.loads((st.dir / "manifest.json").read_text())
    assert m["status"] == "terminated" and m["note"] == 1 and "ended_wall_ns" in m


def test_any_columnar_engine_reads_a_whole_run_with_the_rank_from_the_path(tmp_path):
    # the rank=N folders are Hive partitions: pyarrow.dataset (like DuckDB or Spark) reads every
    # rank's samples as one table with `rank` as a column, without our reader
    import pyarrow.dataset as ds

    for r in (0, 1):
        st = _store(tmp_path, r)
        st.write_segment("samples", rows_to_table(_rows(3 + r), "test"))
        st.close("complete")
    files = sorted(str(p) for p in tmp_path.glob("rank=*/samples-*.parquet"))
    table = ds.dataset(
        files, format="parquet", partitioning="hive", partition_base_dir=str(tmp_path)
    ).to_table()
    assert table.num_rows == 7
    assert sorted(table.column("rank").to_pylist()) == [0, 0, 0, 1, 1, 1, 1]


def test_the_space_reserve_is_not_written_through_a_link_planted_in_its_place(tmp_path) -> None:
    from charllm_nemo.telemetry.store import RESERVE_BYTES, RESERVE_NAME, reserve_space

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    folder = tmp_path / "rank=0"
    folder.mkdir()
    (folder / RESERVE_NAME).symlink_to(victim)
    reserve_space(folder)
    assert victim.read_text() == "keep me\n"  # not truncated, not filled with zeros
    reserve = folder / RESERVE_NAME
    assert not reserve.is_symlink() and reserve.stat().st_size == RESERVE_BYTES  # the link replaced
    assert sorted(x.name for x in folder.iterdir()) == [RESERVE_NAME]  # no temporary left
