"""Time ``charllm analyze --engine spark`` (pyspark, ``local[2]``) against the local engine on
the same small store: 2 ranks x a few minutes x 100 Hz, at 1x, 2x and 4x the rows, so the growth
per doubling shows (issue #45: the Spark engine was quadratic in samples per device).

The store is bench_analyze.py's (the same synthetic rank: power square wave, energy counter,
temperatures, throttle mask, PCIe counters, one-second steps of 4 microbatches). Each analysis
runs in a child process; printed per size and engine: wall and CPU time (user + sys of the child
and the processes it reaped: the JVM is the child's child, so its CPU counts when the child
reaps it at exit), peak RSS and the load average, then the ratio per doubling.

Usage: .venv/bin/python bench/bench_spark.py [--ranks 2] [--seconds 120] [--scales 1 2 4]
       [--master local[2]]
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_analyze import analyze_once, make_rank
from charllm_nemo.analysis.store_writer import write_summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=120.0, help="seconds of samples per rank at scale 1")
    ap.add_argument("--hz", type=float, default=100.0)
    ap.add_argument("--scales", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--engines", nargs="+", default=["local", "spark"], choices=["local", "spark"])
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-spark-"))
    results: dict[str, list[tuple[int, float, float]]] = {e: [] for e in args.engines}
    try:
        for scale in args.scales:
            run = root / f"x{scale}" / "run"
            seconds = args.seconds * scale
            n = sum(make_rank(run, r, seconds, args.hz, 3600.0, args.ranks) for r in range(args.ranks))
            write_summary(run, {"status": "complete", "model": "bench", "world_size": args.ranks})
            for engine in args.engines:
                extra = ("--engine", "spark", "--spark-master", args.master) if engine == "spark" else ()
                wall, cpu, rss, _ = analyze_once(run, root / f"out-{engine}-{scale}", extra)
                results[engine].append((n, wall, cpu))
                print(f"{engine:5s} x{scale}: {args.ranks} ranks x {seconds:g} s = {n:,} samples: "
                      f"wall {wall:.2f} s, CPU {cpu:.2f} s, RSS {rss / 2**20:.0f} MiB, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        for engine, rows in results.items():
            steps = [f"x{b[2] / a[2]:.2f} CPU, x{b[1] / a[1]:.2f} wall" for a, b in itertools.pairwise(rows)]
            print(f"{engine}: per doubling of the rows: {'; '.join(steps) or 'one size only'}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
