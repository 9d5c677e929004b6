"""Soak benchmark: does a long run cost the same memory and files in hour 300 as in minute 5?

Runs ``charllm train`` (default ``model=tiny_gpt nproc=2``, CPU, synthetic device: a high step
rate, so hours of steps pass in minutes) for ``--minutes``, and every ``--every`` seconds reads,
from /proc, the resident memory (VmRSS) of every process of the run: each rank
(``charllm_nemo.train.worker``) and each telemetry process (the rank's ``RANK`` in its
environment says whose), with the steps reported so far (lines of ``steps.jsonl``) and the
store's files per kind (``samples``, ``windows``, ``buffered`` Parquet files in the rank
folders). At the end, per process: its memory at each reading, and the least-squares slope of
memory over the readings after ``--warmup`` seconds, in bytes per step and MB per hour at the
run's step rate, with its standard error (the noise a slope must exceed to mean anything);
then the file counts over time and their rate per rank-hour. Not a test: the figures in
docs/benchmarks.md come from it.

Usage (the old code: ``--charllm /path/to/other/.venv/bin/charllm``)::

    .venv/bin/python bench/bench_soak.py --minutes 5 [--every 15] [--warmup 150] [--charllm ...]
        [-- extra overrides for charllm train]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("samples", "windows", "buffered")


@dataclass
class Track:
    """One process's readings: (seconds since start, steps reported, resident bytes)."""

    name: str
    readings: list[tuple[float, int, int]] = field(default_factory=list)


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def descendants(root: int) -> list[int]:
    kids, todo, seen = _children(), [root], []
    while todo:
        pid = todo.pop()
        for c in kids.get(pid, []):
            seen.append(c)
            todo.append(c)
    return seen


