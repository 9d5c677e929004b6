"""How often each thread of this process wakes, from the kernel's own counts: every time a
thread blocks (a sleep, a timed wait, a lock, a read) and runs again the kernel counts one
voluntary context switch in ``/proc/self/task/<tid>/status``; ``schedstat`` gives its CPU time.
Python names are matched to kernel thread ids through ``threading.enumerate()``'s
``native_id`` (Python 3.11 does not name its threads for the kernel)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadCounts:
    name: str
    voluntary: int  # blocked and woke again
    involuntary: int  # preempted
    cpu_ns: int


def snapshot() -> tuple[float, dict[int, ThreadCounts]]:
    """(monotonic time, tid -> counts) for every thread of this process now."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[int, ThreadCounts] = {}
    for entry in os.listdir("/proc/self/task"):
        tid = int(entry)
        try:
            with open(f"/proc/self/task/{tid}/status") as fh:
                status = dict(line.split(":", 1) for line in fh if ":" in line)
            with open(f"/proc/self/task/{tid}/schedstat") as fh:
                cpu_ns = int(fh.read().split()[0])
        except (OSError, ValueError):
            continue  # ended in between
        comm = status.get("Name", "?").strip()
        out[tid] = ThreadCounts(
            names.get(tid, f"native:{comm}"),
            int(status["voluntary_ctxt_switches"]),
            int(status["nonvoluntary_ctxt_switches"]),
            cpu_ns,
        )
    return time.monotonic(), out


def rates(
    before: tuple[float, dict[int, ThreadCounts]], after: tuple[float, dict[int, ThreadCounts]]
) -> list[dict]:
    """Per thread alive at both ends: wakeups a second (voluntary switches), preemptions a
    second, CPU share of one core; most wakeups first."""
    (t0, a), (t1, b) = before, after
    dt = max(t1 - t0, 1e-9)
    rows = []
    for tid, end in b.items():
        start = a.get(tid)
        if start is None:
            continue
        rows.append(
            {
                "tid": tid,
                "name": end.name,
                "wakeups_per_s": (end.voluntary - start.voluntary) / dt,
                "preempted_per_s": (end.involuntary - start.involuntary) / dt,
                "cpu_share": (end.cpu_ns - start.cpu_ns) / 1e9 / dt,
            }
        )
    return sorted(rows, key=lambda r: -r["wakeups_per_s"])


def format_rows(rows: list[dict], min_wakeups: float = 0.5) -> str:
    return "\n".join(
        f"    {r['name']:<28} {r['wakeups_per_s']:8.1f} wakeups/s  {r['preempted_per_s']:6.1f} preempted/s  "
        f"{100 * r['cpu_share']:5.2f} % of a core"
        for r in rows
        if r["wakeups_per_s"] >= min_wakeups or r["cpu_share"] >= 0.001
    )
