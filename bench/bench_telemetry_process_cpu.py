"""Where the telemetry process's CPU goes, per sample, at 100 Hz (docs/telemetry.md, "What it costs").

One TelemetrySession in process mode (synthetic device) per configuration; the training side
marks NeMo-like steps (a step window every ``--step-ms`` with 4 microbatches' forward / backward
phases and an optimizer phase, ~14 windows a step) or nothing (``idle``). Over ``--seconds`` of
steady state, each thread of the telemetry process is read from ``/proc/<pid>/task/<tid>/schedstat``
(CPU time in ns): the sampling loop (the process's main thread) and the collector (the thread
that takes samples and windows, answers figure requests and writes Parquet). The Parquet
flush's share is the difference between flushing every 0.5 s (the default) and not flushing in
the measured span (``flush_interval_s`` longer than the run). Configurations alternate, each
``--rounds`` times; the medians and ranges over rounds are printed, per sample.

    .venv/bin/python bench/bench_telemetry_process_cpu.py --seconds 20 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """CPU time of each thread of ``pid`` (schedstat's first field: ns on the CPU)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError):
            continue
    return out


def one(config: str, seconds: float, hz: float, step_ms: float, microbatches: int) -> dict[str, float]:
    from charllm_nemo.telemetry.session import TelemetrySession
    from charllm_nemo.telemetry.session_options import SessionOptions, StoreOptions

    flush = 0.5 if config != "no-flush" else 10 * seconds + 60
    out = tempfile.mkdtemp(prefix="bench-tpcpu-")
    s = TelemetrySession(
        out,
        SessionOptions(
            backend="synthetic", hz=hz, sampler="process", store=StoreOptions(flush_interval_s=flush)
        ),
        handle_signals=False,
    )
    s.start()
    try:
        pid = s.engine.pid
        assert pid is not None
        w = s.windows
        period = step_ms / 1e3
        step = 0

        def steps_for(span: float) -> None:
            nonlocal step
            end = time.monotonic() + span
            while time.monotonic() < end:
                t0 = time.monotonic()
                if config != "idle":
                    sid = w.begin("step", step=step)
                    for mb in range(microbatches):
                        for name in ("forward", "backward"):
                            wid = w.begin("phase", name, step=step, microbatch=mb)
                            w.end(wid)
                    wid = w.begin("phase", "optimizer", step=step)
                    w.end(wid)
                    w.end(sid)
                step += 1
                time.sleep(max(0.0, period - (time.monotonic() - t0)))

        steps_for(2.0)  # warm-up: imports done, first segments written
        before, t0, n0 = thread_cpu_ns(pid), time.monotonic(), s.engine.health.samples
        steps_for(seconds)
        after, t1, n1 = thread_cpu_ns(pid), time.monotonic(), s.engine.health.samples
    finally:
        s.close("complete")
    samples = max(1, n1 - n0)
    used = {tid: after[tid] - before.get(tid, 0) for tid in after}
    main = used.get(pid, 0)
    others = sorted((v for tid, v in used.items() if tid != pid), reverse=True)
    return {
        "samples": samples,
        "rate": samples / (t1 - t0),
        "loop_us": main / samples / 1e3,
        "collector_us": (others[0] if others else 0) / samples / 1e3,
        "rest_us": sum(others[1:]) / samples / 1e3,
        "total_pct": 100 * sum(used.values()) / 1e9 / (t1 - t0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hz", type=float, default=100.0)
    ap.add_argument("--step-ms", type=float, default=35.0)
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args()
    configs = ("steps", "no-flush", "idle")
    rows: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for c in configs if r % 2 == 0 else tuple(reversed(configs)):
            rows[c].append(one(c, args.seconds, args.hz, args.step_ms, args.microbatches))
    print(
        f"telemetry process at {args.hz:g} Hz, synthetic device, {args.rounds} round(s) of "
        f"{args.seconds:g} s per configuration; steps of {args.step_ms:g} ms with "
        f"{args.microbatches} microbatches; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print("config     samples/s  loop us/sample  collector us/sample  other threads  process CPU %")

    def cell(c: str, k: str, fmt: str) -> str:
        xs = [row[k] for row in rows[c]]
        return f"{format(statistics.median(xs), fmt)} [{format(min(xs), fmt)}-{format(max(xs), fmt)}]"

    for c in configs:
        print(
            f"{c:<10} {cell(c, 'rate', '.1f'):>18} {cell(c, 'loop_us', '.1f'):>18} "
            f"{cell(c, 'collector_us', '.1f'):>20} {cell(c, 'rest_us', '.1f'):>16} "
            f"{cell(c, 'total_pct', '.2f'):>18}"
        )
    flush = [
        a["collector_us"] - b["collector_us"] for a, b in zip(rows["steps"], rows["no-flush"], strict=True)
    ]
    print(
        f"Parquet flushes (every 0.5 s), per sample: {statistics.median(flush):.1f} us "
        f"[{min(flush):.1f}, {max(flush):.1f}] (collector, steps minus no-flush, paired by round)"
    )


if __name__ == "__main__":
    main()
