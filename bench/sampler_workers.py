"""Child-process workers of bench/bench_sampler.py, parts a and b, and the helpers all parts share.

Each worker runs in a process whose environment loads the stand-in libnvidia-ml.so.1 (the parent
sets LD_LIBRARY_PATH and FAKE_NVML_SCRIPT), prints ``RESULT {json}`` and exits. Top-level imports
are standard library only: Zeus's spawned helpers re-import the main module (bench_sampler.py),
which imports this one, and must not pay for numpy, pyarrow or the package.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ZEUS_STATS_ENV = "CHARLLM_BENCH_ZEUS_STATS_DIR"
CALL_DELAY_US = 20
# Everything except instant power made unsupported: our backend then reads one field per sample,
# exactly what one Zeus "device_instant" poll reads (like-for-like).
POWER_ONLY_LINES = [
    f"0 {q} NOT_SUPPORTED"
    for q in (
        "power_average_mw",
        "power_memory_mw",
        "energy_mj",
        "temp_gpu_c",
        "temp_gpu_max_c",
        "temp_memory_c",
        "clock_sm_mhz",
        "clock_mem_mhz",
        "clocks_event_reasons",
        "violation_power_ns",
        "violation_thermal_ns",
        "util_gpu_pct",
        "util_mem_pct",
        "mem_used_bytes",
        "power_limit_mw",
        "pcie_tx_bytes",
        "pcie_rx_bytes",
        "nvlink_tx_kib",
        "nvlink_rx_kib",
    )
]


# ============================================================================================
# helpers usable in any process (standard library only)
# ============================================================================================


def schedstat_ns(pid: int, tid: int | None = None) -> int:
    """CPU time (ns, user + system) of a process or one of its threads, from /proc schedstat."""
    path = f"/proc/{pid}/schedstat" if tid is None else f"/proc/{pid}/task/{tid}/schedstat"
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def descendants(pid: int) -> list[int]:
    """All live descendant PIDs of ``pid`` (scans /proc; Zeus's helpers and its resource tracker)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def machine_busy_ns() -> tuple[int, int]:
    """(CPU busy ns summed over every core, steal ns) since boot, from /proc/stat."""
    tick = 1e9 / os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return int((user + nice + system + irq + softirq) * tick), int(steal * tick)


def stub_handle() -> Any:
    """The stand-in library loaded in this process (by soname, as pynvml loads it)."""
    import ctypes

    lib = ctypes.CDLL("libnvidia-ml.so.1")
    lib.fake_nvml_command.argtypes = [ctypes.c_char_p]
    lib.fake_nvml_command.restype = ctypes.c_int
    lib.fake_nvml_call_count.argtypes = [ctypes.c_char_p]
    lib.fake_nvml_call_count.restype = ctypes.c_ulonglong
    return lib


def emit(tag: str, payload: dict[str, Any]) -> None:
    sys.stdout.write(f"{tag} {json.dumps(payload)}\n")
    sys.stdout.flush()


def wait_line(expected: str) -> None:
    for line in sys.stdin:
        if line.strip() == expected:
            return
    raise SystemExit(f"parent closed stdin before {expected}")


# ============================================================================================
# worker a: sampler cost per sample vs the raw read, and the flusher's per-row cost
# ============================================================================================


def worker_cost(opts: dict[str, Any]) -> None:
    from charllm_nemo.devices.factory import open_backend
    from charllm_nemo.telemetry.sampler import Sampler, rows_to_table
    from charllm_nemo.telemetry.store import RankStore

    class TimedSampler(Sampler):
        """Measures its own thread's CPU time around the whole sampling loop."""

        cpu_ns = 0

        def _run(self) -> None:
            t = time.thread_time_ns()
            try:
                super()._run()
            finally:
                self.cpu_ns = time.thread_time_ns() - t

    def periodic_thread(hz: int, seconds: float, read: Any) -> tuple[int, int]:
        """The simplest periodic loop a sampler could be: (read,) sleep to the next deadline.
        Returns (iterations, thread CPU ns). ``read=None``: wake-ups only (the platform's floor)."""
        result = [0, 0]

        def loop() -> None:
            c = time.thread_time_ns()
            period, mono, sleep = 1.0 / hz, time.monotonic, time.sleep
            keep: list[Any] = []
            nxt = mono()
            end = nxt + seconds
            n = 0
            while nxt < end:
                if read is not None:
                    keep.append(read())
                n += 1
                nxt += period
                wait = nxt - mono()
                if wait > 0:
                    sleep(wait)
            result[0], result[1] = n, time.thread_time_ns() - c

        t = threading.Thread(target=loop)
        t.start()
        t.join()
        return result[0], result[1]

    lib = stub_handle()
    backend = open_backend("nvml")
    dev = backend.devices[0]
    configs = [(CALL_DELAY_US, 1000), (0, 1000), (CALL_DELAY_US, 100)]
    acc = {
        f"{d}us@{hz}Hz": {
            "sampler_cpu_ns": 0,
            "samples": 0,
            "read_wall_ns": 0,
            "raw_cpu_ns": 0,
            "raw_reads": 0,
            "raw_wall_ns": 0,
            "minimal_cpu_ns": 0,
            "minimal_n": 0,
            "wake_cpu_ns": 0,
            "wake_n": 0,
        }
        for d, hz in configs
    }
    rows_kept: list[Any] = []
    for r in range(opts["rounds"]):
        for delay, hz in configs:
            key = f"{delay}us@{hz}Hz"
            a = acc[key]
            if lib.fake_nvml_command(f"* call_delay_us {delay}".encode()) != 0:
                raise RuntimeError("stand-in rejected call_delay_us")

            def sampler_phase(a: dict[str, int] = a, hz: int = hz, delay: int = delay) -> int:
                s = TimedSampler([dev], hz=hz, source="nvml")
                s.start()
                time.sleep(opts["phase_s"])
                s.stop()
                rows = s.take_rows()
                if delay == CALL_DELAY_US and hz == 1000 and len(rows_kept) < 2000:
                    rows_kept.extend(rows)
                a["sampler_cpu_ns"] += s.cpu_ns
                a["samples"] += s.health.samples
                a["read_wall_ns"] += s.health.read_ns_total
                return s.health.samples

            def raw_phase(n: int, a: dict[str, int] = a) -> None:
                read = dev.read
                w = time.perf_counter_ns()
                c = time.thread_time_ns()
                for _ in range(n):
                    read()
                a["raw_cpu_ns"] += time.thread_time_ns() - c
                a["raw_wall_ns"] += time.perf_counter_ns() - w
                a["raw_reads"] += n

            def minimal_phase(a: dict[str, int] = a, hz: int = hz) -> None:
                n, c = periodic_thread(hz, opts["phase_s"] / 2, dev.read)
                a["minimal_n"] += n
                a["minimal_cpu_ns"] += c
                n, c = periodic_thread(hz, opts["phase_s"] / 2, None)
                a["wake_n"] += n
                a["wake_cpu_ns"] += c

            # Alternate the order, so a drift in machine load hits every phase alike.
            if r % 2 == 0:
                n = sampler_phase()
                raw_phase(max(n, 100))
                minimal_phase()
            else:
                minimal_phase()
                raw_phase(max(int(hz * opts["phase_s"]), 100))
                sampler_phase()
    out: dict[str, Any] = {}
    for key, a in acc.items():
        per_sample = a["sampler_cpu_ns"] / max(a["samples"], 1)
        per_raw = a["raw_cpu_ns"] / max(a["raw_reads"], 1)
        out[key] = {
            "samples": a["samples"],
            "sampler_cpu_us_per_sample": per_sample / 1e3,
            "raw_cpu_us_per_read": per_raw / 1e3,
            "ratio": per_sample / per_raw,
            "read_wall_us_in_sampler": a["read_wall_ns"] / max(a["samples"], 1) / 1e3,
            "raw_wall_us_per_read": a["raw_wall_ns"] / max(a["raw_reads"], 1) / 1e3,
            "minimal_loop_cpu_us_per_sample": a["minimal_cpu_ns"] / max(a["minimal_n"], 1) / 1e3,
            "bare_wakeup_cpu_us": a["wake_cpu_ns"] / max(a["wake_n"], 1) / 1e3,
        }
        o = out[key]
        o["sampler_over_minimal_loop"] = o["sampler_cpu_us_per_sample"] / o["minimal_loop_cpu_us_per_sample"]
        o["minimal_loop_over_raw"] = o["minimal_loop_cpu_us_per_sample"] / o["raw_cpu_us_per_read"]

    # The flusher's work per row: rows -> Arrow table -> Parquet segment (atomic write), at the
    # batch sizes a 0.5 s flush interval gives at 100 Hz (50 rows) and 1 kHz (500 rows).
    flush: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-flush-") as tmp:
        store = RankStore(tmp, 0, {"kind": "bench"})
        for batch in (50, 500):
            reps = max(2, opts["flush_rows"] // batch)
            conv_ns = write_ns = rows_done = 0
            for i in range(reps):
                start = (i * batch) % max(len(rows_kept) - batch, 1)
                rows = rows_kept[start : start + batch]
                c0 = time.thread_time_ns()
                table = rows_to_table(rows, "nvml")
                c1 = time.thread_time_ns()
                store.write_segment("samples", table)
                c2 = time.thread_time_ns()
                conv_ns += c1 - c0
                write_ns += c2 - c1
                rows_done += len(rows)
            flush[str(batch)] = {
                "rows": rows_done,
                "convert_us_per_row": conv_ns / rows_done / 1e3,
                "write_us_per_row": write_ns / rows_done / 1e3,
                "total_us_per_row": (conv_ns + write_ns) / rows_done / 1e3,
            }
    backend.close()
    emit("RESULT", {"configs": out, "flush": flush})


# ============================================================================================
# worker b: deadlines with a busy main thread; a spinner process makes "both cores busy"
# ============================================================================================


def make_workload(kind: str) -> tuple[Any, str]:
    """A callable doing one unit of training-like work on the main thread, and its label."""
    pc = time.perf_counter
    if kind == "torch":
        import torch

        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, y = torch.randn(64, 256), torch.randn(64, 256)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()

        return step, "torch MLP 256-1024-256 train step, batch 64, 1 thread"

    import numpy as np

    a = np.random.default_rng(0).random((160, 160))
    b = np.random.default_rng(1).random((160, 160))

    def mix() -> None:
        end = pc() + 0.002  # 2 ms of BLAS (releases the GIL)
        while pc() < end:
            a @ b
        end = pc() + 0.002  # 2 ms of pure Python (holds the GIL)
        x = 0
        while pc() < end:
            for i in range(200):
                x += i * i

    return mix, "2 ms numpy matmul (1 BLAS thread) + 2 ms pure Python, alternating"


def worker_deadlines(opts: dict[str, Any]) -> None:
    from charllm_nemo.devices.factory import open_backend
    from charllm_nemo.telemetry.sampler import Sampler
    from charllm_nemo.telemetry.session import TelemetrySession
    from charllm_nemo.telemetry.session_options import SessionOptions

    work, label = make_workload(opts["workload"])
    backend = open_backend("nvml")
    devices = backend.devices
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.kill(spinner.pid, signal.SIGSTOP)
    extra = opts.get("extra", [])
    conds: list[tuple[int, bool, str]] = [
        (hz, busy, "thread") for hz in (100, 1000) for busy in (False, True)
    ]
    conds += [(int(hz), busy == "busy", mode) for hz, busy, mode in extra]
    keys = [f"{mode}@{hz}Hz/{'both-busy' if busy else 'core-free'}" for hz, busy, mode in conds]
    segments: dict[str, list[dict[str, Any]]] = {k: [] for k in keys}
    me = os.getpid()
    startups: list[float] = []

    def ours_ns(extra_pid: int | None) -> int:
        pids = [me, spinner.pid] + ([extra_pid] if extra_pid else [])
        return sum(schedstat_ns(p) for p in pids)

    t_end = time.perf_counter() + 0.3
    while time.perf_counter() < t_end:  # warm up the workload (first BLAS / torch calls)
        work()
    old_switch = sys.getswitchinterval()
    run_root = tempfile.mkdtemp(prefix="charllm-bench-deadlines-")
    try:
        for _ in range(opts["rounds"]):
            for (hz, busy, mode), key in zip(conds, keys, strict=True):
                os.kill(spinner.pid, signal.SIGCONT if busy else signal.SIGSTOP)
                s: Any
                session: TelemetrySession | None = None
                if mode == "process":
                    # What a session samples with (telemetry.sampler=auto): its telemetry process
                    # opens the NVML backend itself (on the stand-in: it inherits LD_LIBRARY_PATH
                    # and FAKE_NVML_SCRIPT), and its collector thread stores the rank's segments
                    # beside the sampling loop. start() returns once it samples, before this
                    # segment's clock starts.
                    session = TelemetrySession(
                        Path(run_root) / f"seg-{len(startups)}",
                        SessionOptions(backend="nvml", hz=hz, sampler="process"),
                        handle_signals=False,
                    ).start()
                    s = session.sampler
                    startups.append(s.health.startup_ns / 1e9)
                else:
                    if mode == "thread-switch200us":
                        sys.setswitchinterval(0.0002)
                    s = Sampler(devices, hz=hz, source="nvml")
                    s.start()
                extra_pid = s.pid if session is not None else None
                busy0, steal0 = machine_busy_ns()
                mine0 = ours_ns(extra_pid)
                t0 = time.perf_counter()
                units = 0
                while time.perf_counter() - t0 < opts["segment_s"]:
                    work()
                    units += 1
                elapsed = time.perf_counter() - t0
                busy1, steal1 = machine_busy_ns()
                mine1 = ours_ns(extra_pid)
                if session is not None:
                    session.close()  # the telemetry process flushes its last segment and exits
                else:
                    s.stop()
                    s.take_rows()
                h = s.health.to_dict()
                sys.setswitchinterval(old_switch)
                segments[key].append(
                    {
                        "slots": h["slots"],
                        "on_time": h["on_time"],
                        "missed": h["deadlines_missed"],
                        "late_max_ns": h["late_max_ns"],
                        "samples": h["samples"],
                        "read_ns": h["read_ns_total"],
                        "units": units,
                        "seconds": elapsed,
                        "background_ns": max(0, (busy1 - busy0) - (mine1 - mine0)),
                        "steal_ns": steal1 - steal0,
                    }
                )
    finally:
        spinner.kill()
        spinner.wait()
        backend.close()
        shutil.rmtree(run_root, ignore_errors=True)
    out: dict[str, Any] = {}
    for key, segs in segments.items():
        out[key] = summarize_segments(segs)
        quiet = [g for g in segs if g["background_ns"] / 1e9 / g["seconds"] < QUIET_CORES]
        out[key]["quiet"] = summarize_segments(quiet) if quiet else None
    emit(
        "RESULT",
        {
            "workload": label,
            "conditions": out,
            "switch_interval_s": old_switch,
            "process_startup_s": sorted(startups),
        },
    )


QUIET_CORES = 0.25  # a segment counts as quiet when other processes used less than this


def summarize_segments(segs: list[dict[str, Any]]) -> dict[str, Any]:
    a = {k: sum(g[k] for g in segs) for k in segs[0] if k != "late_max_ns"}
    seconds = a["seconds"] or 1e-9
    return {
        "deadline_ratio": a["on_time"] / a["slots"] if a["slots"] else 1.0,
        "deadlines_missed": a["missed"],
        "slots": a["slots"],
        "samples": a["samples"],
        "late_max_ms": max(g["late_max_ns"] for g in segs) / 1e6,
        "read_us_mean": a["read_ns"] / max(a["samples"], 1) / 1e3,
        "work_units_per_s": a["units"] / seconds,
        "seconds": a["seconds"],
        "segments": len(segs),
        "background_cores": a["background_ns"] / 1e9 / seconds,
        "steal_cores": a["steal_ns"] / 1e9 / seconds,
    }
