"""A run directory read as untrusted input: what scan_run accepts, what it ignores and why, and
reads that are bounded and never block."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from charllm_nemo.errors import StoreError
from charllm_nemo.telemetry import store
from charllm_nemo.telemetry.layout import (
    UnsafeFileError,
    iter_jsonl,
    read_bounded,
    read_json,
    scan_run,
)
from charllm_nemo.telemetry.reader import CorruptSegmentWarning, load_run
from charllm_nemo.telemetry.sampler import rows_to_table
from charllm_nemo.telemetry.schema import METRICS
from charllm_nemo.telemetry.store import RankStore


def _rows(n: int, t0: int = 0) -> list[tuple[int, int, int, int, tuple[float | int, ...]]]:
    reading = tuple(1.0 if m.kind == "float" else 1 for m in METRICS)
    return [(t0 + i * 10, t0 + i * 10, 1, 0, reading) for i in range(n)]


def _write_run(root: Path, ranks: tuple[int, ...] = (0,), rows: int = 3) -> Path:
    for r in ranks:
        st = RankStore(root, r, {"rank": r, "backend": "synthetic", "status": "running"})
        st.write_segment("samples", rows_to_table(_rows(rows), "synthetic"))
        st.close("complete")
    return root


def _kinds(files: object) -> dict[str, str]:
    return {i.path.name: i.kind for i in files.ignored}  # type: ignore[attr-defined]


def test_a_clean_run_is_accepted_whole_and_nothing_is_ignored(tmp_path: Path) -> None:
    _write_run(tmp_path, (0, 1, 10))
    (tmp_path / "steps.jsonl").write_text("{}\n")
    (tmp_path / "logs").mkdir()
    files = scan_run(tmp_path)
    assert files.rank_ids == [0, 1, 10]
    assert files.ranks[0].manifest == tmp_path / "rank=0" / "manifest.json"
    assert [p.name for p in files.ranks[1].samples] == ["samples-000000.parquet"]
    assert files.steps == tmp_path / "steps.jsonl" and files.summary is None
    assert files.ignored == ()


def test_rank_folders_outside_the_documented_names_are_ignored_with_a_reason(tmp_path: Path) -> None:
    # rank=00 beside rank=0 counted rank 0 twice; rank=7 linked to another run mixed its data in.
    _write_run(tmp_path / "run", (0,))
    other = _write_run(tmp_path / "other", (0,))
    run = tmp_path / "run"
    (run / "rank=00").mkdir()
    (run / "rank=x").mkdir()
    (run / "rank=-1").mkdir()
    (run / "rank=3").write_text("not a folder")
    os.symlink(other / "rank=0", run / "rank=7")
    files = scan_run(run)
    assert files.rank_ids == [0]
    assert _kinds(files) == {
        "rank=00": "name",
        "rank=x": "name",
        "rank=-1": "name",
        "rank=3": "not a directory",
        "rank=7": "symlink",
    }
    data = load_run(run)
    assert data.ranks == [0] and data.samples.num_rows == 3
    assert any("rank=7: ignored: is a symbolic link" in p for p in data.problems)


def test_segments_outside_the_pattern_or_linked_are_not_read(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", (0,), rows=3)
    foreign = _write_run(tmp_path / "foreign", (0,), rows=50)
    r0 = run / "rank=0"
    os.symlink(foreign / "rank=0" / "samples-000000.parquet", r0 / "samples-000001.parquet")
    (r0 / "samples-1.parquet").write_bytes((r0 / "samples-000000.parquet").read_bytes())
    (r0 / "samples-0000002.parquet").write_bytes((r0 / "samples-000000.parquet").read_bytes())
    (r0 / ".samples-000003.parquet.tmp").write_bytes(b"half")
    (r0 / store.RESERVE_NAME).write_bytes(b"\0" * 10)  # what a running writer holds back
    os.mkfifo(r0 / "windows-000000.parquet")
    files = scan_run(run)
    assert [p.name for p in files.ranks[0].samples] == ["samples-000000.parquet"]
    assert files.ranks[0].windows == ()
    assert _kinds(files) == {
        "samples-000001.parquet": "symlink",
        "samples-1.parquet": "name",
        "samples-0000002.parquet": "name",
        ".samples-000003.parquet.tmp": "temporary",
        ".manifest.json.reserve": "temporary",
        "windows-000000.parquet": "not a regular file",
    }
    data = load_run(run)
    assert data.samples.num_rows == 3  # not 3 + 50 foreign rows
    assert not any(".tmp" in p for p in data.problems)  # a temporary is normal, not a problem
    assert len(data.problems) == 4


def test_a_manifest_linked_to_dev_zero_or_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    run = _write_run(tmp_path, (0, 1))
    (run / "rank=0" / "manifest.json").unlink()
    os.symlink("/dev/zero", run / "rank=0" / "manifest.json")
    (run / "rank=1" / "manifest.json").unlink()
    os.mkfifo(run / "rank=1" / "manifest.json")
    done: list[object] = []
    t = threading.Thread(target=lambda: done.append(load_run(run)), daemon=True)
    t.start()
    t.join(10)  # it used to read /dev/zero until the OOM killer came, or block on the FIFO forever
    assert done, "load_run hung on a FIFO or an endless file"
    data = done[0]
    assert data.manifests == {0: {}, 1: {}}  # type: ignore[attr-defined]
    assert data.samples.num_rows == 6  # type: ignore[attr-defined]


def test_bounded_reads_refuse_links_special_files_and_oversized_files(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 2000)
    with pytest.raises(UnsafeFileError, match="2000 bytes, over"):
        read_bounded(big, 1000)
    os.symlink(big, tmp_path / "link.json")
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        read_bounded(tmp_path / "link.json", 10_000)
    with pytest.raises(UnsafeFileError, match="not a regular file"):
        read_bounded(Path("/dev/null"), 10)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UnsafeFileError, match="not a regular file"):
        read_bounded(tmp_path / "fifo", 10)
    problems: list[str] = []
    assert read_json(big, 1000, problems) is None and "big.json" in problems[0]


def test_json_that_is_not_utf8_or_not_json_is_a_problem_not_a_traceback(tmp_path: Path) -> None:
    p = tmp_path / "m.json"
    p.write_bytes(b'{"host": "n\xff1"}')
    problems: list[str] = []
    assert read_json(p, 1000, problems) == {"host": "n\ufffd1"}
    assert "not UTF-8" in problems[0]
    p.write_bytes(b"[" * 100_000)  # nesting deeper than the parser's recursion
    problems.clear()
    assert read_json(p, 1_000_000, problems) is None and "not valid JSON" in problems[0]


def test_jsonl_skips_bad_lines_and_names_a_truncated_last_one(tmp_path: Path) -> None:
    p = tmp_path / "steps.jsonl"
    p.write_bytes(b'{"step": 0}\n\n{"step": 1, \n\xff\xfe\n{"step": 2}\n{"step": 3, "lo')
    problems: list[str] = []
    assert list(iter_jsonl(p, 10_000, problems)) == [{"step": 0}, {"step": 2}]
    assert problems == [
        f"{p}:3: not valid JSON (JSONDecodeError); skipped",
        f"{p}:4: bytes that are not UTF-8 (at byte 0); skipped",
        f"{p}:6: truncated last line; skipped",
    ]


def test_a_path_that_is_not_a_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="does not exist"):
        scan_run(tmp_path / "nope")
    (tmp_path / "f").write_text(json.dumps({}))
    with pytest.raises(StoreError, match="is not a directory"):
        scan_run(tmp_path / "f")
    assert scan_run(tmp_path).ranks == {}


def test_a_segment_that_claims_to_unpack_to_gigabytes_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from charllm_nemo.telemetry import layout

    run = _write_run(tmp_path, (0,), rows=200)
    seg = scan_run(run).ranks[0].samples[0]
    assert layout.read_parquet(seg).num_rows == 200
    monkeypatch.setattr(layout, "MAX_SEGMENT_UNPACKED", 1000)  # stands in for a 2.4 GB claim
    with pytest.raises(UnsafeFileError, match=r"unpack to \d+ bytes, over the"):
        layout.read_parquet(seg)
    with pytest.warns(CorruptSegmentWarning, match="samples segment skipped"):
        data = load_run(run)
    assert data.samples.num_rows == 0 and "unpack to" in data.problems[0]


def test_a_rank_folder_whose_manifest_names_another_rank_is_reported(tmp_path: Path) -> None:
    import shutil

    run = _write_run(tmp_path, (0,))
    shutil.copytree(run / "rank=0", run / "rank=1")  # a copy: rank 0's data under rank 1
    data = load_run(run)
    assert data.ranks == [0, 1]
    assert data.problems == [
        f"{run / 'rank=1' / 'manifest.json'}: field 'rank' says 0, but the folder is rank=1; read as rank 1"
    ]


def test_a_segment_that_claims_too_many_rows_is_refused_before_decoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from charllm_nemo.telemetry import layout

    run = _write_run(tmp_path, (0,), rows=200)
    seg = scan_run(run).ranks[0].samples[0]
    monkeypatch.setattr(layout, "MAX_SEGMENT_ROWS", 199)
    with pytest.raises(UnsafeFileError, match=r"claims 200 rows, over the 199"):
        layout.read_parquet(seg)


def test_segments_are_conformed_to_the_schema_column_by_column(tmp_path: Path) -> None:
    """A column of the wrong type, bytes that are not UTF-8, NaN / inf / huge values: read as
    null with a line naming the file and the column; the rest of the segment is kept."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from charllm_nemo.telemetry.reader import read_segments
    from charllm_nemo.telemetry.sampler import SAMPLES_SCHEMA
    from charllm_nemo.telemetry.store import WINDOWS_SCHEMA

    run = _write_run(tmp_path, (0,), rows=4)
    files = scan_run(run).ranks[0]
    seg = files.samples[0]
    t = pq.read_table(seg)
    t = t.set_column(t.column_names.index("temp_gpu_c"), "temp_gpu_c", pa.array(["hot"] * 4))
    power = pa.array([np.nan, np.inf, 1e300, 250.0])
    wall = pa.array([1_796_465_446_287_865_441] * 4, pa.int64())  # a real wall clock: beyond 2^53
    t = t.set_column(t.column_names.index("t_wall_ns"), "t_wall_ns", wall)
    t = t.set_column(t.column_names.index("power_instant_w"), "power_instant_w", power)
    pq.write_table(t, seg)
    problems: list[str] = []
    got = read_segments(files.samples, "samples", SAMPLES_SCHEMA, problems)
    assert got is not None and got.num_rows == 4
    assert got.column("temp_gpu_c").null_count == 4
    assert got.column("power_instant_w").to_pylist() == [None, None, None, 250.0]
    assert got.column("t_wall_ns").to_pylist() == wall.to_pylist()
    assert any("'temp_gpu_c'" in p and str(seg) in p for p in problems), problems
    assert any("'power_instant_w': 3 value(s)" in p for p in problems), problems
    w = pa.table({"kind": pa.array([b"\xff"], pa.binary()), "window_id": pa.array(["x"])})
    wseg = seg.with_name("windows-000000.parquet")
    pq.write_table(w, wseg)
    problems = []
    got = read_segments((wseg,), "windows", WINDOWS_SCHEMA, problems)
    assert got is not None and got.column("kind").null_count == 1 and got.column("window_id").null_count == 1
    assert len([p for p in problems if "read as null" in p]) == 2, problems


