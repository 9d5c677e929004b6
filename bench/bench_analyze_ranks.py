"""``charllm analyze`` over many small ranks: how the reduction's cost grows with the rank count.

Each rank holds 2 s of samples at 100 Hz and 2 steps (the data is tiny, so what is timed is the
per-rank overhead: reading, reducing, and passing tasks to worker processes). Three ways side by
side, in one run, on the same store:

* ``pool, whole run``: worker processes, each task carrying the whole ``Run`` (what analyze did
  before: the pickled task grows with the rank count, so the total is quadratic);
* ``pool, rank files``: worker processes, each task carrying its rank's paths only (now);
* ``one process``: no pool.

Usage: .venv/bin/python bench/bench_analyze_ranks.py [--ranks 1000 250] [--workers 2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from charllm_nemo.analysis.load import open_run
from charllm_nemo.analysis.rank_tables import reduce_files, reduce_rank
from charllm_nemo.analysis.store_writer import write_rank

MS = 1_000_000


def make_run(run: Path, ranks: int) -> None:
    n = 201
    t = (np.arange(n) * 10 * MS).astype(np.int64)
    b = np.array([500, 1500]) * MS
    windows = {
        "window_id": np.arange(2, dtype=np.int64), "kind": ["step"] * 2, "name": ["step"] * 2,
        "step": np.arange(2, dtype=np.int64), "microbatch": np.full(2, -1, np.int64),
        "t_begin_mono_ns": b, "t_end_mono_ns": b + 900 * MS, "pp_stage": np.zeros(2, np.int64),
    }  # fmt: skip
    for r in range(ranks):
        samples = {
            "t_mono_ns": t,
            "power_instant_w": np.full(n, 400.0),
            "energy_mj": (10**12 + np.arange(n) * 4000).astype(np.int64),
            "temp_gpu_c": np.full(n, 50.0),
        }
        write_rank(run, r, samples, windows, {"world_size": ranks, "host": f"node{r // 8}"})


def timed(label: str, results: Iterable[object], base: float | None) -> float:
    """Time consuming ``results`` (a lazy map: the work happens as it is read)."""
    t0 = time.perf_counter()
    n = sum(1 for _ in results)
    dt = time.perf_counter() - t0
    ratio = f"  x{dt / base:.2f} of one process" if base else ""
    print(f"  {label:20s} {dt:7.2f} s  ({n} ranks){ratio}", flush=True)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[250, 1000])
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    ctx = multiprocessing.get_context("spawn")
    print(f"load average {os.getloadavg()[0]:.1f}, {args.workers} workers", file=sys.stderr)
    for ranks in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "run"
            make_run(path, ranks)
            run = open_run(path, path)
            files = [run.files.ranks[r] for r in run.ranks]
            print(f"{ranks} ranks:")
            base = timed("one process", map(reduce_files, files), None)
            with ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
                list(pool.map(abs, range(args.workers)))  # workers started outside the timing
                chunk = max(1, ranks // (args.workers * 8))
                timed("pool, rank files", pool.map(reduce_files, files, chunksize=chunk), base)
                timed("pool, whole run", pool.map(reduce_rank, [run] * ranks, run.ranks), base)


if __name__ == "__main__":
    main()
