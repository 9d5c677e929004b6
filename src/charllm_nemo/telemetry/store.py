"""The per-rank store: a manifest and rolling Parquet segments, written atomically.

Layout of a run directory (schema in docs/store.md)::

    RUN/
      rank=0/
        manifest.json            # who, what, when; rewritten atomically on close
        samples-000000.parquet   # one segment per flush (default every 0.5 s)
        windows-000000.parquet
      rank=1/ ...

Every file is written to a dot-prefixed temporary name in the same folder and renamed into
place (``os.replace``), so a reader never sees half a segment and a ``kill -9`` loses only
what had not been flushed yet (at most one flush interval, plus the write in flight). The
``rank=N`` folder names are Hive partitions: DuckDB, Spark or pyarrow.dataset read a whole run,
or a whole sweep, with the rank as a column.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from charllm_nemo.errors import DiskFull, StoreError
from charllm_nemo.telemetry.clock import clock_at_end
from charllm_nemo.telemetry.compact import LIVE_EVERY, LIVE_MAX, LIVE_PERIOD_S, compact_files, compact_rank
from charllm_nemo.telemetry.schema import WINDOW_LABELS
from charllm_nemo.telemetry.windows import (
    NULL,
    RECORD_FIELDS,
    RECORD_LEN,
    RECORD_WINDOW,
    STRING_FIELDS,
    WINDOW_COLUMNS,
    Record,
)
from charllm_nemo.telemetry.write import anchor, make_dir, write_bytes, write_with

log = logging.getLogger("charllm_nemo.store")

STORE_FORMAT_VERSION = 1

DISK_FULL = "disk_full"
"""The manifest ``status`` of a run whose store hit a full disk (ENOSPC / EDQUOT): what was
written before stays readable; see docs/store.md."""


RESERVE_NAME = ".manifest.json.reserve"
RESERVE_BYTES = 64 * 1024
"""Space a rank's folder holds back (a preallocated hidden file) so that the final manifest can
still be written on a full disk: removed just before that write, or at close."""


def _windows_schema() -> pa.Schema:
    types: dict[str, pa.DataType] = {
        "window_id": pa.int64(),
        "parent_id": pa.int64(),
        "kind": pa.string(),
        "name": pa.string(),
        "step": pa.int64(),
        "microbatch": pa.int64(),
        "t_begin_mono_ns": pa.int64(),
        "t_end_mono_ns": pa.int64(),
        "t_begin_wall_ns": pa.int64(),
        "timing": pa.string(),
    }
    types.update(dict.fromkeys(WINDOW_LABELS, pa.int32()))
    return pa.schema([pa.field(c, types[c]) for c in WINDOW_COLUMNS])


WINDOWS_SCHEMA: pa.Schema = _windows_schema()


def records_to_table(records: np.ndarray[Any, Any] | Sequence[Record], names: Sequence[str]) -> pa.Table:
    """Window records (``WindowRecorder`` records, or an int64 array of them, one per row) ->
    an Arrow table with WINDOWS_SCHEMA. Vectorised: no Python work per window (and no
    pyarrow.compute, whose first import costs ~0.2 s)."""
    arr = np.asarray(records, dtype=np.int64).reshape(-1, RECORD_LEN)
    arr = arr[arr[:, 0] == RECORD_WINDOW]
    if arr.shape[0] == 0:
        return WINDOWS_SCHEMA.empty_table()
    text = np.asarray(list(names), dtype=object)
    cols: list[pa.Array] = []
    for j, field in enumerate(RECORD_FIELDS[1:], start=1):
        col = arr[:, j]
        typ = WINDOWS_SCHEMA.field(field).type
        if field in STRING_FIELDS:
            cols.append(pa.array(text[col], typ))
        else:
            null = col == NULL
            values = col.astype(np.int32) if typ == pa.int32() else col
            cols.append(pa.array(values, typ, mask=null if null.any() else None))
    return pa.Table.from_arrays(cols, schema=WINDOWS_SCHEMA)


def windows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Window rows keyed by WINDOW_COLUMNS (``WindowRecorder.drain``) -> Arrow table with WINDOWS_SCHEMA."""
    if not rows:
        return WINDOWS_SCHEMA.empty_table()
    cols = [pa.array([r.get(c) for r in rows], WINDOWS_SCHEMA.field(c).type) for c in WINDOW_COLUMNS]
    return pa.Table.from_arrays(cols, schema=WINDOWS_SCHEMA)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, no link followed (:mod:`.write`); a file-system
    limit (ENOSPC / EDQUOT / EFBIG) raises :class:`DiskFull` and leaves no temporary."""
    write_bytes(path, data)


# lz4 and dictionary encoding of string columns only: a 50-row segment (0.5 s at 100 Hz) costs
# 0.73 ms of CPU this way against 1.61 ms with zstd and default dictionaries (measured here), and
# the flusher writes one every 0.5 s per kind. Column statistics stay: engines prune on t_mono_ns.
PARQUET_OPTIONS: dict[str, Any] = {
    "compression": "lz4",
    "use_dictionary": ["source", "kind", "name", "timing"],
}


def atomic_write_table(path: Path, table: pa.Table) -> None:
    """Write ``table`` as Parquet to ``path`` atomically (:func:`_write_atomically`)."""
    write_with(path, lambda f: pq.write_table(table, f, **PARQUET_OPTIONS))


def rank_dir(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / f"rank={rank}"


RANK_FILE_PATTERNS = ("manifest.json", "samples-*.parquet", "windows-*.parquet", "buffered-*.parquet")
"""The files a rank's folder holds (each also as ``.<name>.tmp`` while being written; and,
while a run is open, :data:`RESERVE_NAME`)."""


def rank_files(folder: Path) -> list[Path]:
    """The store's files in one rank's folder (manifest, segments, their temporaries), sorted;
    anything else there is not the store's and is left out."""
    if not folder.is_dir():
        return []
    found = {p for pattern in RANK_FILE_PATTERNS for p in folder.glob(pattern)}
    found |= {p for pattern in RANK_FILE_PATTERNS for p in folder.glob(f".{pattern}.tmp")}
    found |= set(folder.glob(RESERVE_NAME))
    return sorted(found)


