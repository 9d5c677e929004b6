"""What one live figure request costs the telemetry process: ``Collector.figures`` for a step.

Run:  .venv/bin/python bench/bench_live_figures.py [--calls 2000] [--devices 1] [--against DIR]

The telemetry process answers every step's figure request (telemetry/process/collector.py): it slices
the samples it holds in memory around the step's window and attributes them
(telemetry/attribution.py). This bench builds that state exactly: a shared block, the sampler's
ring filled at 100 Hz with every metric an NVML device reports (energy counter ticking every
other sample, a throttle mask, 64-bit traffic counters), taken by a real ``Collector`` one sample
per take (the most chunks a live slice can meet: the collector now takes a step's samples at
once, when a request wakes it), 10 s of history. Then it times ``Collector.figures`` for a 34 ms
window that ended one sample before the newest (a tiny_gpt step on this VM, answered as soon as a
sample past its end arrived), for the figures the step API asks for (``STEP_FIGURE_KEYS``,
whatever the logger) and for every attribution column, with ``--devices`` devices per rank.

``--against DIR``: a second checkout (e.g. ``git worktree add /tmp/base HEAD~3``). Each source
tree is measured in its own child process, alternating ``--rounds`` times (A, B, A, B, ...), and
the ratio of their medians is printed: two versions side by side in one run.

These are hot-cache figures (the same call back to back). Inside a training run the telemetry
process's caches are cold at every request and one call costs about three times as much
(docs/bench-train.md); the ratio between versions is what this bench is for.
The last line is ``BENCH_JSON {...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PERIOD_NS = 10_000_000  # 100 Hz
STEP_NS = 34_000_000
HISTORY_S = 10.0


def measure(calls: int, n_devices: int) -> dict[str, Any]:
    """In this process, against the charllm_nemo on sys.path: µs per ``Collector.figures`` call."""
    import secrets

    from charllm_nemo.sinks.keys import STEP_FIGURE_KEYS
    from charllm_nemo.telemetry.process import mark_ring
    from charllm_nemo.telemetry.process import ring as shm
    from charllm_nemo.telemetry.process.collector import Collector
    from charllm_nemo.telemetry.schema import METRIC_INDEX, METRICS
    from charllm_nemo.telemetry.store import RankStore

    def reading(i: int, dev: int) -> tuple[Any, ...]:
        v: list[Any] = [None] * len(METRICS)
        for m in METRICS:
            if m.kind == "float":
                v[METRIC_INDEX[m.name]] = 100.0 + (i * 7 + dev) % 13
        v[METRIC_INDEX["energy_mj"]] = 10**9 + (i // 2) * 8000
        v[METRIC_INDEX["throttle_reasons"]] = 0x4 if i % 5 == 0 else 0
        for name in ("violation_power_ns", "violation_thermal_ns"):
            v[METRIC_INDEX[name]] = i * 1000
        for name in ("pcie_tx_bytes", "pcie_rx_bytes", "nvlink_tx_bytes", "nvlink_rx_bytes"):
            v[METRIC_INDEX[name]] = 2**62 + i * 10**6
        for name in ("util_gpu_pct", "util_mem_pct", "mem_used_bytes"):
            v[METRIC_INDEX[name]] = 50
        return tuple(v)

    n = int(HISTORY_S * 1e9 / PERIOD_NS)
    lay = shm.Layout(
        4 * n * n_devices,
        mark_capacity=64,
        fig_slots=8,
        n_devices=n_devices,
        n_fig_columns=len(mark_ring.figure_columns()),
    )
    name = f"charllm-bench-{secrets.token_hex(4)}"
    block = shm.create(name, lay)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            RankStore(Path(tmp), 0, {"rank": 0}, writes_segments=False)
            c = Collector(block, Path(tmp) / "rank=0", source="bench", period_ns=PERIOD_NS)
            ring = shm.RingWriter(block)
            t_base = 10**12
            for i in range(n):
                for dev in range(n_devices):
                    t = t_base + i * PERIOD_NS + dev
                    ring.emit((t, t, 1000, dev, reading(i, dev)))
                c.take_samples()  # one take per sample: the history holds one chunk per tick
            t1 = t_base + (n - 1) * PERIOD_NS - 3_000_000
            t0 = t1 - STEP_NS
            out: dict[str, Any] = {}
            for label, figures in (("step-api", STEP_FIGURE_KEYS), ("all", None)):
                c.figures(t0, t1, figures)  # first call: imports, caches
                per_call = []
                for _ in range(calls):
                    s = time.perf_counter_ns()
                    c.figures(t0, t1, figures)
                    per_call.append(time.perf_counter_ns() - s)
                per_call.sort()
                out[label] = {"median_us": per_call[len(per_call) // 2] / 1e3, "min_us": per_call[0] / 1e3}
            c.close()
            return out
    finally:
        block.close()
        shm.unlink(name)


def run_child(src: Path, calls: int, devices: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(src))
    cmd = [sys.executable, __file__, "--child", "--calls", str(calls), "--devices", str(devices)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"child for {src} failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000, help="timed calls per set and child (default 2000)")
    ap.add_argument("--devices", type=int, default=1, help="devices per rank (default 1)")
    ap.add_argument("--against", type=Path, help="a second checkout to compare with (its src/ is used)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating children per tree (default 3)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.calls < 1 or args.devices < 1 or args.rounds < 1:
        ap.error("--calls, --devices and --rounds must be at least 1")
    if args.child:
        print(json.dumps(measure(args.calls, args.devices)))
        return
    here = Path(__file__).resolve().parents[1] / "src"
    trees = {"this tree": here}
    if args.against is not None:
        other = args.against.resolve() / "src"
        if not (other / "charllm_nemo").is_dir():
            ap.error(f"--against {args.against}: no src/charllm_nemo there; give a checkout of this repo")
        trees["against"] = other
    print(
        f"Collector.figures for a {STEP_NS / 1e6:.0f} ms window, {args.devices} device(s), "
        f"{HISTORY_S:.0f} s of 100 Hz history; {args.calls} calls per set; trees: "
        + ", ".join(f"{k} = {v}" for k, v in trees.items()),
        flush=True,
    )
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in trees}
    for r in range(args.rounds):
        for label, src in trees.items():
            res = run_child(src, args.calls, args.devices)
            runs[label].append(res)
            print(
                f"  round {r + 1}/{args.rounds} {label:9s}: step-api {res['step-api']['median_us']:7.1f} µs, "
                f"all {res['all']['median_us']:7.1f} µs (median per call)",
                flush=True,
            )
    summary: dict[str, Any] = {}
    for label in trees:
        summary[label] = {
            s: statistics.median(x[s]["median_us"] for x in runs[label]) for s in ("step-api", "all")
        }
        print(
            f"{label:9s}: step-api {summary[label]['step-api']:7.1f} µs, all {summary[label]['all']:7.1f} µs "
            f"(median of {args.rounds} children)"
        )
    if "against" in trees:
        ratios = {s: summary["this tree"][s] / summary["against"][s] for s in ("step-api", "all")}
        summary["ratio_this_over_against"] = ratios
        print(f"this tree / against: step-api {ratios['step-api']:.3f}, all {ratios['all']:.3f}")
    record = {"bench": "live_figures", "devices": args.devices, "calls": args.calls, **summary}
    print("BENCH_JSON " + json.dumps(record))


if __name__ == "__main__":
    main()
