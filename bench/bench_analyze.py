"""Time ``charllm analyze`` on a large store, uncompacted and compacted: 32 ranks x 1 hour x
100 Hz (11.52 M samples), median of 3 analyses of each layout in one run (issue #35, item 2).

The store is written with pyarrow in the store's real format (charllm_nemo.analysis.store_writer):
per rank 360,000 samples (power, energy counter, temperatures, clocks, throttle mask, PCIe
counters, power limit) and 3,599 one-second steps of 4 microbatches each (18,000 windows, one
windows file per rank in both layouts). Uncompacted: one samples segment per ``--segment-s``
(default 0.5 s, the writer's flush: 7,200 files per rank-hour); then ``charllm compact``'s
``compact_run`` (timed) makes the compacted layout of the same data. Each ``charllm analyze
--no-figures`` runs in a child process; printed per layout: each analysis's wall and CPU time
(user + sys of the child and its workers), the median, the peak RSS and the load average (a
shared machine's wall time says more about its neighbours than about the analysis), then the
ratios.

Growth (issue #45): with ``--scales 1 2 4`` (the default) the compacted store is written again with
2x and 4x the samples per rank (the same ranks, a longer run) and analysed once each; printed:
each size's wall and CPU time and the ratio per doubling of the rows (linear growth: <= 2.3).
``--scales 1`` skips it. The Spark engine's growth is bench/bench_spark.py's (a few minutes of
two ranks: Spark on local[2] over a 32-rank hour would take hours on this machine).

Usage: .venv/bin/python bench/bench_analyze.py [--ranks 32] [--seconds 3600] [--hz 100]
       [--segment-s 0.5] [--repeats 3] [--dir DIR] [--layouts compacted] [--scales 1 2 4]
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from charllm_nemo.analysis.store_writer import write_rank, write_summary
from charllm_nemo.telemetry.compact import compact_run


def make_rank(run: Path, rank: int, seconds: float, hz: float, segment_s: float, ranks: int) -> int:
    rng = np.random.default_rng(rank)
    n = int(seconds * hz)
    t = (10**12 + np.arange(n) * (1e9 / hz) + rng.integers(0, 200_000, n)).astype(np.int64)
    phase = (np.arange(n) / hz) % 1.0
    power = 300 + 380 * (phase < 0.8) + rng.normal(0, 15, n)
    power = np.minimum(power, 700.0)
    dt = np.diff(t, prepend=t[0]) / 1e9
    energy = (10**9 + np.cumsum(power * dt * 1e3)).astype(np.int64)
    energy = energy[(np.arange(n) // 5) * 5]  # the counter moves every 50 ms
    temp = 45 + 20 * (1 - np.exp(-np.arange(n) / (hz * 600))) + rank * 0.2 + rng.normal(0, 0.3, n)
    clock = np.where(power >= 699, 1500.0, 1980.0)
    samples = {
        "t_mono_ns": t,
        "t_wall_ns": t + 1_700_000_000 * 10**9,
        "read_ns": np.full(n, 20_000, np.int64),
        "power_instant_w": power,
        "power_avg_w": power,
        "energy_mj": energy,
        "temp_gpu_c": temp,
        "temp_hbm_c": temp - 3,
        "clock_sm_mhz": clock,
        "throttle_reasons": np.where(power >= 699, 0x4, 0).astype(np.int64),
        "pcie_tx_bytes": np.cumsum(rng.integers(0, 10**6, n)).astype(np.int64),
        "pcie_rx_bytes": np.cumsum(rng.integers(0, 10**6, n)).astype(np.int64),
        "power_limit_w": np.full(n, 700.0),
    }
    steps = int(seconds) - 1
    b = t[0] + (np.arange(steps) * 1e9).astype(np.int64) + 5_000_000
    e = b + 900_000_000
    mb_b = (b[:, None] + np.arange(4)[None, :] * 200_000_000).ravel()
    mb_e = mb_b + 180_000_000
    k = steps
    windows = {
        "window_id": np.arange(k * 5, dtype=np.int64),
        "parent_id": np.concatenate((np.full(k, -1), np.repeat(np.arange(k), 4))).astype(np.int64),
        "kind": ["step"] * k + ["microbatch"] * (4 * k),
        "name": ["step"] * k + ["microbatch"] * (4 * k),
        "step": np.concatenate((np.arange(k), np.repeat(np.arange(k), 4))).astype(np.int64),
        "microbatch": np.concatenate((np.full(k, -1), np.tile(np.arange(4), k))).astype(np.int64),
        "t_begin_mono_ns": np.concatenate((b, mb_b)),
        "t_end_mono_ns": np.concatenate((e, mb_e)),
        "pp_stage": np.zeros(5 * k, np.int64),
    }
    write_rank(
        run, rank, samples, windows, {"world_size": ranks, "host": f"node{rank // 8}"}, int(segment_s * hz)
    )
    return n


def analyze_once(run: Path, out: Path, extra: tuple[str, ...] = ()) -> tuple[float, float, int, str]:
    """``charllm analyze --no-figures`` of ``run`` in a child process (``extra``: more
    arguments, e.g. ``--engine spark``): (wall s, CPU s of the child and the processes it reaped,
    the largest RSS among them in bytes, its first output line), from the child's own rusage
    (``os.wait4``)."""
    cmd = [sys.executable, "-m", "charllm_nemo.cli", "analyze", str(run), "--no-figures", "--out", str(out)]
    cmd += list(extra)
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        text = log.read()
    if proc.returncode:
        raise SystemExit(f"charllm analyze failed ({proc.returncode}):\n{text}")
    first = text.strip().splitlines()[0] if text.strip() else ""
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, first


FLOOR = """
SELECT filename, count(*) AS n, avg(power_instant_w) AS power_avg_w, max(power_instant_w) AS power_peak_w,
       max(temp_gpu_c) AS temp_gpu_peak_c, max(energy_mj) - min(energy_mj) AS energy_mj,
       sum(CASE WHEN throttle_reasons & 4 <> 0 THEN 1 ELSE 0 END) AS throttled