def describe(pid: int) -> str | None:
    """``rank 0`` / ``telemetry of rank 0`` / None (not one of ours, or gone)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    rank = next((e[5:].decode() for e in env if e.startswith(b"RANK=")), None)
    if rank is None:
        return None
    if "charllm_nemo.train.worker" in cmd:
        return f"rank {rank}"
    if "python" in cmd:  # the rank's telemetry process (multiprocessing's spawn / forkserver child)
        return f"telemetry of rank {rank}"
    return None


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class LineCounter:
    """Lines of a growing file, read incrementally (no link followed)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.lines = path, 0, 0

    def count(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return self.lines
        try:
            os.lseek(fd, self.offset, os.SEEK_SET)
            while chunk := os.read(fd, 1 << 20):
                self.lines += chunk.count(b"\n")
                self.offset += len(chunk)
        finally:
            os.close(fd)
        return self.lines


def store_files(run: Path) -> dict[str, int]:
    """Parquet files of the store by kind over all rank folders: ``<kind>`` every file,
    ``<kind>_compacted`` those a compaction wrote (``samples-000000-000119.parquet``)."""
    counts = dict.fromkeys(KINDS, 0) | {f"{k}_compacted": 0 for k in KINDS}
    try:
        folders = [
            e for e in os.scandir(run) if e.is_dir(follow_symlinks=False) and e.name.startswith("rank=")
        ]
    except OSError:
        return counts
    for folder in folders:
        try:
            for e in os.scandir(folder.path):
                kind = e.name.split("-", 1)[0]
                if kind in KINDS and e.name.endswith(".parquet") and not e.name.startswith("."):
                    counts[kind] += 1
                    counts[f"{kind}_compacted"] += e.name.count("-") == 2
        except OSError:
            continue
    return counts


def slope(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope of ys over xs and its standard error (nan with < 3 points)."""
    n = len(xs)
    if n < 3:
        return math.nan, math.nan
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return math.nan, math.nan
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    resid = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return b, math.sqrt(resid / (n - 2) / sxx)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=5.0, help="how long the run goes (default 5)")
    p.add_argument("--every", type=float, default=15.0, help="seconds between readings (default 15)")
    p.add_argument("--warmup", type=float, default=150.0, help="seconds left out of the slopes (default 150)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument(
        "--steps",
        type=int,
        default=100_000,
        help="batch.train_steps (the data's index is sized by it; default 100,000)",
    )
    p.add_argument(
        "--charllm", default=str(Path(sys.executable).with_name("charllm")), help="the charllm to run"
    )
    p.add_argument("--keep", action="store_true", help="keep the run directory (default: removed)")
    p.add_argument("overrides", nargs="*", help="more charllm train overrides (after --)")
    a = p.parse_args()
    run = Path(tempfile.mkdtemp(prefix="charllm-soak-")) / "run"
    cmd = [
        a.charllm, "train", "model=tiny_gpt", f"nproc={a.nproc}", f"batch.train_steps={a.steps}",
        "telemetry.backend=synthetic", f"telemetry.out_dir={run}", *a.overrides,
    ]  # fmt: skip
    print("running:", " ".join(cmd), flush=True)
    print(f"load average at start: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs", flush=True)
    log = open(run.parent / "train.log", "wb")  # noqa: SIM115 - closed below
    launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    steps = LineCounter(run / "steps.jsonl")
    tracks: dict[int, Track] = {}
    files: list[tuple[float, int, dict[str, int]]] = []
    loads: list[float] = []
    t0 = time.monotonic()
    end = t0 + a.minutes * 60
    try:
        while time.monotonic() < end and launcher.poll() is None:
            time.sleep(min(a.every, max(0.0, end - time.monotonic())))
            now, n = time.monotonic() - t0, steps.count()
            loads.append(os.getloadavg()[0])
            for pid in descendants(launcher.pid):
                name = describe(pid)
                rss = rss_bytes(pid) if name else None
                if name is None or rss is None:
                    continue
                tracks.setdefault(pid, Track(name)).readings.append((now, n, rss))
            files.append((now, n, store_files(run)))
            mem = "  ".join(
                f"{t.name}: {t.readings[-1][2] / 2**20:.1f} MB"
                for t in tracks.values()
                if t.readings[-1][0] == now
            )
            stored = " ".join(f"{k} {files[-1][2][k]}" for k in KINDS)
            print(f"  {now:6.0f} s  step {n:7d}  {mem}  files {stored}", flush=True)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGTERM)  # the launcher forwards it to its ranks
            try:
                launcher.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
        log.close()
    report(tracks, files, loads, a.warmup, a.nproc)
    if not a.keep:
        shutil.rmtree(run.parent, ignore_errors=True)
    else:
        print(f"run directory kept: {run}")
    return 0


def report(
    tracks: dict[int, Track],
    files: list[tuple[float, int, dict[str, int]]],
    loads: list[float],
    warmup: float,
    nproc: int,
) -> None:
    late = [(t, n) for t, n, _ in files if t >= warmup]
    if len(late) >= 2 and late[-1][0] > late[0][0]:
        rate = (late[-1][1] - late[0][1]) / (late[-1][0] - late[0][0])
    else:
        rate = math.nan
    if loads:
        print(f"\nload average during the run: {min(loads):.1f} - {max(loads):.1f} (1 min)")
    print(f"step rate after warm-up: {rate:.1f} steps/s")
    print("\nresident memory (MB) at each reading, and its slope after warm-up (slope +- standard error):")
    for track in sorted(tracks.values(), key=lambda t: t.name):
        r = track.readings
        print(f"  {track.name}: " + " ".join(f"{b / 2**20:.1f}" for _, _, b in r))
        after = [x for x in r if x[0] >= warmup]
        per_step, se_step = slope([float(x[1]) for x in after], [float(x[2]) for x in after])
        per_s, se_s = slope([x[0] for x in after], [float(x[2]) for x in after])
        print(
            f"    after {warmup:.0f} s ({len(after)} readings): {per_step:+.1f} +- {se_step:.1f} B/step, "
            f"{per_s * 3600 / 2**20:+.2f} +- {se_s * 3600 / 2**20:.2f} MB/hour"
        )
    print("\nstore files (all ranks; compacted ones in brackets) over time:")
    for t, n, c in files:
        print(
            f"  {t:6.0f} s  step {n:7d}  " + "  ".join(f"{k} {c[k]} ({c[k + '_compacted']})" for k in KINDS)
        )
    late_files = [(t, c) for t, _, c in files if t >= warmup]
    if len(late_files) >= 3:
        print("  after warm-up, per rank-hour (slope of the count over time; at most, waiting uncompacted):")
        for k in KINDS:
            per_s, se = slope([t for t, _ in late_files], [float(c[f"{k}_compacted"]) for _, c in late_files])
            waiting = max(c[k] - c[f"{k}_compacted"] for _, c in late_files) / nproc
            print(
                f"    {k}: {per_s * 3600 / nproc:.0f} +- {se * 3600 / nproc:.0f} compacted files, "
                f"{waiting:.0f} segments waiting"
            )


if __name__ == "__main__":
    sys.exit(main())
