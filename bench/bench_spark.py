"""Time ``charllm analyze --engine spark`` (pyspark, ``local[2]``) against the local engine on
the same small store: 2 ranks x a few minutes x 100 Hz, at 1x, 2x and 4x the rows, so the growth
per doubling shows (issue #45: the Spark engine was quadratic in samples per device, then
~1-4 minutes of fixed cost on this loaded 2-core VM).

The store is bench_analyze.py's (the same synthetic rank: power square wave, energy counter,
temperatures, throttle mask, PCIe counters, one-second steps of 4 microbatches). Each analysis
runs in a child process; printed per size and engine: wall and CPU time (user + sys of the child
and the processes it reaped), peak RSS and the load average, then the ratio per doubling. With
Spark, the child's rusage misses the JVM and its Python workers (pyspark does not reap them
before exit): the "tree CPU" beside it is every descendant's CPU time read from /proc every
0.1 s (the JVM, the Python workers, the driver), a lower bound (a process's last 0.1 s, and one
that lives less than that, are missed).

Usage: .venv/bin/python bench/bench_spark.py [--ranks 2] [--seconds 120] [--scales 1 2 4]
       [--master local[2]]
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_analyze import make_rank
from charllm_nemo.analysis.store_writer import write_summary

TICK = os.sysconf("SC_CLK_TCK")


def _tree_cpu(root: int) -> dict[int, float]:
    """CPU seconds (user + sys) of ``root`` and every process below it, read from /proc."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / TICK
    tree, grew = {root}, True
    while grew:
        below = {p for p, pp in parent.items() if pp in tree} - tree
        grew = bool(below)
        tree |= below
    return {p: cpu[p] for p in tree if p in cpu}


def analyze_tree(run: Path, out: Path, extra: tuple[str, ...]) -> tuple[float, float, float, int]:
    """``charllm analyze --no-figures`` of ``run`` in a child process: (wall s, the child's CPU
    from its rusage, the process tree's CPU polled every 0.1 s, the child's peak RSS in bytes)."""
    cmd = [sys.executable, "-m", "charllm_nemo.cli", "analyze", str(run), "--no-figures", "--out", str(out)]
    seen: dict[int, float] = {}
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen([*cmd, *extra], stdout=log, stderr=subprocess.STDOUT, text=True)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            for p, c in _tree_cpu(proc.pid).items():
                seen[p] = max(c, seen.get(p, 0.0))
            time.sleep(0.1)
        wall = time.perf_counter() - t0
        if os.waitstatus_to_exitcode(status):
            log.seek(0)
            raise SystemExit(f"charllm analyze failed:\n{log.read()}")
    own = usage.ru_utime + usage.ru_stime
    seen[proc.pid] = max(own, seen.get(proc.pid, 0.0))
    return wall, own, sum(seen.values()), usage.ru_maxrss * 1024


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
                wall, cpu, tree, rss = analyze_tree(run, root / f"out-{engine}-{scale}", extra)
                results[engine].append((n, wall, tree))
                print(f"{engine:5s} x{scale}: {args.ranks} ranks x {seconds:g} s = {n:,} samples: "
                      f"wall {wall:.2f} s, CPU {cpu:.2f} s (tree CPU {tree:.2f} s), "
                      f"RSS {rss / 2**20:.0f} MiB, load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        for engine, rows in results.items():
            steps = [
                f"x{b[2] / a[2]:.2f} tree CPU, x{b[1] / a[1]:.2f} wall" for a, b in itertools.pairwise(rows)
            ]
            print(f"{engine}: per doubling of the rows: {'; '.join(steps) or 'one size only'}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