def describe_files(paths: list[Path], root: Path) -> str:
    """``rank=0/manifest.json, rank=0/samples-000000.parquet, ... (N files)``: a few names."""
    names = [str(p.relative_to(root)) for p in paths[:3]]
    more = f", ... ({len(paths)} files)" if len(paths) > 3 else ""
    return ", ".join(names) + more


def clear_rank_folder(folder: Path, *, overwrite: bool) -> None:
    """A rank's folder must not mix two runs: segments a new run does not overwrite would be read
    as its own. Holding an earlier run's files, it is emptied of them when ``overwrite``, else
    StoreError says what is there and how to go on."""
    old = rank_files(folder)
    if not old:
        return
    if not overwrite:
        raise StoreError(
            f"{folder} already holds a run ({describe_files(old, folder.parent)}); give a new run "
            "directory (telemetry.out_dir=... / --out DIR), or replace that run "
            "(telemetry.overwrite=true / --overwrite)"
        )
    for path in old:
        path.unlink(missing_ok=True)
    log.warning("replaced an earlier run in %s: removed %d file(s)", folder, len(old))


def warm_up_parquet_writer() -> None:
    """The first Parquet write in a process costs ~150 ms (lazy codec and writer set-up). Pay it
    at start, before the sampler runs, rather than in the first flush, where it would hold the
    GIL against the sampler and the training thread."""
    import io

    pq.write_table(WINDOWS_SCHEMA.empty_table(), io.BytesIO(), **PARQUET_OPTIONS)