def test_a_rank_with_thousands_of_device_ids_keeps_the_lowest(tmp_path: Path) -> None:
    import pyarrow as pa

    from charllm_nemo.telemetry.reader import MAX_DEVICES_PER_RANK, bound_devices

    n = 3 * MAX_DEVICES_PER_RANK
    t = pa.table({"device_index": pa.array(list(range(n))[::-1], pa.int16())})
    problems: list[str] = []
    got = bound_devices(t, tmp_path, problems)
    assert sorted(got.column("device_index").to_pylist()) == list(range(MAX_DEVICES_PER_RANK))
    assert f"{n} distinct device ids" in problems[0]


def test_arrow_reads_a_segment_through_a_file_of_its_own_never_a_python_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a Python file object, Arrow's I/O and CPU pool threads hold buffers owned by Python;
    # one released on such a thread after the interpreter began to exit aborted the process
    # (SIGABRT, "terminate called without an active exception"; seen in CI after a complete run).
    import pyarrow as pa
    import pyarrow.parquet as pq

    from charllm_nemo.telemetry import layout

    sources: list[object] = []
    real = pq.ParquetFile

    def spy(source: object, *args: object, **kwargs: object) -> pq.ParquetFile:
        sources.append(source)
        return real(source, *args, **kwargs)

    monkeypatch.setattr(pq, "ParquetFile", spy)
    run = _write_run(tmp_path, (0,), rows=200)
    seg = scan_run(run).ranks[0].samples[0]
    assert layout.read_parquet(seg, columns=["t_mono_ns"]).num_rows == 200
    with layout.open_parquet(seg, layout.SIZE_CAPS["segment"]) as pf:
        assert sum(b.num_rows for b in pf.iter_batches(batch_size=64)) == 200
    assert len(sources) == 2
    for source in sources:
        assert isinstance(source, pa.NativeFile) and not isinstance(source, pa.PythonFile), source
    # The file Arrow read is the one checked: a link in the segment's place is still refused.
    seg.unlink()
    seg.symlink_to(tmp_path / "elsewhere.parquet")
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        layout.read_parquet(seg)
