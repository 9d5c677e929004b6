"""bench_train_telemetry.py's statistics (ratios, bootstrap and t intervals over ABBA units),
its records' pooling across runs, and its CPU and scheduler accounting (/proc): plain
functions over the timings the worker takes."""

from __future__ import annotations

import os
import random
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from train_telemetry_consts import MIN_QUIET_ROUNDS, QUIET_CORES, TARGET_FREE, TIMINGS, TRIM


class BenchRefused(Exception):
    """The worker cannot measure what was asked (the message says why); no traceback."""


# ============================================================================================
# statistics (standard library only)
# ============================================================================================


def trimmed_mean(xs: list[float], trim: float = TRIM) -> float:
    s = sorted(xs)
    k = int(len(s) * trim)
    core = s[k : len(s) - k] if len(s) > 2 * k else s
    return sum(core) / len(core)


def pooled_ratio(pairs: list[tuple[list[float], list[float]]], stat: Any) -> float:
    on = [x for p in pairs for x in p[0]]
    off = [x for p in pairs for x in p[1]]
    return float(stat(on) / stat(off))


def bootstrap_ci(
    pairs: list[tuple[list[float], list[float]]], stat: Any, n: int = 1000, seed: int = 7
) -> tuple[float, float]:
    """95 % percentile interval of the ON/OFF ratio of ``stat``, resampling whole pairs."""
    rng = random.Random(seed)
    vals = []
    for _ in range(n):
        sample = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        vals.append(pooled_ratio(sample, stat))
    vals.sort()
    return vals[int(0.025 * n)], vals[int(0.975 * n) - 1]


def paired_ratio(pairs: list[tuple[list[float], list[float]]]) -> tuple[float, float, float]:
    """Mean of per-pair ratios of block medians, with a 95 % t interval."""
    rs = [statistics.median(on) / statistics.median(off) for on, off in pairs]
    m = statistics.fmean(rs)
    if len(rs) < 2:
        return m, m, m
    half = 1.96 * statistics.stdev(rs) / len(rs) ** 0.5
    return m, m - half, m + half


def t975(df: int) -> float:
    """Two-sided 95 % quantile of Student's t with ``df`` degrees of freedom (Cornish-Fisher
    expansion around the normal one: within 0.2 % from df = 5 on)."""
    z = 1.959964
    if df <= 0:
        return float("inf")
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def summarize_units(units: list[tuple[list[float], list[float]]]) -> dict[str, Any]:
    """--interleave step: ``units`` are ABBA quads (2 ON + 2 OFF steps) or adjacent pairs.
    Ratios of the pooled medians and trimmed means with 95 % bootstrap intervals resampling whole
    units, and the geometric mean of the per-unit ratios (mean log ON - mean log OFF of each
    unit, exponentiated) with a 95 % t interval over units."""
    import math

    on = [x for u in units for x in u[0]]
    off = [x for u in units for x in u[1]]
    med_lo, med_hi = bootstrap_ci(units, statistics.median)
    tm_lo, tm_hi = bootstrap_ci(units, trimmed_mean)
    logs = [
        statistics.fmean(math.log(x) for x in u[0]) - statistics.fmean(math.log(x) for x in u[1])
        for u in units
    ]
    m = statistics.fmean(logs)
    half = t975(len(logs) - 1) * statistics.stdev(logs) / len(logs) ** 0.5 if len(logs) > 1 else 0.0
    # What ON adds to a step in absolute terms: per unit, mean ON minus mean OFF; and the step
    # length at which a cost that size would be the target's share (TARGET_FREE - 1).
    diffs = [statistics.fmean(u[0]) - statistics.fmean(u[1]) for u in units]
    d = statistics.fmean(diffs)
    d_half = t975(len(diffs) - 1) * statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0
    share = TARGET_FREE - 1.0
    return {
        "added_ms": d * 1e3,
        "added_ms_ci95": [(d - d_half) * 1e3, (d + d_half) * 1e3],
        # Steps at least this long would keep a fixed cost of added_ms (its upper bound) within
        # the target; None when it is not above zero.
        "target_step_ms": d * 1e3 / share if d > 0 else None,
        "target_step_ms_upper": (d + d_half) * 1e3 / share if d + d_half > 0 else None,
        "steps_on": len(on),
        "steps_off": len(off),
        "median_on_ms": statistics.median(on) * 1e3,
        "median_off_ms": statistics.median(off) * 1e3,
        "ratio_median": pooled_ratio(units, statistics.median),
        "ratio_median_ci95": [med_lo, med_hi],
        "ratio_trimmed_mean": pooled_ratio(units, trimmed_mean),
        "ratio_trimmed_mean_ci95": [tm_lo, tm_hi],
        "ratio_paired_mean": math.exp(m),
        "ratio_paired_mean_ci95": [math.exp(m - half), math.exp(m + half)],
        "units": len(units),
    }