class SegmentWriter:
    """Writes numbered ``samples-NNNNNN.parquet`` / ``windows-NNNNNN.parquet`` segments into one
    rank's folder, atomically, and counts them. Thread-safe. ``first_seq`` continues a
    numbering another writer began (the training process after its telemetry process died)."""

    out_dir_option = "telemetry.out_dir / --out"
    """How the user named the run directory, for the disk-full line (an integration's session
    sets its keyword: :func:`out_dir_option`)."""

    def __init__(self, folder: Path, first_seq: dict[str, int] | None = None) -> None:
        self.dir = folder
        self._seq = {"samples": 0, "windows": 0, **(first_seq or {})}
        self.rows_written = {"samples": 0, "windows": 0}
        self.bytes_written = 0
        self.rows_unwritten = {"samples": 0, "windows": 0}
        """Rows not stored because the disk was full (:attr:`disk_full`)."""
        self.disk_full: str | None = None
        """Why this writer stopped writing (the first ENOSPC / EDQUOT), or None."""
        self._lock = threading.Lock()
        self._compacted = dict(self._seq)  # per kind: the first segment number not compacted yet
        self.compact_every: int | None = LIVE_EVERY
        """Compact at least this many closed segments of a kind at a time as the run goes
        (telemetry/compact.py; None: never). Samples and windows only: driver-buffer segments
        are read back by a writer that takes over, and are compacted at close."""
        self.compact_period_s = LIVE_PERIOD_S
        """...and at most once this often (s) per kind, unless :attr:`compact_max` wait: the
        compacted files per hour do not grow with the flush rate (a fast step rate flushes
        windows early)."""
        self.compact_max = LIVE_MAX
        self.clock: Callable[[], float] = time.monotonic
        self._compacted_at: dict[str, float] = {}  # per kind: when it was last compacted
        self._since = self.clock()

    @classmethod
    def continuing(cls, folder: Path, counts: dict[str, Any]) -> SegmentWriter:
        """A writer that goes on where another left off, ``counts`` as :meth:`counts` gives them
        (next numbers, rows and bytes so far), so that its own counts are the folder's totals."""
        writer = cls(folder, dict(counts.get("segments", {})))
        writer.rows_written.update(counts.get("rows", {}))
        writer.bytes_written = int(counts.get("bytes_written", 0))
        writer.rows_unwritten.update(counts.get("rows_unwritten", {}))
        if counts.get("disk_full"):
            writer.disk_full = "an earlier writer found the disk full"
        return writer

    def write_segment(self, kind: str, table: pa.Table) -> Path | None:
        """Write one ``samples`` or ``windows`` segment; empty tables write nothing. On a full
        disk it logs one line, writes nothing from then on (counting the rows in
        :attr:`rows_unwritten`) and returns None: what is on disk stays readable, and a
        flusher retrying every interval would only repeat the failure."""
        if table.num_rows == 0:
            return None
        with self._lock:
            if self.disk_full is not None:
                self.rows_unwritten[kind] += table.num_rows
                return None
            seq = self._seq[kind]
            path = self.dir / f"{kind}-{seq:06d}.parquet"
            try:
                atomic_write_table(path, table)
            except DiskFull as exc:
                self._stop_writing(str(exc))
                self.rows_unwritten[kind] += table.num_rows
                return None
            self._seq[kind] = seq + 1
            self.rows_written[kind] += table.num_rows
            self.bytes_written += path.stat().st_size
            self._compact_closed(kind)
        return path

    def _compact_closed(self, kind: str) -> None:
        """Every :attr:`compact_every` segments of ``kind``, merge them into one file. Measured
        (bench/bench_compact.py): well under a second of the store's process a minute; a failure
        (a full disk) leaves the segments as they are and stops live compaction."""
        every = self.compact_every
        first, nxt = self._compacted.get(kind, 0), self._seq[kind]
        if every is None or kind == "buffered" or nxt - first < every:
            return
        now = self.clock()
        if (
            nxt - first < self.compact_max
            and now - self._compacted_at.get(kind, self._since) < self.compact_period_s
        ):
            return  # segments come faster than one a 0.5 s: one file a period all the same
        paths = [self.dir / f"{kind}-{n:06d}.parquet" for n in range(first, nxt)]
        try:
            compact_files(self.dir, kind, [p for p in paths if p.exists()])
        except Exception as exc:  # never a reason to lose a segment or stop storing
            self.compact_every = None
            log.warning(
                "telemetry: live compaction stopped (%s: %s); segments are kept as written",
                type(exc).__name__,
                exc,
            )
            return
        self._compacted[kind] = nxt
        self._compacted_at[kind] = now

    def _stop_writing(self, why: str) -> None:
        self.disk_full = why
        log.error(
            "telemetry: the disk is full (%s); telemetry stops writing this rank's samples and "
            "windows. What was written stays readable; the manifest will say status %r. Free space "
            "or choose another %s",
            why,
            DISK_FULL,
            self.out_dir_option,
        )

    def counts(self) -> dict[str, Any]:
        """What the manifest records at close: next segment numbers, rows and bytes written,
        and (only after a full disk) the rows not written."""
        out: dict[str, Any] = {
            "segments": dict(self._seq),
            "rows": dict(self.rows_written),
            "bytes_written": self.bytes_written,
        }
        if self.disk_full is not None:
            out["rows_unwritten"] = dict(self.rows_unwritten)
            out["disk_full"] = True
        return out


