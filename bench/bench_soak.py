"""Soak benchmark: does a long run cost the same memory and files in hour 300 as in minute 5?

Runs ``charllm train`` (default ``model=tiny_gpt nproc=2``, CPU, synthetic device: a high step
rate, so hours of steps pass in minutes) for ``--minutes``, and every ``--every`` seconds reads,
from /proc, the resident memory of every process of the run: each rank
(``charllm_nemo.train.worker``) and each telemetry process (the rank's ``RANK`` in its
environment says whose), split as /proc/PID/status splits it (``RssAnon``: heap, arenas,
stacks, what a leak grows; ``RssFile``: pages of mapped files, which the kernel can drop;
``RssShmem``), with the steps reported so far (lines of ``steps.jsonl``) and the store's files
per kind (``samples``, ``windows``, ``buffered`` Parquet files in the rank folders). At the
end, per process and kind: its memory at each reading, and the least-squares slope over the
readings after warm-up (``--warmup`` seconds and ``--warmup-steps`` steps both passed), in
bytes per step and MB per hour at the run's step rate, with its standard error (the noise a
slope must exceed to mean anything), the slopes of the first and second half of those readings
(a warm-up that levels off: the second smaller) and the change over them; the anonymous
mappings of /proc/PID/smaps whose resident bytes changed most over them (the brk ``[heap]`` of
glibc's main arena, a thread arena, pymalloc's 1 MiB arenas, an allocator's reservation); then
the file counts over time and their rate per rank-hour. ``--probe`` also reads, in every
process, glibc's ``mallinfo2()`` (bytes the arenas hold, in use, free inside them) and
pyarrow's memory pool (bench/soak_probe/sitecustomize.py, put on PYTHONPATH): in use flat while
the arena grows is fragmentation, not a leak; ``--trim`` calls ``malloc_trim(0)`` after each
probe reading (what the resident memory is with glibc's free pages given back). Not a test:
the figures in docs/soak.md come from it.

The CPU time (user + system) each process used after warm-up is printed too (per step and as
a share of a core): what a change of allocator costs.

Usage (the old code: ``--charllm /path/to/other/.venv/bin/charllm``)::

    .venv/bin/python bench/bench_soak.py --minutes 5 [--every 15] [--warmup 150] [--warmup-steps 1200]
        [--probe [--trim]] [--charllm ...] [-- extra overrides for charllm train]
"""

from __future__ import annotations

import argparse
import json
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
    """One process's readings: (seconds since start, steps reported, resident bytes by kind),
    and its anonymous mappings' resident bytes at the first reading after warm-up and the last."""

    name: str
    readings: list[tuple[float, int, dict[str, int]]] = field(default_factory=list)
    maps_first: dict[str, tuple[int, int]] | None = None
    maps_last: dict[str, tuple[int, int]] | None = None


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


RSS_KINDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")
"""/proc/PID/status's resident memory: the whole, then its parts: anonymous (heap, arenas,
stacks: what a leak grows), file-backed (pages of mapped files: libraries, memmapped indexes,
Parquet read through mmap; the kernel can drop them) and shared memory."""


def rss_bytes(pid: int) -> dict[str, int] | None:
    """The process's :data:`RSS_KINDS` in bytes (None when it is gone)."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key = line.split(":", 1)[0]
            if key in RSS_KINDS:
                out[key] = int(line.split()[1]) * 1024
    except OSError:
        return None
    if len(out) != len(RSS_KINDS):
        return None
    try:  # utime + stime, fields 14 and 15 of /proc/PID/stat (after the command's closing paren)
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out["cpu_ticks"] = int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None
    return out


def anon_mappings(pid: int) -> dict[str, tuple[int, int]] | None:
    """Per mapping of /proc/PID/smaps holding anonymous pages: (bytes mapped, anonymous bytes
    resident), keyed ``start name`` (the start stays while a heap or arena grows; name:
    ``[heap]`` the main malloc arena's brk heap, ``[stack]``, or none: mmapped memory: glibc's
    thread arenas (64 MiB reservations), large mallocs, pymalloc arenas, other allocators)."""
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return None
    out: dict[str, tuple[int, int]] = {}
    key, size = "", 0
    for line in text.splitlines():
        head = line.split(None, 1)[0]
        if "-" in head and not head.endswith(":"):
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            key, size = f"{parts[0].split('-')[0]} {parts[5] if len(parts) > 5 else ''}".rstrip(), hi - lo
        elif head == "Anonymous:" and key:
            kb = int(line.split()[1])
            if kb:
                out[key] = (size, kb * 1024)
    return out


PROBE_KINDS = ("malloc_arena", "malloc_hblkhd", "malloc_uordblks", "malloc_fordblks", "arrow_bytes")
"""What bench/soak_probe/sitecustomize.py reports that is reported here: glibc's bytes taken for
its arenas, in mmapped chunks, in use, free inside the arenas; pyarrow's pool in use."""