Record = tuple[int, str, bool, Sequence[float]]


def step_units(records: list[Record], which: int, keep: Any = None) -> list[tuple[list[float], list[float]]]:
    """Timing ``which`` (an index into TIMINGS) of timed steps ``records`` ((unit, arm, right
    after a switch, [iteration, loop_step, main_cpu] s)) as (ON, OFF) per unit, in unit order:
    every unit with both arms for which ``keep(unit)`` is true (None: all)."""
    by_unit: dict[int, tuple[list[float], list[float]]] = {}
    for u, arm, _sw, t in records:
        if keep is None or keep(u):
            by_unit.setdefault(u, ([], []))[0 if arm == "on" else 1].append(t[which])
    return [pair for _u, pair in sorted(by_unit.items()) if pair[0] and pair[1]]


def step_stats(records: list[Record], background: list[float], segment_units: int) -> dict[str, Any]:
    """Step mode's statistics over timed steps ``records`` (see step_units): summarize_units per
    timing over every unit with both arms, the load of other processes per segment of
    ``segment_units`` units (``background``, cores), and the same over the quiet segments'
    units (None with fewer than MIN_QUIET_ROUNDS of them)."""
    quiet_segments = {i for i, bg in enumerate(background) if bg < QUIET_CORES}

    def quiet(u: int) -> bool:
        return u // segment_units in quiet_segments

    return {
        **{t: summarize_units(step_units(records, w)) for w, t in enumerate(TIMINGS)},
        "background_cores_mean": statistics.fmean(background),
        "background_cores_max": max(background),
        "quiet_rounds": len(quiet_segments),
        "quiet": (
            {"on": {t: summarize_units(step_units(records, w, quiet)) for w, t in enumerate(TIMINGS)}}
            if len(quiet_segments) >= MIN_QUIET_ROUNDS
            else None
        ),
    }


def check_dumps(dumps: list[tuple[str, dict[str, Any]]]) -> None:
    """Refuse (ValueError, naming the file and the field) a set of ``--dump-steps`` files
    (``dumps``: (file name, its JSON)) that cannot be pooled: none, one that is not a dump of
    this bench, or runs of different configurations, contrasts, model changes, orders or
    segment sizes."""
    if not dumps:
        raise ValueError("--pool needs at least one --dump-steps file")
    first_name, first = dumps[0]
    for name, d in dumps:
        if not isinstance(d, dict) or "steps" not in d or "background" not in d:
            raise ValueError(
                f"{name}: not a --dump-steps file of this bench (an object with 'steps' and "
                f"'background'; files written before 2026-12-04 hold the steps alone): run it again"
            )
        for k in ("config", "contrast", "model_overrides", "order", "unit_steps", "segment_units"):
            if d.get(k) != first.get(k):
                raise ValueError(
                    f"{name}: {k} is {d.get(k)!r} but {first_name} has {first.get(k)!r}; pool runs "
                    f"of one configuration only"
                )


