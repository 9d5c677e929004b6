"""What live export (telemetry.export=prometheus) costs the telemetry process: on against off.

Run:  .venv/bin/python bench/bench_export.py [--seconds 8] [--rounds 2]

Part a, side by side: telemetry sessions (synthetic backend, sampler ``process``, 100 Hz) with
step windows every 50 ms, one with ``telemetry.export=off`` and one with ``prometheus`` scraped
``--scrape-hz`` times a second over HTTP (and one scraped 10 times a second), interleaved in
rounds. Measured: the telemetry process's CPU time (utime + stime of /proc/<pid>/stat) per
second of run, and its ratio to ``off``; the exporter's own update CPU time
(``charllm_exporter_update_seconds_total``) per second, per sample and per step.

Part b, in this process: the code the telemetry process runs per collector tick and per
scrape, timed alone: ``ExportState.take_samples`` on chunks of 10 rows (0.1 s at 100 Hz) for
1 and 8 devices (µs per sample), ``render`` (µs per scrape), a step's ``take_step``. Part c:
prometheus_client (when installed) rendering the same number of series, for the question
whether it is needed at all.

The training thread is not measured: export adds nothing there (one ``publish_step_rates``
call at setup; the step windows and samples it reads are those the collector takes anyway).
The last line is ``BENCH_JSON {...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from charllm_nemo.telemetry.config import Placement, TelemetryConfig, open_session
from charllm_nemo.telemetry.export.names import DEVICE_FAMILIES, THROTTLE_FAMILIES
from charllm_nemo.telemetry.export.state import ExportState

TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scraped(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return float("nan")


def one_arm(arm: str, seconds: float, scrape_hz: float, ask: bool) -> dict[str, float]:
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TelemetryConfig(
            backend="synthetic",
            sampler="process",
            out_dir=str(Path(tmp) / "run"),
            export="off" if arm == "off" else "prometheus",
            export_port=port,
        )
        session = open_session(cfg, Placement())
        session.publish_step_rates(4096.0, 1e12, 1e14)
        pid = session.engine.pid
        stop = threading.Event()
        scrapes = [0]

        def scraper() -> None:
            while not stop.wait(1.0 / scrape_hz):
                _scraped(port, "charllm_step")
                scrapes[0] += 1

        thread = threading.Thread(target=scraper, daemon=True)
        time.sleep(1.0)  # past the start-up
        c0, t0 = _cpu_s(pid), time.monotonic()
        if arm != "off":
            thread.start()
        step = 0
        while time.monotonic() - t0 < seconds:
            b = time.monotonic_ns()
            time.sleep(0.05)
            e = time.monotonic_ns()
            session.windows.record("step", None, b, e, step=step)
            if ask:  # as StepTelemetry does at a step's end (every arm alike)
                session.request_figures(b, e, None)
            step += 1
        wall = time.monotonic() - t0
        cpu = _cpu_s(pid) - c0
        update = _scraped(port, "charllm_exporter_update_seconds_total") if arm != "off" else 0.0
        stop.set()
        if thread.is_alive():
            thread.join(5)
        session.close()
    return {
        "cpu_per_s": cpu / wall,
        "update_per_s": update / wall,
        "steps": step,
        "scrapes": scrapes[0],
        "wall": wall,
    }


ARMS: dict[str, tuple[str, float, bool]] = {
    # name: (telemetry.export, scrapes per second, the loop asks each step's figures)
    "off": ("off", 1.0, True),
    "prometheus@1Hz": ("prometheus", 1.0, True),
    "prometheus@10Hz": ("prometheus", 10.0, True),
    "off, no requests": ("off", 1.0, False),
    "prometheus@1Hz, no requests": ("prometheus", 1.0, False),
}


def part_a(seconds: float, rounds: int) -> dict[str, Any]:
    got: dict[str, list[dict[str, float]]] = {k: [] for k in ARMS}
    for _ in range(rounds):
        for name, (arm, hz, ask) in ARMS.items():
            got[name].append(one_arm(arm, seconds, hz, ask))
    out: dict[str, Any] = {}
    print(f"part a: telemetry process CPU per second of run (100 Hz, a step every 50 ms), median of {rounds}")
    for name, runs in got.items():
        base_name = "off" if "no requests" not in name else "off, no requests"
        base = statistics.median(r["cpu_per_s"] for r in got[base_name])
        cpu = statistics.median(r["cpu_per_s"] for r in runs)
        upd = statistics.median(r["update_per_s"] for r in runs)
        steps_per_s = statistics.median(r["steps"] / r["wall"] for r in runs)
        out[name] = {
            "cpu_ms_per_s": cpu * 1e3,
            "ratio_to_off": cpu / base if base else float("nan"),
            "update_ms_per_s": upd * 1e3,
            "steps_per_s": steps_per_s,
        }
        print(
            f"  {name:28s} {cpu * 1e3:7.2f} ms/s  x{cpu / base:5.2f} of {base_name!r}"
            f"  exporter updates {upd * 1e3:6.3f} ms/s"
        )
    return out


def _chunk(n_rows: int, n_dev: int, t0: int) -> dict[str, np.ndarray[Any, Any]]:
    n = n_rows * n_dev
    cols: dict[str, np.ndarray[Any, Any]] = {
        "t_mono_ns": np.repeat(np.arange(t0, t0 + n_rows * 10_000_000, 10_000_000, dtype=np.int64), n_dev),
        "device_index": np.tile(np.arange(n_dev, dtype=np.int16), n_rows),
        "throttle_reasons": np.full(n, 4, np.int64),
    }
    for fam in DEVICE_FAMILIES:
        if fam.source not in cols:
            cols[fam.source] = (
                np.full(n, 1000, np.int64)
                if fam.source.endswith(("_mj", "_ns", "_bytes"))
                else np.random.rand(n)
            )
    return cols


def _time(fn: Any, n: int) -> float:
    t = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t) / n / 1e3


def _part_b_one(n_dev: int) -> dict[str, Any]:
    st = ExportState([(i, f"GPU-{i}", "H100") for i in range(n_dev)], {"run": "r", "dl_rank": 0}, "host")
    st.set_parallel({"pp_stage": 0, "tp_rank": 0, "dp_rank": 0})
    chunks = [_chunk(10, n_dev, k * 100_000_000) for k in range(200)]
    it = iter(chunks * 10)
    take = _time(lambda: st.take_samples(next(it)), 2000)
    fig = {"energy_j": 1.0, "power_avg_w": 1.0, "throttle_any_limiting_s": 0.0}
    step = _time(lambda: st.take_step(1, 0.1, dict.fromkeys(range(n_dev), fig), (1.0, 1.0, 1.0)), 2000)
    render = _time(lambda: st.render(), 500)
    size = len(st.render())
    print(
        f"  {n_dev} device(s): take_samples {take:6.1f} us per 10-row chunk "
        f"({take / (10 * n_dev):5.2f} us per sample row)  take_step {step:5.1f}"
        f"  render {render:7.1f} us ({size} bytes)"
    )
    return {
        "take_us_per_chunk": take,
        "take_us_per_sample": take / (10 * n_dev),
        "step_us": step,
        "render_us": render,
        "bytes": size,
    }


def part_b() -> dict[str, Any]:
    out: dict[str, Any] = {}
    print("part b: the exporter's code alone (us)")
    for n_dev in (1, 8):
        out[f"{n_dev}dev"] = _part_b_one(n_dev)
    return out


def part_c() -> dict[str, Any]:
    try:
        import prometheus_client as pc
    except ImportError:
        print(
            "part c: prometheus_client is not installed: nothing to compare (the exporter does not need it)"
        )
        return {}
    reg = pc.CollectorRegistry()
    labels = ["gpu", "UUID", "modelName", "Hostname", "run", "dl_rank", "pp_stage", "tp_rank", "dp_rank"]
    gauges = [pc.Gauge(f.name, f.help, labels, registry=reg) for f in (*DEVICE_FAMILIES, *THROTTLE_FAMILIES)]
    for g in gauges:
        for i in range(8):
            g.labels(str(i), f"GPU-{i}", "H100", "host", "r", "0", "0", "0", "0").set(1.0)
    us = _time(lambda: pc.generate_latest(reg), 500)
    print(f"part c: prometheus_client generate_latest, the same device series of 8 devices: {us:7.1f} us")
    return {"prometheus_client_render_us_8dev": us}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    result = {"a": part_a(args.seconds, args.rounds), "b": part_b(), "c": part_c()}
    print("BENCH_JSON " + json.dumps(result))


if __name__ == "__main__":
    main()