FROM read_parquet({files}, filename = true) GROUP BY filename
"""
"""DuckDB's floor: a per-rank reduction (plain means, not time-weighted) over the same files."""


def duckdb_floor(run: Path) -> tuple[float, float]:
    """The :data:`FLOOR` query in a child process: (wall s, CPU s)."""
    files = sorted(str(p) for p in run.rglob("samples*.parquet"))
    code = f"import duckdb; duckdb.connect().sql({FLOOR.format(files=files)!r}).fetchall()"
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code])
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit("the DuckDB floor query failed")
    return time.perf_counter() - t0, usage.ru_utime + usage.ru_stime


def files_in(run: Path) -> int:
    return sum(1 for _ in run.rglob("*.parquet"))


def growth(args: argparse.Namespace, root: Path, base: tuple[float, float, int]) -> None:
    """Analyse compacted stores of ``args.scales`` x the rows (1: the median just measured) and
    print the ratio per doubling."""
    sizes = [(1, base[0], base[1])] if 1 in args.scales else []
    for scale in sorted(s for s in args.scales if s != 1):
        run = root / f"x{scale}" / "run"
        seconds = args.seconds * scale
        total = sum(make_rank(run, r, seconds, args.hz, seconds, args.ranks) for r in range(args.ranks))
        write_summary(run, {"status": "complete", "model": "bench", "world_size": args.ranks})
        wall, cpu, rss, _ = analyze_once(run, root / f"out-x{scale}")
        shutil.rmtree(run.parent, ignore_errors=True)
        sizes.append((scale, wall, cpu))
        print(f"x{scale}: {args.ranks} ranks x {seconds:g} s = {total:,} samples, compacted: "
              f"wall {wall:.2f} s, CPU {cpu:.2f} s, RSS {rss / 2**20:.0f} MiB, "
              f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    steps = [
        f"x{a[0]}->x{b[0]}: CPU x{(b[2] / a[2]) ** (1 / math.log2(b[0] / a[0])):.2f}, "
        f"wall x{(b[1] / a[1]) ** (1 / math.log2(b[0] / a[0])):.2f}"
        for a, b in itertools.pairwise(sizes)
    ]
    if steps:
        print(f"growth per doubling of the rows (linear: <= 2.3): {'; '.join(steps)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=3600.0)
    ap.add_argument("--hz", type=float, default=100.0)
    ap.add_argument(
        "--segment-s",
        type=float,
        default=0.5,
        help="seconds of samples per segment in the uncompacted store (the writer's flush: 0.5)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="analyses of each layout (the median is printed)")
    ap.add_argument("--dir", help="where to write the store (default: a temporary folder, removed after)")
    ap.add_argument(
        "--layouts",
        nargs="+",
        default=["uncompacted", "compacted"],
        choices=["uncompacted", "compacted"],
        help="compacted alone writes one segment per rank (no 7,200 files per rank-hour to write)",
    )
    ap.add_argument(
        "--scales",
        type=int,
        nargs="+",
        default=[1, 2, 4],
        help="also analyse compacted stores of these multiples of --seconds, once each (1 alone: none)",
    )
    args = ap.parse_args()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-analyze-"))
    run = root / "run"
    try:
        t0 = time.perf_counter()
        segment_s = args.segment_s if "uncompacted" in args.layouts else args.seconds
        total = sum(
            make_rank(run, r, args.seconds, args.hz, segment_s, args.ranks) for r in range(args.ranks)
        )
        write_summary(run, {"status": "complete", "model": "bench", "world_size": args.ranks})
        gen_s = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in run.rglob("*.parquet"))
        print(f"store: {args.ranks} ranks x {args.seconds:g} s x {args.hz:g} Hz = {total:,} samples, "
              f"{size / 2**20:.0f} MiB of Parquet in {files_in(run):,} files "
              f"({args.segment_s:g} s segments), "
              f"written in {gen_s:.1f} s")  # fmt: skip
        results = {}
        for layout in args.layouts:
            if layout == "compacted":
                t1 = time.perf_counter()
                compact_run(run)
                print(f"charllm compact: {time.perf_counter() - t1:.1f} s -> {files_in(run):,} files")
            rows = [analyze_once(run, root / "out") for _ in range(args.repeats)]
            for i, (wall, cpu, rss, _) in enumerate(rows):
                print(f"  {layout} #{i + 1}: wall {wall:.2f} s, CPU {cpu:.2f} s, RSS {rss / 2**20:.0f} MiB, "
                      f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
            wall = statistics.median(r[0] for r in rows)
            cpu = statistics.median(r[1] for r in rows)
            results[layout] = (wall, cpu, max(r[2] for r in rows))
            print(f"{layout}: median of {args.repeats}: wall {wall:.2f} s "
                  f"({total / wall / 1e6:.2f} M samples/s), CPU {cpu:.2f} s, peak RSS "
                  f"{results[layout][2] / 2**20:.0f} MiB | {rows[0][3]}")  # fmt: skip
            floor = sorted(duckdb_floor(run) for _ in range(args.repeats))[args.repeats // 2]
            print(f"{layout}: DuckDB floor, same files (per-rank means, peaks): wall {floor[0]:.2f} s, "
                  f"CPU {floor[1]:.2f} s; analyze / floor CPU x{cpu / floor[1]:.1f}")  # fmt: skip
        if "compacted" in results:
            growth(args, root, results["compacted"])
        if len(results) < 2:
            return 0
        (uw, uc, _), (cw, cc, _) = results["uncompacted"], results["compacted"]
        print(f"uncompacted / compacted: wall x{uw / cw:.2f}, CPU x{uc / cc:.2f}; "
              f"load average now {os.getloadavg()[0]:.1f} (on a loaded machine the CPU time is the "
              "better guide)")  # fmt: skip
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
