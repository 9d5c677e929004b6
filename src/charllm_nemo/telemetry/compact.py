"""Compaction: a rank's many small segments become a few large Parquet files, crash-safely.

The store writes one segment per kind every flush (0.5 s): ~7,200 files per rank-hour, which
columnar engines read 14-18x slower than one file per rank (DESIGN.md, measured here). A
compacted file holds consecutive segments ``first..last`` of one kind and is named for them,
``samples-<first>-<last>.parquet`` (the numbers as the segments write them). Samples are sorted
by time (``t_mono_ns``, then device), in row groups of :data:`ROW_GROUP_ROWS` with column
statistics, so engines prune row groups by time.

Crash safety, with no step that can lose a row:

1. the compacted file is written to a dot-prefixed temporary (readers ignore those), flushed to
   disk (``fsync``) and renamed into place;
2. only then are the segments it covers removed.

A kill before the rename leaves the segments (and a temporary that readers skip); a kill after
it leaves the compacted file beside some of the segments it covers: readers take the compacted
file and ignore every segment (or smaller compacted file) inside its range
(:func:`charllm_nemo.telemetry.layout.scan_run` lists them as ``superseded``), and the next
compaction removes them. Either way every row is read exactly once.

Three callers: the store's writer compacts closed segments as a run goes (at least
:data:`LIVE_EVERY` segments of a kind at a time, at most once a :data:`LIVE_PERIOD_S` unless
:data:`LIVE_MAX` wait; in the process that writes the store, never the training thread), the
store compacts the whole rank folder when it closes, and ``charllm compact RUN`` does it on
demand (a run copied from an older version, or one killed before its close).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from charllm_nemo.errors import StoreError
from charllm_nemo.telemetry import layout
from charllm_nemo.telemetry.filecheck import printable
from charllm_nemo.telemetry.layout import SIZE_CAPS, UnpackBudget, UnsafeFileError, read_parquet, scan_run
from charllm_nemo.telemetry.overlap import read_once
from charllm_nemo.telemetry.write import atomic_file

log = logging.getLogger("charllm_nemo.compact")

KINDS = ("samples", "windows", "buffered")

ROW_GROUP_ROWS = 262_144
"""Rows per row group of a compacted file: ~2-4 MiB of samples columns, large enough for scans,
small enough that a time filter skips most of a file."""

FILE_SHARE = 2
"""A compacted file holds at most 1/this of the rows (``layout.MAX_SEGMENT_ROWS``) and of the
bytes (``layout.MAX_SEGMENT_UNPACKED``, counted as the batch's Arrow size) that every reader
accepts of one file (the footer checks of :func:`~charllm_nemo.telemetry.layout.read_parquet`):
it held up to 8,388,608 rows, twice what a reader accepts, so a compacted day of one rank on 8
devices would have been refused by every reader. 2 M rows is ~40 min of 8 devices at 100 Hz."""

LIVE_EVERY = 120
"""Closed segments of a kind the writer compacts at the fewest while a run goes (one minute at
the 0.5 s flush interval)."""

LIVE_PERIOD_S = 60.0
"""The writer compacts a kind at most once this often while fewer than :data:`LIVE_MAX` of its
segments wait: a rank-hour is at most 60 compacted files per kind however often the store
flushes (a windows flush comes early when more than 4,096 window records wait), not 7,200 (or
more) segments, until the close compacts it into one."""

LIVE_MAX = 4 * LIVE_EVERY
"""Segments of a kind that never wait longer for compaction: the store holds at most this many
uncompacted segments per kind; past 8 flushes a second (480 a minute) a rank-hour holds
``segments an hour / 480`` compacted files per kind instead of 60 (docs/store.md)."""


def compacted_name(kind: str, first: int, last: int) -> str:
    """``samples-000000-000119.parquet``: the segments ``first..last`` of ``kind`` in one file."""
    return f"{kind}-{first:06d}-{last:06d}.parquet"


@dataclass(frozen=True)
class Compaction:
    """What one compaction of one kind did: files read, the (last) file written, rows written
    into compacted files, and the rows the files it rewrote held: more than those written by
    the rows that files with overlapping segment ranges both held (written once)."""

    kind: str
    inputs: int
    output: Path | None
    rows: int
    rows_read: int = 0


def _sorted(kind: str, table: pa.Table) -> pa.Table:
    if kind == "samples" and table.num_rows and "t_mono_ns" in table.column_names:
        keys = [("t_mono_ns", "ascending")]
        if "device_index" in table.column_names:
            keys.append(("device_index", "ascending"))
        return table.sort_by(keys)
    return table  # windows and driver buffers keep the order they were recorded in


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_compacted(folder: Path, kind: str, first: int, last: int, table: pa.Table) -> Path:
    """Write ``table`` as the compacted file for segments ``first..last`` through the hardened
    write layer (telemetry/write.py: a temporary never reached through a link, fsynced, renamed),
    then flush the folder, so the rename is on disk before any segment is removed."""
    path = folder / compacted_name(kind, first, last)
    with atomic_file(path, fsync=True) as f:
        pq.write_table(table, f, compression="zstd", row_group_size=ROW_GROUP_ROWS, write_statistics=True)
    _fsync_dir(folder)
    return path


def _number_range(path: Path) -> tuple[int, int]:
    parts = path.name[: -len(".parquet")].split("-")[1:]
    return int(parts[0]), int(parts[-1])


def compact_files(
    folder: Path, kind: str, paths: list[Path], problems: list[str] | None = None
) -> Compaction:
    """Merge ``paths`` (consecutive files of ``kind`` in ``folder``, as the scan orders them) into
    compacted files of at most half the rows and bytes a reader accepts of a file (:data:`FILE_SHARE`:
    every reader reads what compaction writes), then remove them. A file that cannot
    be read is left where it is (and said in ``problems``): compaction never drops data."""
    problems = problems if problems is not None else []
    if len(paths) < 2:
        return Compaction(kind, len(paths), None, 0)
    batch: list[tuple[Path, pa.Table]] = []
    budget = UnpackBudget()  # what the batch held in memory may decode to (a bomb over many files)
    rows = 0  # rows of the batch being gathered (flush resets it)
    size = 0  # their in-memory bytes
    max_rows = layout.MAX_SEGMENT_ROWS // FILE_SHARE  # read now: what the readers accept now
    max_size = layout.MAX_SEGMENT_UNPACKED // FILE_SHARE
    rewritten = 0  # rows written into compacted files, all batches
    read = 0  # rows the files so rewritten held (overlapping files: some rows twice)
    written: Path | None = None

    def flush() -> None:
        nonlocal batch, rows, size, written, rewritten, read, budget
        if len(batch) >= 2:
            first, last = _number_range(batch[0][0])[0], _number_range(batch[-1][0])[1]
            # files whose ranges overlap hold some rows twice: one copy written (telemetry/overlap.py)
            tables = read_once(batch, kind, problems)
            table = pa.concat_tables(tables, promote_options="permissive")
            written = write_compacted(folder, kind, first, last, _sorted(kind, table))
            for p, _ in batch:
                if p != written:
                    p.unlink(missing_ok=True)
            _fsync_dir(folder)
            rewritten += table.num_rows
            read += rows
        batch, rows, size, budget = [], 0, 0, UnpackBudget(budget.total)

    for p in paths:
        try:
            try:
                t = read_parquet(p, cap=SIZE_CAPS["segment"], budget=budget)
            except UnsafeFileError:
                if not batch:
                    raise  # over the budget alone: never read
                flush()  # the batch so far is written; the file may fit a fresh batch
                t = read_parquet(p, cap=SIZE_CAPS["segment"], budget=budget)
        except Exception as exc:  # pyarrow raises many types for a damaged file; keep it, go on
            problems.append(f"{p}: not compacted, unreadable ({type(exc).__name__}); left as it is")
            flush()
            continue
        if batch and (
            rows + t.num_rows > max_rows
            or size + t.nbytes > max_size
            or (t.schema != batch[0][1].schema and not _castable(t, batch[0][1]))
        ):
            flush()
        batch.append((p, t))
        rows += t.num_rows
        size += t.nbytes
    flush()
    return Compaction(kind, len(paths), written, rewritten, read)


def _castable(a: pa.Table, b: pa.Table) -> bool:
    try:
        pa.unify_schemas([a.schema, b.schema], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return False
    return True


def compact_rank(
    folder: Path, kinds: tuple[str, ...] = KINDS, problems: list[str] | None = None
) -> list[Compaction]:
    """Compact every kind of one rank's folder into as few files as :data:`FILE_SHARE`
    allows; first removes the segments an interrupted compaction already covered."""
    problems = problems if problems is not None else []
    files = scan_run(folder.parent)
    rank_files = next((rf for rf in files.ranks.values() if rf.folder == folder), None)
    if rank_files is None:
        return []
    for ig in files.ignored:
        if ig.kind == "superseded" and ig.path.parent == folder:
            ig.path.unlink(missing_ok=True)  # its rows are in the compacted file that covers it
    out = []
    for kind in kinds:
        paths = list(getattr(rank_files, kind))
        out.append(compact_files(folder, kind, paths, problems))
    return out


def compact_run(
    run_dir: str | os.PathLike[str], problems: list[str] | None = None
) -> dict[int, list[Compaction]]:
    """:func:`compact_rank` for every rank folder of ``run_dir`` (the readers' scan decides which:
    no links followed)."""
    files = scan_run(run_dir)
    return {r: compact_rank(rf.folder, problems=problems) for r, rf in sorted(files.ranks.items())}


def cmd_compact(run_dir: str) -> int:
    """``charllm compact RUN``: every rank folder compacted; prints files before and after, exit 2
    when RUN is not a run directory."""

    def count(path: Path) -> int:
        return sum(
            len(rf.samples) + len(rf.windows) + len(rf.buffered) for rf in scan_run(path).ranks.values()
        )

    try:
        before = count(Path(run_dir))
        problems: list[str] = []
        done = compact_run(run_dir, problems)
        after = count(Path(run_dir))
    except StoreError as exc:
        print(f"charllm compact: {printable(exc, limit=400)}", file=sys.stderr)
        return 2
    rows = sum(c.rows for cs in done.values() for c in cs)
    read = sum(c.rows_read for cs in done.values() for c in cs)
    twice = (
        f" ({read - rows:,} held twice by files with overlapping segment ranges, written once)"
        if read != rows
        else ""
    )
    merged = any(c.output is not None for cs in done.values() for c in cs)
    print(
        f"{len(done)} rank(s): {before} segment file(s) -> {after}; {read:,} rows read, "
        f"{rows:,} rows written{twice}"
        + ("" if merged else " (nothing to merge: no two files of a kind could be joined)")
    )
    for line in problems:
        print(f"  problem: {printable(line)}")
    return 0