def probe_reading(folder: Path, pid: int) -> dict[str, int]:
    """The process's last probe line (:data:`PROBE_KINDS`; those missing are left out)."""
    try:
        with open(folder / f"probe-{pid}.jsonl", "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = f.read().splitlines()
        row = json.loads(lines[-1]) if lines else {}
    except (OSError, ValueError):
        return {}
    return {k: int(row[k]) for k in PROBE_KINDS if k in row}


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
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=1200,
        help="steps left out of the slopes too (default 1,200: the rings of the last 1,000 steps full)",
    )
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
    p.add_argument(
        "--probe",
        action="store_true",
        help="in every process, read glibc's mallinfo2 and pyarrow's pool (bench/soak_probe/)",
    )
    p.add_argument(
        "--trim", action="store_true", help="with --probe: malloc_trim(0) in every process after each reading"
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
    env = dict(os.environ)
    probe_dir = run.parent / "probe"
    if a.probe:
        probe_dir.mkdir()
        here = str(Path(__file__).resolve().parent / "soak_probe")
        env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env |= {"CHARLLM_SOAK_PROBE_DIR": str(probe_dir), "CHARLLM_SOAK_PROBE_EVERY": str(a.every / 3)}
        env |= {"CHARLLM_SOAK_PROBE_TRIM": "1"} if a.trim else {}
        trim = ", malloc_trim(0) after each" if a.trim else ""
        print(f"probe: mallinfo2/pyarrow every {a.every / 3:.1f} s{trim}")
    log = open(run.parent / "train.log", "wb")  # noqa: SIM115 - closed below
    launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
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
                if a.probe:
                    rss |= probe_reading(probe_dir, pid)
                track = tracks.setdefault(pid, Track(name))
                track.readings.append((now, n, rss))
                if now >= a.warmup and n >= a.warmup_steps:
                    maps = anon_mappings(pid)
                    if track.maps_first is None:
                        track.maps_first = maps
                    track.maps_last = maps
            files.append((now, n, store_files(run)))
            mem = "  ".join(
                f"{t.name}: {t.readings[-1][2]['VmRSS'] / 2**20:.1f} MB"
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
    report(tracks, files, loads, (a.warmup, a.warmup_steps), a.nproc)
    if not a.keep:
        shutil.rmtree(run.parent, ignore_errors=True)
    else:
        print(f"run directory kept: {run}")
    return 0


def report(
    tracks: dict[int, Track],
    files: list[tuple[float, int, dict[str, int]]],
    loads: list[float],
    warmup: tuple[float, int],
    nproc: int,
) -> None:
    """Print the readings and slopes; ``warmup`` (seconds, steps): the readings before both
    passed are left out of the slopes."""

    def warm(t: float, n: int) -> bool:
        return t >= warmup[0] and n >= warmup[1]

    late = [(t, n) for t, n, _ in files if warm(t, n)]
    if len(late) >= 2 and late[-1][0] > late[0][0]:
        rate = (late[-1][1] - late[0][1]) / (late[-1][0] - late[0][0])
    else:
        rate = math.nan
    if loads:
        print(f"\nload average during the run: {min(loads):.1f} - {max(loads):.1f} (1 min)")
    print(f"step rate after warm-up: {rate:.1f} steps/s")
    print(
        "\nresident memory (MB) at each reading by kind (VmRSS = RssAnon + RssFile + RssShmem), and its "
        "slope after warm-up (slope +- standard error):"
    )
    for track in sorted(tracks.values(), key=lambda t: t.name):
        r = track.readings
        after = [x for x in r if warm(x[0], x[1])]
        print(f"  {track.name} ({len(after)} readings after {warmup[0]:.0f} s and step {warmup[1]}):")
        for kind in RSS_KINDS + PROBE_KINDS:
            if any(kind not in m for _, _, m in after) or not after:
                continue
            values = " ".join(f"{m[kind] / 2**20:.1f}" if kind in m else "-" for _, _, m in r)
            print(f"    {kind:8s} {values}")
            per_step, se_step = slope([float(x[1]) for x in after], [float(x[2][kind]) for x in after])
            per_s, se_s = slope([x[0] for x in after], [float(x[2][kind]) for x in after])
            half = len(after) // 2
            halves = [
                slope([float(x[1]) for x in part], [float(x[2][kind]) for x in part])[0]
                for part in (after[: half + 1], after[half:])
            ]
            change = after[-1][2][kind] - after[0][2][kind]
            print(
                f"             slope {per_step:+.1f} +- {se_step:.1f} B/step, "
                f"{per_s * 3600 / 2**20:+.2f} +- {se_s * 3600 / 2**20:.2f} MB/hour; first half "
                f"{halves[0]:+.1f}, second half {halves[1]:+.1f} B/step; {change / 2**10:+.0f} KB over "
                f"steps {after[0][1]}-{after[-1][1]}"
            )
        if len(after) >= 2:
            cpu = (after[-1][2]["cpu_ticks"] - after[0][2]["cpu_ticks"]) / os.sysconf("SC_CLK_TCK")
            wall, done = after[-1][0] - after[0][0], after[-1][1] - after[0][1]
            print(
                f"    CPU (user + system) after warm-up: {cpu:.1f} s over {wall:.0f} s "
                f"({100 * cpu / wall:.1f} % of a core), {1e3 * cpu / max(done, 1):.2f} ms a step"
            )
        report_mappings(track)
    print("\nstore files (all ranks; compacted ones in brackets) over time:")
    for t, n, c in files:
        print(
            f"  {t:6.0f} s  step {n:7d}  " + "  ".join(f"{k} {c[k]} ({c[k + '_compacted']})" for k in KINDS)
        )
    late_files = [(t, c) for t, n, c in files if warm(t, n)]
    if len(late_files) >= 3:
        print("  after warm-up, per rank-hour (slope of the count over time; at most, waiting uncompacted):")
        for k in KINDS:
            per_s, se = slope([t for t, _ in late_files], [float(c[f"{k}_compacted"]) for _, c in late_files])
            waiting = max(c[k] - c[f"{k}_compacted"] for _, c in late_files) / nproc
            print(
                f"    {k}: {per_s * 3600 / nproc:.0f} +- {se * 3600 / nproc:.0f} compacted files, "
                f"{waiting:.0f} segments waiting"
            )


def report_mappings(track: Track, top: int = 6) -> None:
    """The anonymous mappings whose resident bytes changed most between the first reading after
    warm-up and the last: where the anonymous memory went (the brk heap, an arena, ...)."""
    first, last = track.maps_first, track.maps_last
    if not first or not last:
        return
    keys = set(first) | set(last)
    before = {k: first.get(k, (0, 0))[1] for k in keys}
    after = {k: last.get(k, (0, 0))[1] for k in keys}
    grown = sorted(keys, key=lambda k: -abs(after[k] - before[k]))[:top]
    print(
        f"    anonymous mappings, first reading after warm-up -> last: {len(first)} -> {len(last)}, "
        f"{sum(before.values()) / 2**20:.1f} -> {sum(after.values()) / 2**20:.1f} MB resident; "
        "largest changes:"
    )
    for k in grown:
        _, _, name = k.partition(" ")
        mapped = max(first.get(k, (0, 0))[0], last.get(k, (0, 0))[0])
        print(
            f"      {name or 'anon':8s} {mapped / 2**20:8.1f} MB mapped  {before[k] / 2**10:8.0f} -> "
            f"{after[k] / 2**10:8.0f} KB resident ({(after[k] - before[k]) / 2**10:+.0f})"
        )


if __name__ == "__main__":
    sys.exit(main())
