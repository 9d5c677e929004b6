"""bench_train_telemetry.py's report: the verdict, the table, the per-step details, and the
pooling of several runs' dumps (``--pool``)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from train_telemetry_consts import BUSY_MACHINE_CORES, HZ, PROFILE_FUNCS, QUIET_CORES, TARGET_FREE, TIMINGS
from train_telemetry_stats import check_dumps, pool_dumps, step_units, summarize_units


def verdict(r: dict[str, Any]) -> str:
    """MET / MISSED when the 95 % interval of the iteration ratio's per-unit geometric mean (the
    headline) lies on one side of the target. (Until 2026-12-04 the rule used the median ratio's
    bootstrap interval, about 1.3x as wide: the pooled run of that day was INCONCLUSIVE by it and
    MISSED by the geometric mean, which the headline and ``added_ms`` report.) With other
    processes above BUSY_MACHINE_CORES on average, only the quiet rounds count (INCONCLUSIVE
    when there are too few of them): load is not spread evenly between the arms, it takes the
    free core away from the telemetry threads."""
    if r.get("contrast", "all") != "all":
        return f"NOT JUDGED (contrast {r['contrast']}: one part of the overhead, not all of it)"
    if r.get("model_overrides"):
        return "NOT JUDGED (--model-set: the target is for tiny_gpt as it is)"
    stats = r["iteration"]
    where = ""
    if r["background_cores_mean"] > BUSY_MACHINE_CORES:
        if r.get("quiet") is None:
            return f"INCONCLUSIVE (other processes used {r['background_cores_mean']:.2f} cores)"
        stats = r["quiet"]["on"]["iteration"]
        where = f" (over the {r['quiet_rounds']} quiet {rounds_word(r)})"
    lo, hi = stats["ratio_paired_mean_ci95"]
    if hi <= TARGET_FREE:
        return "MET" + where
    if lo > TARGET_FREE:
        return "MISSED" + where
    return "INCONCLUSIVE (the interval straddles the target)" + where


def rounds_word(r: dict[str, Any]) -> str:
    """What the load of other processes was measured over: block rounds or step-mode segments."""
    return "segments" if r.get("interleave") == "step" else "rounds"


def fmt_ci(r: float, ci: list[float]) -> str:
    return f"{r:.4f} [{ci[0]:.4f}, {ci[1]:.4f}]"


ARM_HELP = {
    "on": "telemetry on, as run_rank (session + all windows + per-step figures)",
    "bare": "a bare sampling thread at 100 Hz (synthetic device, fixed level): the reference",
    "proc": "the same bare sampler in a separate process (SIGSTOPped outside its blocks)",
    "marks": "StepTelemetry + WindowRecorder + MarkActivity listener, no thread",
    "sampler": "marks + the sampler thread (no store, no flusher)",
    "session": "the whole TelemetrySession, without the loop's per-step figures",
}


def print_table(results: dict[str, dict[str, Any]]) -> None:
    hdr = (
        f"{'config':<6} {'arm':<8} {'timing':<9} {'arm ms':>7} {'off ms':>7}  {'median ratio [95% CI]':<25} "
        f"{'trimmed-mean ratio':<25} {'paired ratio':<25}"
    )
    print(hdr)
    print("-" * len(hdr))
    for name, r in results.items():
        rows = [("on", r)] + [(arm, d) for arm, d in r.get("decompose", {}).items()]
        for arm, d in rows:
            for key in TIMINGS:
                st = d[key]
                print(
                    f"{name:<6} {arm:<8} {key:<9} {st['median_on_ms']:7.2f} {st['median_off_ms']:7.2f}  "
                    f"{fmt_ci(st['ratio_median'], st['ratio_median_ci95']):<25} "
                    f"{fmt_ci(st['ratio_trimmed_mean'], st['ratio_trimmed_mean_ci95']):<25} "
                    f"{fmt_ci(st['ratio_paired_mean'], st['ratio_paired_mean_ci95']):<25}"
                )
    print()
    for name, r in results.items():
        if r.get("interleave") == "step":
            print_step_details(name, r)
            continue
        sm = r["sampler"]
        print(
            f"{name:<6} ON blocks: sampler deadline ratio {sm['deadline_ratio_timed']:.4f} over timed steps "
            f"({sm['slots_timed']} slots, {sm['missed_timed']} skipped), "
            f"{sm['deadline_ratio_session']:.4f} over whole sessions, late max {sm['late_max_ms']:.2f} ms; "
            f"flushes {r['flusher']['flushes']} "
            f"(max {r['flusher']['flush_ms_max']:.1f} ms); windows {r['windows_recorded']}, unmatched marks "
            f"{r['unmatched_marks']}; session start {r['session_start_ms_median']:.1f} ms / close "
            f"{r['session_close_ms_median']:.1f} ms (untimed); {r['pairs']} rounds x {len(r['arms'])} arms x "
            f"{r['block_steps']} steps; child {r['elapsed_s']:.0f} s"
        )
    for name, r in results.items():
        q = r.get("quiet")
        qs = ""
        if q is not None:
            qs = f"; quiet {rounds_word(r)} only: " + ", ".join(
                f"{arm} {d['iteration']['ratio_median']:.4f} [{d['iteration']['ratio_median_ci95'][0]:.4f}, "
                f"{d['iteration']['ratio_median_ci95'][1]:.4f}]"
                for arm, d in q.items()
            )
        print(
            f"{name:<6} other processes: {r['background_cores_mean']:.2f} cores on average (max "
            f"{r['background_cores_max']:.2f}); {r['quiet_rounds']}/{r.get('segments', r['pairs'])} "
            f"{rounds_word(r)} under {QUIET_CORES} cores{qs}"
        )
    for name, r in results.items():
        parts = [
            f"{arm} {d['gen0']:.0f}/{d['gen1']:.0f}/{d['gen2']:.1f} "
            f"({d['ms']:.1f} ms, gen2 max {d['gen2_ms_max']:.0f} ms)"
            for arm, d in sorted(r["gc_per_100_steps"].items())
        ]
        print(f"{name:<6} gc per 100 timed steps, gen0/gen1/gen2 (time): " + "; ".join(parts))
    for name, r in results.items():
        prof = r.get("profile")
        if not prof:
            continue
        print(f"\n{name}: cProfile of the training thread, ms per timed step (profiler overhead included)")
        arms_p = list(prof)
        print(f"  {'':<48}" + "".join(f"{a:>9}" for a in arms_p))
        print(
            f"  {'all profiled time':<48}"
            + "".join(f"{prof[a]['profiled_ms_per_step']:9.2f}" for a in arms_p)
        )
        for label in PROFILE_FUNCS.values():
            vals = [prof[a]["ms_per_step"].get(label) for a in arms_p]
            if any(v for v in vals):
                print(f"  {label:<48}" + "".join(f"{(v or 0.0):9.3f}" for v in vals))
    print()
    for arm in ["on"] + [a for a in ARM_HELP if a != "on"]:
        if any(arm == "on" or arm in r.get("decompose", {}) for r in results.values()):
            print(f"  {arm:<8} {ARM_HELP[arm]}")
    print(
        "  iteration = perf_counter over the whole loop body; loop_step = the loop's own step window; "
        "main_cpu = the training thread's CPU time (what the other threads and processes cannot lengthen "
        "except through caches: the main thread's own extra work)"
    )
    if any(r.get("interleave") == "step" for r in results.values()):
        print(
            "  step mode: one session, its telemetry process SIGSTOPped for OFF steps; median ratio and "
            "trimmed-mean ratio with 95 % bootstrap intervals over whole ABBA quads (or pairs); paired "
            "ratio = geometric mean of the per-quad (per-pair) ON/OFF ratios, 95 % t interval"
        )
    else:
        print("  paired ratio = mean of the per-round ratios of block medians, 95 % t interval")


def print_step_details(name: str, r: dict[str, Any]) -> None:
    """Step mode: what the session did, the switches, the figures."""
    sm, fg, fl, sw = r["sampler"], r["figures"], r["flusher"], r["switch"]
    cov = sm["coverage_on"]
    sched = f", collector {sm['collector_sched']['policy']}" if sm.get("collector_sched") else ""
    unit = "ABBA quads" if r["unit_steps"] == 4 else "random pairs"
    print(
        f"{name:<6} step mode: {r['pairs']} ON + {r['pairs']} OFF steps in {r['units']} {unit}, all timed; "
        + (
            f"telemetry process ({sm['mode']}{sched}) running throughout, OFF steps without the "
            "telemetry calls"
            if r.get("contrast") == "thread"
            else f"telemetry process ({sm['mode']}{sched}) stopped for OFF steps"
            + (", which make the ON steps' telemetry calls" if r.get("contrast") == "process" else "")
            + ("" if sm["stopped_state_seen"] else " (NOT SEEN IN STATE T)")
        )
        + f"; samples during ON steps {sm['samples_on']} of {sm['expected_on']:.0f} due at {HZ:g} Hz"
        + (f" ({cov:.3f})" if cov is not None else "")
        + f", rows lost {sm['rows_lost']}; its CPU {sm['process_cpu_ms_per_on_step']:.2f} ms per ON step "
        f"({sm['process_cores_while_on']:.3f} cores while ON); windows {r['windows_recorded']}, "
        f"unmatched marks {r['unmatched_marks']}; session start {r['session_start_ms_median']:.1f} ms / "
        f"close {r['session_close_ms_median']:.1f} ms (untimed); child {r['elapsed_s']:.0f} s"
    )
    req = (
        f"request_figures called {fg['requested']} times"
        if fg["request_figures"]
        else "no session.request_figures in this src"
    )
    fls = "Python threads in the training process besides the main one: " + (
        ", ".join(r["threads"]) if r["threads"] else "none"
    )
    if r["threads"]:
        fls += " (not paused: they also run during OFF steps)"
    if fl["thread_in_training_process"]:
        fls += f"; flusher: {fl['flushes']} flushes, max {fl['flush_ms_max']:.1f} ms"
    print(
        f"{name:<6} figures of earlier ON steps asked {fg['asked']} times, {fg['not_ready']} not ready; "
        f"{req}; {fls}"
    )
    calls = r.get("calls")
    if calls:
        on_ms = r["iteration"]["median_on_ms"]
        parts = ", ".join(
            f"{k} {v['us_per_step']:.0f} ({v['n'] / calls['steps']:.0f} x {v['median_us']:.1f})"
            for k, v in calls["per_call"].items()
        )
        print(
            f"{name:<6} telemetry calls on the training thread, in the step: {calls['us_per_step']:.0f} µs "
            f"per ON step ({calls['us_per_step'] / 10 / on_ms:.2f} % of its median); µs per step "
            f"(calls x median µs): {parts}"
        )

    sc = r.get("sched")
    if sc:
        on, off, diff = sc["on"], sc["off"], sc["on_minus_off"]
        print(
            f"{name:<6} scheduling per step, ON / OFF / ON - OFF (mean): training thread's CPU wait "
            f"{on['cpu_wait_us']:.1f} / {off['cpu_wait_us']:.1f} / {diff['cpu_wait_us']:+.1f} µs, its sleeps "
            f"{on['sleep_us']:.1f} / {off['sleep_us']:.1f} / {diff['sleep_us']:+.1f} µs "
            f"({on['sleeps']:.1f} / {off['sleeps']:.1f} of them); the process's other threads' CPU "
            f"{on['others_cpu_us']:.0f} / {off['others_cpu_us']:.0f} / {diff['others_cpu_us']:+.0f} µs, "
            f"their CPU wait {on['others_cpu_wait_us']:.0f} / {off['others_cpu_wait_us']:.0f} / "
            f"{diff['others_cpu_wait_us']:+.0f} µs"
        )

    def sr(d: dict[str, Any]) -> str:
        v = d["ratio_median"]
        return f"{v:.4f}" if v is not None else "n/a"

    st = r.get("steady_iteration")
    steady_s = (
        f"; iteration ON/OFF over the steps not right after a switch only: "
        f"{fmt_ci(st['ratio_median'], st['ratio_median_ci95'])}"
        if st
        else ""
    )
    print(
        f"{name:<6} switch cost, median of steps right after a switch / of steps after one of the same "
        f"arm: ON {sr(sw['on'])} ({sw['on']['after_switch']}/{sw['on']['steady']} steps), "
        f"OFF {sr(sw['off'])} ({sw['off']['after_switch']}/{sw['off']['steady']} steps){steady_s}"
    )


def step_summary_line(name: str, r: dict[str, Any]) -> str:
    """The headline of one configuration in step mode: ON/OFF figures and (free) the verdict."""
    it, cpu = r["iteration"], r["main_cpu"]
    unit = "quad" if r["unit_steps"] == 4 else "pair"
    line = (
        f"{name}: iteration ON/OFF median ratio {fmt_ci(it['ratio_median'], it['ratio_median_ci95'])}, "
        f"per-{unit} geometric mean {fmt_ci(it['ratio_paired_mean'], it['ratio_paired_mean_ci95'])}, "
        f"trimmed mean {fmt_ci(it['ratio_trimmed_mean'], it['ratio_trimmed_mean_ci95'])}; "
        f"main_cpu median ratio {fmt_ci(cpu['ratio_median'], cpu['ratio_median_ci95'])}; "
        f"ON {it['median_on_ms']:.2f} ms / OFF {it['median_off_ms']:.2f} ms, {r['pairs']} steps per arm"
    )
    if "added_ms" in it:
        lo, hi = it["added_ms_ci95"]
        line += f"; ON adds {it['added_ms']:.3f} ms [{lo:.3f}, {hi:.3f}] a step (mean per {unit})"
        if it["target_step_ms_upper"] is not None:
            at_mean = it["target_step_ms"] or 0.0
            line += (
                f": as a fixed cost, within {100 * (TARGET_FREE - 1):.1f} % for steps of at least "
                f"{it['target_step_ms_upper']:.0f} ms (upper bound; {at_mean:.0f} ms at the mean)"
            )
    if name == "free":
        line += f"; target <= {TARGET_FREE}: {verdict(r)}"
    return line


def print_pool(files: list[str], json_only: bool = False) -> int:
    """``--pool``: each run's and the pooled step-mode figures of ``--dump-steps`` files; the
    pooled ones as the last line, ``BENCH_JSON``. Returns the exit status (2: refused)."""
    try:
        dumps = [(f, json.loads(Path(f).read_text())) for f in files]
        check_dumps(dumps)  # refuse a bad set before any statistics
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        print(f"--pool: {exc}", file=sys.stderr)
        return 2
    if not json_only:  # each run's line as soon as it is known: the bootstraps take a while
        for f, d in dumps:
            it = summarize_units(step_units(d["steps"], 0))  # the iteration timing alone
            geo = fmt_ci(it["ratio_paired_mean"], it["ratio_paired_mean_ci95"])
            load = statistics.fmean(d["background"])
            print(
                f"{f}: per-unit geometric mean {geo}, "
                f"median ratio {fmt_ci(it['ratio_median'], it['ratio_median_ci95'])}, "
                f"OFF {it['median_off_ms']:.2f} ms, other processes {load:.2f} cores",
                flush=True,
            )
        steps = sum(len(d["steps"]) for _, d in dumps)
        print(
            f"--pool: pooling {len(dumps)} runs ({steps} steps; ~2.5 s per 1000 steps on a 2-core VM) ...",
            file=sys.stderr,
            flush=True,
        )
    pooled = pool_dumps(dumps)
    name = pooled["config"]
    if not json_only:
        print(f"pooled, {pooled['runs']} runs: " + step_summary_line(name, pooled))
    payload = {
        "bench": "train_telemetry",
        "pool": files,
        "target_free": TARGET_FREE,
        "verdict_free": verdict(pooled) if name == "free" else None,
        "results": {name: pooled},
    }
    print("BENCH_JSON " + json.dumps(payload))
    return 0
