"""Time ``charllm analyze`` on a large store: 32 ranks x 1 hour x 100 Hz (~11.5 M samples).

The store is written with pyarrow in the store's real format (charllm_nemo.analysis.store_writer):
per rank 360,000 samples (power, energy counter, temperatures, clocks, throttle mask, PCIe
counters, power limit) and 3,600 one-second steps of 4 microbatches each (18,000 windows). The
telemetry writer flushes a segment every 0.5 s (50 rows); a one-hour run would have 7,200 files
per rank, so this benchmark writes ``--segment-s`` worth per file (default 60 s: 60 per rank) and
says so. ``charllm analyze --no-figures`` then runs in a child process; the benchmark prints its
wall time, samples per second, CPU time and peak RSS (the child's rusage), against the data's
in-memory size (samples x columns x 8 bytes), and the load average (a shared machine's wall time
says more about its neighbours than about the analysis).

Usage: .venv/bin/python bench/bench_analyze.py [--ranks 32] [--seconds 3600] [--hz 100] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from charllm_nemo.analysis.store_writer import write_rank, write_summary


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=3600.0)
    ap.add_argument("--hz", type=float, default=100.0)
    ap.add_argument("--segment-s", type=float, default=60.0)
    ap.add_argument("--dir", help="where to write the store (default: a temporary folder, removed after)")
    args = ap.parse_args()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-analyze-"))
    run = root / "run"
    try:
        t0 = time.perf_counter()
        total = sum(
            make_rank(run, r, args.seconds, args.hz, args.segment_s, args.ranks) for r in range(args.ranks)
        )
        write_summary(run, {"status": "complete", "model": "bench", "world_size": args.ranks})
        gen_s = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in run.rglob("*.parquet"))
        print(f"store: {args.ranks} ranks x {args.seconds:g} s x {args.hz:g} Hz = {total:,} samples, "
              f"{size / 2**20:.0f} MiB of Parquet, written in {gen_s:.1f} s")  # fmt: skip
        cmd = [
            sys.executable,
            "-m",
            "charllm_nemo.cli",
            "analyze",
            str(run),
            "--no-figures",
            "--out",
            str(root / "out"),
        ]
        t1 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t1
        if proc.returncode:
            print(proc.stdout, proc.stderr)
            return proc.returncode
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        rss = usage.ru_maxrss * 1024
        cpu = usage.ru_utime + usage.ru_stime
        in_memory = total * 25 * 8  # ~25 numeric columns x 8 bytes
        print(f"charllm analyze: {wall:.2f} s, {total / wall / 1e6:.2f} M samples/s, "
              f"peak RSS {rss / 2**20:.0f} MiB (data in memory ~{in_memory / 2**20:.0f} MiB: "
              f"{rss / in_memory:.2f}x); CPU time {cpu:.2f} s (user+sys, all threads; on a "
              f"loaded machine the wall time is the worse guide), "
              f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
        print(proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else "")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