def pool_dumps(dumps: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """``--pool``: the step-mode statistics of several runs' ``--dump-steps`` files taken as one
    run (``dumps``: (file name, its JSON)), each run's units and segments kept apart. A set
    :func:`check_dumps` refuses raises its ValueError."""
    check_dumps(dumps)
    first = dumps[0][1]
    records: list[Record] = []
    background: list[float] = []
    for _name, d in dumps:
        # Each run starts at a segment boundary of the pooled numbering: unit u of a run stays in
        # its own segment, u // segment_units, shifted by the segments before it.
        offset = len(background) * first["segment_units"]
        records.extend((offset + u, arm, sw, t) for u, arm, sw, t in d["steps"])
        background.extend(d["background"])
    stats = step_stats(records, background, first["segment_units"])
    return {
        "config": first["config"],
        "model_overrides": first["model_overrides"],
        "interleave": "step",
        "order": first["order"],
        "contrast": first["contrast"],
        "pairs": sum(1 for r in records if r[1] == "on"),
        "units": stats["iteration"]["units"],
        "unit_steps": first["unit_steps"],
        "segment_units": first["segment_units"],
        "segments": len(background),
        "runs": len(dumps),
        **stats,
    }


def summarize(pairs: list[tuple[list[float], list[float]]]) -> dict[str, Any]:
    on = [x for p in pairs for x in p[0]]
    off = [x for p in pairs for x in p[1]]
    med = pooled_ratio(pairs, statistics.median)
    med_lo, med_hi = bootstrap_ci(pairs, statistics.median)
    tm = pooled_ratio(pairs, trimmed_mean)
    tm_lo, tm_hi = bootstrap_ci(pairs, trimmed_mean)
    pm, pm_lo, pm_hi = paired_ratio(pairs)
    return {
        "steps_on": len(on),
        "steps_off": len(off),
        "median_on_ms": statistics.median(on) * 1e3,
        "median_off_ms": statistics.median(off) * 1e3,
        "ratio_median": med,
        "ratio_median_ci95": [med_lo, med_hi],
        "ratio_trimmed_mean": tm,
        "ratio_trimmed_mean_ci95": [tm_lo, tm_hi],
        "ratio_paired_mean": pm,
        "ratio_paired_mean_ci95": [pm_lo, pm_hi],
    }


# ============================================================================================
# the child: one model, interleaved ON / OFF blocks
# ============================================================================================


def machine_busy_ns() -> int:
    """CPU busy ns summed over every core since boot (/proc/stat; steal not counted)."""
    tick = 1e9 / os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return int((user + nice + system + irq + softirq) * tick)


def schedstat_ns(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def process_cpu_ns(pid: int) -> int:
    """CPU ns of every live thread of process ``pid`` (/proc/PID/task/*/schedstat)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    return sum(schedstat_ns(int(tid)) for tid in tids)


IN_END_STEP = "end_step: shipping the log"  # --time-calls: the part of end_step that writes the mark ring


def time_telemetry_calls(marker: Any, session: Any) -> dict[str, list[int]]:
    """--time-calls: wrap every telemetry call the ON steps make on the training thread (the step
    API's marker's begin_step / end_step and its timers' start / stop, the session's
    request_figures and step_figures) so that each call's perf_counter_ns duration is kept, in the
    step, with the caches as training leaves them. Returns the durations per call name. The
    wrappers cost a few hundred ns a call themselves, on ON steps only."""
    names = ("begin_step", "timer start", "timer stop", "end_step", "request_figures", "step_figures")
    calls: dict[str, list[int]] = {name: [] for name in names}

    def timed(fn: Any, into: list[int]) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                into.append(time.perf_counter_ns() - t)

        return wrapper

    marker.begin_step = timed(marker.begin_step, calls["begin_step"])
    marker.end_step = timed(marker.end_step, calls["end_step"])
    session.step_figures = timed(session.step_figures, calls["step_figures"])
    session.request_figures = timed(session.request_figures, calls["request_figures"])
    if session.windows.log_sink is not None:  # part of end_step (not counted twice in the total)
        calls[IN_END_STEP] = []
        session.windows.log_sink = timed(session.windows.log_sink, calls[IN_END_STEP])

    class TimedTimer:
        """A window's timer whose start and stop are timed."""

        def __init__(self, timer: Any) -> None:
            self.start = timed(timer.start, calls["timer start"])
            self.stop = timed(timer.stop, calls["timer stop"])

    new_timer = marker._new_timer

    def timed_new_timer(name: str) -> Any:  # timers that are not windows return at once: untimed
        timer = new_timer(name)
        if timer._phase is not None:
            timer = marker._timers[name] = TimedTimer(timer)
        return timer

    marker._new_timer = timed_new_timer
    for name, timer in list(marker._timers.items()):  # any made already
        if timer._phase is not None:
            marker._timers[name] = TimedTimer(timer)
    return calls


def calls_report(calls: dict[str, list[int]]) -> dict[str, Any]:
    """Per call: how many, median and mean µs, and µs per ON step; the total per ON step."""
    steps = max(1, len(calls["begin_step"]))
    out: dict[str, Any] = {}
    for name, ns in calls.items():
        if ns:
            out[name] = {
                "n": len(ns),
                "median_us": statistics.median(ns) / 1e3,
                "mean_us": statistics.fmean(ns) / 1e3,
                "us_per_step": sum(ns) / 1e3 / steps,
                "p90_us": sorted(ns)[int(0.9 * len(ns))] / 1e3,
            }
    total = sum(v["us_per_step"] for k, v in out.items() if k != IN_END_STEP)
    return {"per_call": out, "us_per_step": total, "steps": steps}


SCHED_KEYS = ("cpu_wait_us", "sleep_us", "sleeps", "others_cpu_us", "others_cpu_wait_us")


def sched_snapshot(main_last: bool) -> tuple[int, int, int, int, int]:
    """--sched-stats: the training thread's CPU ns (its clock), CPU-wait ns and voluntary context
    switches (/proc/thread-self/schedstat and status), and the CPU ns and CPU-wait ns summed over the
    process's other threads (gloo's workers and TCP loops, ...). ``main_last``: read the
    training thread's after the others' (before a step; after it, first), so that its figures
    span the step and not these reads."""

    def main() -> tuple[int, int, int]:
        # CPU from the thread's clock: schedstat's own figure lags by what ran since the last tick
        # or switch (here: these reads). Its wait is current: it only grows while switched out.
        cpu = time.thread_time_ns()
        with open("/proc/thread-self/schedstat") as f:
            wait = int(f.read().split()[1])
        with open("/proc/thread-self/status") as f:
            sleeps = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        return cpu, wait, sleeps

    first = None if main_last else main()
    me = str(threading.get_native_id())
    o_cpu = o_wait = 0
    for tid in os.listdir("/proc/self/task"):
        if tid != me:
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    a, b = f.read().split()[:2]
                o_cpu, o_wait = o_cpu + int(a), o_wait + int(b)
            except (OSError, ValueError):
                pass
    return (*(first or main()), o_cpu, o_wait)


def sched_step(before: tuple[int, ...], after: tuple[int, ...], wall_s: float) -> tuple[float, ...]:
    """One step's figures (SCHED_KEYS): the training thread's CPU wait (µs), its time neither on a
    CPU nor waiting for one (sleeps: wall - CPU - wait, µs), its sleeps (count), and the other
    threads' CPU and CPU wait (µs)."""
    d = [a - b for a, b in zip(after, before, strict=True)]
    return (d[1] / 1e3, (wall_s * 1e9 - d[0] - d[1]) / 1e3, float(d[2]), d[3] / 1e3, d[4] / 1e3)


def sched_report(per_arm: dict[str, list[tuple[float, ...]]]) -> dict[str, Any]:
    """Per arm, the mean of each SCHED_KEYS figure per step; and ON - OFF."""
    means = {
        arm: dict(zip(SCHED_KEYS, map(statistics.fmean, zip(*rows, strict=True)), strict=True))
        for arm, rows in per_arm.items()
    }
    return {**means, "on_minus_off": {k: means["on"][k] - means["off"][k] for k in SCHED_KEYS}}
