"""What compaction costs and what it buys (telemetry/compact.py), side by side in one run.

One rank's store as the writer leaves it without compaction: one samples segment per 0.5 s flush
(``--hz`` rows each, default 100 Hz -> 50 rows) for ``--minutes`` minutes, one device. Measured:

a. live compaction: the store's writer merging 120 closed segments (one minute) into one file,
   in the process that writes the store (ms a minute of data);
b. compaction at close: the whole folder (``--minutes`` of segments, or of live-compacted
   one-minute files) into one file (s);
c. reading it back, before and after: the package's reader (``load_rank``) and DuckDB
   (``read_parquet`` over the folder, an average per device), median of ``--repeats``, and the
   ratio uncompacted / compacted.

Usage: .venv/bin/python bench/bench_compact.py [--minutes 60] [--hz 100] [--repeats 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from charllm_nemo.devices.contract import METRICS
from charllm_nemo.telemetry.compact import LIVE_EVERY, compact_files, compact_rank
from charllm_nemo.telemetry.reader import load_rank
from charllm_nemo.telemetry.sampler import rows_to_table
from charllm_nemo.telemetry.store import RankStore


def write_segments(run: Path, minutes: float, hz: float, live: bool) -> Path:
    """The rank folder the writer leaves: a segment every 0.5 s (live: compacted every minute)."""
    st = RankStore(run, 0, {"rank": 0, "backend": "bench"})
    st.segments.compact_every = LIVE_EVERY if live else None
    rows_per = max(1, int(hz / 2))
    reading = tuple(300.0 if m.kind == "float" else 1 for m in METRICS)
    t = 0
    for _ in range(int(minutes * 120)):
        rows = [(t + i * int(1e9 / hz), t + i * int(1e9 / hz), 1000, 0, reading) for i in range(rows_per)]
        st.write_segment("samples", rows_to_table(rows, "bench"))
        t += rows_per * int(1e9 / hz)
    st.close("complete")
    return st.dir


def read_times(run: Path, folder: Path, repeats: int) -> tuple[float, float]:
    import duckdb

    loads, ducks = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = load_rank(run, 0).samples.num_rows
        loads.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        files = f"read_parquet('{folder}/samples-*.parquet')"
        duckdb.sql(f"SELECT device_index, avg(power_instant_w) FROM {files} GROUP BY 1").fetchall()
        ducks.append(time.perf_counter() - t0)
    assert n > 0
    return statistics.median(loads), statistics.median(ducks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--hz", type=float, default=100.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-compact-"))
    try:
        # a. one minute of segments, compacted as the live writer does
        folder = write_segments(base / "minute", 1.0, args.hz, live=False)
        paths = sorted(folder.glob("samples-*.parquet"))
        t0 = time.perf_counter()
        compact_files(folder, "samples", paths)
        live_ms = (time.perf_counter() - t0) * 1e3
        print(f"a. live: {len(paths)} segments (one minute) -> 1 file in {live_ms:.1f} ms "
              f"({live_ms / 600:.3f} % of the minute)")  # fmt: skip

        # c (before) and b: a whole run's segments, read, compacted, read again
        run = base / "run"
        folder = write_segments(run, args.minutes, args.hz, live=False)
        files = len(list(folder.glob("samples-*.parquet")))
        load_before, duck_before = read_times(run, folder, args.repeats)
        t0 = time.perf_counter()
        compact_rank(folder)
        close_s = time.perf_counter() - t0
        after = len(list(folder.glob("samples-*.parquet")))
        load_after, duck_after = read_times(run, folder, args.repeats)
        rows = load_rank(run, 0).samples.num_rows
        print(f"b. close: {files} segments ({rows:,} rows, {args.minutes:g} min at {args.hz:g} Hz) "
              f"-> {after} file(s) in {close_s:.2f} s")  # fmt: skip
        print(f"c. read, median of {args.repeats}: load_rank {load_before:.3f} s -> {load_after:.3f} s "
              f"(x{load_before / load_after:.1f}); DuckDB {duck_before:.3f} s -> {duck_after:.3f} s "
              f"(x{duck_before / duck_after:.1f})")  # fmt: skip

        # b, live: the same run with live compaction (one file a minute), compacted at close
        run2 = base / "live"
        folder2 = write_segments(run2, args.minutes, args.hz, live=True)
        live_files = len(list(folder2.glob("samples-*.parquet")))
        t0 = time.perf_counter()
        compact_rank(folder2)
        close_live_s = time.perf_counter() - t0
        print(f"b. close after live compaction: {live_files} file(s) -> "
              f"{len(list(folder2.glob('samples-*.parquet')))} in {close_live_s:.2f} s")  # fmt: skip
        print(f"load average: {' '.join(f'{x:.2f}' for x in np.round(__import__('os').getloadavg(), 2))}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