def out_dir_option(config: Mapping[str, Any] | None) -> str:
    """How the user named the run directory, from the run's config as the manifest holds it:
    an integration's keyword (``PowerThermalCallback(out_dir=...)``; its config's
    ``integration.owner``), else ``charllm train``'s and the CLI's."""
    integration = (config or {}).get("integration")
    owner = integration.get("owner") if isinstance(integration, Mapping) else None
    return f"{owner}(out_dir=...)" if isinstance(owner, str) and owner else SegmentWriter.out_dir_option


def check_writable(folder: Path) -> None:
    """Create ``folder`` and check a file can be written there, or raise StoreError."""
    try:
        make_dir(folder)
        probe = folder / ".write-probe"
        write_bytes(probe, b"")
        probe.unlink()
    except OSError as exc:
        raise StoreError(
            f"telemetry output directory {folder} is not writable ({exc.strerror or exc}); "
            "choose another with --out / telemetry.out_dir, or fix its permissions"
        ) from exc


def reserve_space(folder: Path) -> None:
    """Hold :data:`RESERVE_BYTES` back in ``folder`` (:data:`RESERVE_NAME`), allocated, not just
    sized: a full disk then still has room for the final manifest. Best effort: where the disk is
    already full, nothing is held. Written through the write layer: a link planted at that name is
    replaced, never written through."""
    try:  # zeros written take the blocks (fallocate would too), as train.disk_full's reserve does
        write_bytes(folder / RESERVE_NAME, bytes(RESERVE_BYTES))
    except (OSError, StoreError):  # DiskFull included: the temporary is gone, nothing held
        return


def finish_manifest(manifest: dict[str, Any], status: str, counts: dict[str, Any]) -> None:
    """The fields a manifest gets at close (in place): status, end time, segment counts, and the
    clock mapping's end (telemetry/clock.py)."""
    manifest["status"] = status
    clock = manifest.get("clock")
    if isinstance(clock, dict) and isinstance(clock.get("wall_minus_monotonic_ns_start"), int):
        manifest["clock"] = clock_at_end(clock)
    manifest["ended_wall_ns"] = time.time_ns()
    manifest.update(counts)


