"""Child-process workers of bench/bench_sampler.py, part c: Zeus's PowerMonitor and our session.

Standard-library imports only at the top (see sampler_workers.py); Zeus and the package are
imported inside the workers, whose start-up time they are part of.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sampler_workers import ZEUS_STATS_ENV, descendants, emit, schedstat_ns, stub_handle, wait_line

# ============================================================================================
# worker c1: Zeus PowerMonitor
# ============================================================================================


def install_zeus_hook() -> None:
    """Called in a Zeus polling helper (spawned; it re-imports bench_sampler.py as __mp_main__).

    Wraps Zeus's target function (the polling loop itself is untouched): on SIGUSR1, which the
    worker sends at the start and the end of the measured window, it notes the stand-in's own
    count of NVML power reads (two C calls, in a signal handler between bytecodes); when the
    loop ends it writes those marks, the total and its CPU time to a JSON file."""
    import zeus.monitor.power as zp

    original = zp._domain_polling_process

    def polls() -> int:
        lib = stub_handle()
        names = (b"nvmlDeviceGetFieldValues", b"nvmlDeviceGetPowerUsage")
        return sum(int(lib.fake_nvml_call_count(n)) for n in names)

    def polling_with_stats(**kwargs: Any) -> None:
        t0 = time.time()
        marks: list[tuple[float, int]] = []
        signal.signal(signal.SIGUSR1, lambda *_: marks.append((time.time(), polls())))
        try:
            original(**kwargs)
        finally:
            info = {
                "pid": os.getpid(),
                "domain": kwargs["power_domain"].value,
                "polls": polls(),
                "marks": marks,
                "t_start_wall": t0,
                "t_end_wall": time.time(),
                "cpu_ns": time.process_time_ns(),
            }
            path = Path(os.environ[ZEUS_STATS_ENV]) / f"helper-{os.getpid()}.json"
            path.write_text(json.dumps(info))

    zp._domain_polling_process = polling_with_stats


def _mark_helpers(mon: Any) -> None:
    for proc in mon.processes.values():
        if proc.pid is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGUSR1)


def _children_cpu_ns() -> tuple[int, int]:
    pids = descendants(os.getpid())
    return sum(schedstat_ns(p) for p in pids), len(pids)


def worker_zeus(opts: dict[str, Any]) -> None:
    t0_wall = time.perf_counter()
    t0_cpu = time.process_time_ns()
    from zeus.monitor.power import PowerMonitor  # imports sklearn, pydantic, ...

    t_import = time.perf_counter() - t0_wall
    kwargs: dict[str, Any] = {"gpu_indices": [0], "update_period": opts["update_period"]}
    if opts["domains"] != "all":
        kwargs["power_domains"] = opts["domains"].split(",")
    mon = PowerMonitor(**kwargs)
    t_ctor = time.perf_counter() - t0_wall
    while mon.get_power() is None:
        time.sleep(0.001)
    t_first = time.perf_counter() - t0_wall
    kids_cpu, n_kids = _children_cpu_ns()
    startup = {
        "import_s": t_import,
        "ctor_s": t_ctor,
        "first_sample_wall_s": t_first,
        "first_sample_cpu_s": (time.process_time_ns() - t0_cpu + kids_cpu) / 1e9,
        "own_cpu_s": (time.process_time_ns() - t0_cpu) / 1e9,
        "helpers_cpu_s": kids_cpu / 1e9,
        "processes": n_kids,
        "update_period": mon.update_period,
        "domains": [d.value for d in mon.measurement_domains],
    }
    emit("READY", startup)
    wait_line("GO")
    w0, own0 = time.time(), time.process_time_ns()
    kids0, _ = _children_cpu_ns()
    _mark_helpers(mon)
    # Drain Zeus's queue every 0.25 s as a user of get_power()/get_energy() would; otherwise the
    # helpers' queue feeder blocks on a full pipe and stops pickling (an artificially cheap run).
    while not select.select([sys.stdin], [], [], 0.25)[0]:
        mon.get_power()
    sys.stdin.readline()  # STOP
    _mark_helpers(mon)
    w1, own1 = time.time(), time.process_time_ns()
    kids1, _ = _children_cpu_ns()
    timelines = mon.get_all_power_timelines(start_time=w0, end_time=w1)
    delivered = {dom: sum(len(tl) for tl in per_gpu.values()) for dom, per_gpu in timelines.items()}
    total_delivered = {
        dom: sum(len(tl) for tl in per_gpu.values()) for dom, per_gpu in mon.get_all_power_timelines().items()
    }
    mon.stop()
    helpers = []
    stats_dir = Path(os.environ[ZEUS_STATS_ENV])
    for f in stats_dir.glob("helper-*.json"):
        helpers.append(json.loads(f.read_text()))
    window = w1 - w0
    polls_in_window = 0
    for h in helpers:
        h["delivered_total"] = total_delivered.get(h["domain"], 0)
        if len(h["marks"]) < 2:  # the helper did not see both marks (it died?): no poll figure
            h["polls_in_window"] = h["polls_per_s"] = None
            continue
        (ta, na), (tb, nb) = h["marks"][0], h["marks"][-1]
        h["polls_in_window"] = nb - na
        h["polls_per_s"] = (nb - na) / max(tb - ta, 1e-9)
        polls_in_window += nb - na
    emit(
        "RESULT",
        {
            "startup": startup,
            "window_s": window,
            "helpers_cpu_ns": kids1 - kids0,
            "own_cpu_ns": own1 - own0,
            "delivered": delivered,
            "polls_in_window": polls_in_window,
            "helpers": helpers,
        },
    )


# ============================================================================================
# worker c2: our telemetry session (sampler + flusher + Parquet store) on the same stand-in
# ============================================================================================


def worker_ours(opts: dict[str, Any]) -> None:
    t0_wall = time.perf_counter()
    t0_cpu = time.process_time_ns()
    from charllm_nemo.telemetry.session import TelemetrySession
    from charllm_nemo.telemetry.session_options import SessionOptions

    t_import = time.perf_counter() - t0_wall
    with tempfile.TemporaryDirectory(prefix="bench-ours-") as tmp:
        sess = TelemetrySession(tmp, SessionOptions(backend="nvml", hz=opts["hz"]), handle_signals=False)
        sess.start()
        while sess.sampler.health.samples < 1:
            time.sleep(0.0005)
        t_first = time.perf_counter() - t0_wall
        startup = {
            "import_s": t_import,
            "first_sample_wall_s": t_first,
            "first_sample_cpu_s": (time.process_time_ns() - t0_cpu) / 1e9,
            "metrics_supported": sum(sess.backend.devices[0].supported_metrics().values()),
        }
        emit("READY", startup)
        pid = os.getpid()
        sampler_tid = getattr(sess.sampler._thread, "native_id", None)
        flusher_tid = getattr(sess.engine.flusher._thread, "native_id", None)
        wait_line("GO")
        own0, n0 = time.process_time_ns(), sess.sampler.health.samples
        s0, f0 = schedstat_ns(pid, sampler_tid), schedstat_ns(pid, flusher_tid)
        w0 = time.perf_counter()
        wait_line("STOP")
        own1, n1 = time.process_time_ns(), sess.sampler.health.samples
        s1, f1 = schedstat_ns(pid, sampler_tid), schedstat_ns(pid, flusher_tid)
        w1 = time.perf_counter()
        sess.close()
        health = sess.sampler.health.to_dict()
    emit(
        "RESULT",
        {
            "startup": startup,
            "window_s": w1 - w0,
            "samples": n1 - n0,
            "process_cpu_ns": own1 - own0,
            "sampler_cpu_ns": s1 - s0,
            "flusher_cpu_ns": f1 - f0,
            "deadline_ratio": health["deadline_ratio"],
        },
    )