class RankStore:
    """One rank's folder ``RUN/rank=<rank>/``: its manifest and (``writes_segments``) its segments.

    Creating it checks the directory is writable, refuses a folder holding an earlier run's files
    (``overwrite``: removes them instead; :func:`clear_rank_folder`) and writes the manifest with
    ``status="running"``; :meth:`close` rewrites it with the final status and counts. A session
    whose telemetry process writes the segments passes ``writes_segments=False`` and hands that
    process's counts to :meth:`close`.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        rank: int,
        manifest: dict[str, Any],
        *,
        writes_segments: bool = True,
        overwrite: bool = False,
    ) -> None:
        anchor(run_dir)  # every folder below the run is entered without following a link
        self.dir = rank_dir(run_dir, rank)
        self.compact_at_close = False
        """Compact the folder's segments into a few files once the final manifest is written
        (telemetry/compact.py; the session turns it on); a full disk skips it."""
        check_writable(self.dir)
        clear_rank_folder(self.dir, overwrite=overwrite)
        self.manifest: dict[str, Any] = {
            "store_format": STORE_FORMAT_VERSION,
            "status": "running",
            **manifest,
        }
        self.segments = SegmentWriter(self.dir)
        self.manifest_disk_full: str | None = None
        """Why a manifest write found the disk full (the last manifest on disk is older), or None."""
        reserve_space(self.dir)
        self.write_manifest()
        if writes_segments:
            warm_up_parquet_writer()

    @property
    def disk_full(self) -> bool:
        """Whether this store's segments or its manifest hit a full disk."""
        return self.segments.disk_full is not None or self.manifest_disk_full is not None

    def write_manifest(self) -> None:
        """Write the manifest atomically. On a full disk: free the reserve and try once more; if
        that fails too, log one line and keep the manifest on disk as it was (never raises
        :class:`DiskFull`)."""
        data = json.dumps(self.manifest, indent=2, sort_keys=True, default=str).encode()
        path = self.dir / "manifest.json"
        try:
            atomic_write_bytes(path, data)
            return
        except DiskFull as exc:
            self.manifest_disk_full = str(exc)
        (self.dir / RESERVE_NAME).unlink(missing_ok=True)
        try:
            atomic_write_bytes(path, data)
        except DiskFull as exc:
            log.error("telemetry: %s; the manifest on disk is the one written before", exc)

    def write_segment(self, kind: str, table: pa.Table) -> Path | None:
        """Write one ``samples`` or ``windows`` segment; empty tables write nothing."""
        return self.segments.write_segment(kind, table)

    def close(
        self, status: str, extra: dict[str, Any] | None = None, counts: dict[str, Any] | None = None
    ) -> None:
        """Final manifest: ``extra`` fields, the status, and the segment counts (``counts``: those
        of whoever wrote the segments; default this store's own)."""
        self.manifest.update(extra or {})
        finish_manifest(self.manifest, status, counts if counts is not None else self.segments.counts())
        (self.dir / RESERVE_NAME).unlink(missing_ok=True)  # the run is closed: room for others
        self.write_manifest()
        if status != DISK_FULL and self.compact_at_close:  # compaction needs room for a copy
            try:
                compact_rank(self.dir)
            except Exception as exc:  # the segments stay readable as they are
                log.warning(
                    "telemetry: compaction at close failed (%s: %s); segments kept", type(exc).__name__, exc
                )


class Flusher:
    """A daemon thread that calls ``flush()`` every ``interval_s`` until stopped.

    The flush itself (Arrow conversion, Parquet encode, rename) runs here, off the training
    thread and off the sampler thread. Errors are logged, never raised.
    """

    def __init__(self, flush: Callable[[], None], interval_s: float) -> None:
        if not 0.01 <= interval_s <= 1.0:
            raise StoreError(
                f"flush interval {interval_s} s must be within [0.01, 1.0] s (at least every second)"
            )
        self._flush = flush
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="charllm-flusher", daemon=True)
        self.flushes = 0
        self.errors = 0
        self.flush_ns_max = 0

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush_once()

    def flush_once(self) -> None:
        t0 = time.monotonic_ns()
        try:
            self._flush()
            self.flushes += 1
        except Exception:
            self.errors += 1
            log.exception("telemetry flush failed; will retry at the next interval")
        self.flush_ns_max = max(self.flush_ns_max, time.monotonic_ns() - t0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
