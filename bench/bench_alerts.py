"""What live alerts cost rank 0's training thread per step: alerts on against alerts off.

Run:  .venv/bin/python bench/bench_alerts.py [--steps 2000] [--rounds 20] [--microbatches 4]

Part a. The step API's calls of one Megatron-Core step (bench_step_marks.py's replay: begin,
forward / backward timers per microbatch, grad sync, optimizer, end_step with its report to the
observers), on two StepTelemetry objects over synthetic telemetry sessions (sampler ``process``),
interleaved in rounds so that machine noise hits both alike:

* ``off``: ``alerts=off``: no alert observer, no phase sums, no facts exchanged (what a run
  without alerts does, the same as before alerts existed but for the 9 NaN entries the
  per-rank vector now carries);
* ``on``: the alert observer on rank 0 (``alerts.jsonl`` in a temporary folder; nothing fires
  in steady state), ``phase_times`` (each step's marks summed by phase group, and the
  sampler's health read) and the ranks' facts exchanged once.

One rank: the report holds one rank's figures. Part b times the detector alone over reports
of N ranks (steady state: no alert fires, every check runs), the part that grows with the job,
without a pipeline, with 8 stages given, and with a pipeline whose stages are not given.

Printed: median training-thread CPU (``time.thread_time_ns``) per step of each arm, the
difference, and the ratio on/off; part b: µs per step for N ranks. The last line is
``BENCH_JSON {...}``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from typing import Any

from bench_step_marks import replay_step  # one step's calls, as mcore's schedule makes them

ARMS = ("off", "on")


def part_a(steps: int, rounds: int, n_micro: int) -> dict[str, Any]:
    from charllm_nemo.alerts import AlertsConfig, alert_observer
    from charllm_nemo.steps import FunctionObserver, StepOptions, StepTelemetry
    from charllm_nemo.telemetry.config import Placement
    from charllm_nemo.telemetry.session import TelemetrySession
    from charllm_nemo.telemetry.session_options import SessionOptions

    apis, timers, sessions = {}, {}, []
    for arm in ARMS:
        s = TelemetrySession(
            tempfile.mkdtemp(prefix=f"bench-alerts-{arm}-"),
            SessionOptions(
                backend="synthetic", hz=100.0, sampler="process", backend_options={"activity": "marks"}
            ),
            handle_signals=False,
        ).start()
        sessions.append(s)
        observers: list[Any] = [FunctionObserver(lambda _r: None)]
        on = arm == "on"
        if on:
            obs = alert_observer(AlertsConfig(), run_dir=tempfile.mkdtemp(prefix="bench-alerts-dir-"))
            assert obs is not None
            observers.append(obs)
        apis[arm] = StepTelemetry(
            s,
            Placement(),
            options=StepOptions(num_microbatches=n_micro, phase_times=on, rank_info=on),
            observers=observers,
        )
        timers[arm] = apis[arm].timers()
    per_round = max(1, steps // rounds)
    cpu: dict[str, list[float]] = {a: [] for a in ARMS}
    step = 0
    time.sleep(0.3)
    try:
        for r in range(rounds):
            for arm in ARMS if r % 2 == 0 else reversed(ARMS):
                for _ in range(per_round):
                    c0 = time.thread_time_ns()
                    replay_step(apis[arm], timers[arm], step, n_micro)
                    cpu[arm].append((time.thread_time_ns() - c0) / 1e3)
                    step += 1
                    time.sleep(0.001)
    finally:
        for arm in ARMS:
            apis[arm].finish("complete")
    return {arm: statistics.median(cpu[arm][1:]) for arm in ARMS} | {"steps_per_arm": len(cpu["on"])}


PIPELINES = ("none", "pp8", "pp_unknown")
"""Part b's layouts: no pipeline (every rank a peer of every other); 8 stages given by a
StageLayout (each rank compared within its stage); a pipeline whose stages are not given (every
rank judged alone, on evidence: the most work per rank)."""


def part_b(ranks: int, steps: int, pipeline: str = "none") -> float:
    """µs per step of AlertDetector.check over ``ranks`` ranks (steady state, nothing fires)."""
    from charllm_nemo.alerts import AlertDetector, AlertsConfig, StageLayout
    from charllm_nemo.steps.report import StepReport, apply_rank_figures, pack_rank_vector

    stages = StageLayout.megatron(ranks, 8) if pipeline == "pp8" else None
    wait = 0.0 if pipeline == "none" else 0.01
    det = AlertDetector(AlertsConfig(warmup_steps=0), stages)
    det.set_rank_info([{"rank": r, "host": f"node{r // 8}", "power_limit_w": 700.0} for r in range(ranks)])
    rows = []
    for r in range(ranks):
        wobble = 1 + 0.01 * math.sin(r)
        figures = {
            "duration_s": 0.1,
            "power_avg_w": 600.0,
            "temp_gpu_peak_c": 70 + r % 5,
            "clock_sm_avg_mhz": 1900,
        }
        rows.append(
            pack_rank_vector(
                step_time_s=0.1, figures=figures, timing=(0.1, 0.03 * wobble, 0.05, 0.01, wait, 0)
            )
        )
    times = []
    for step in range(steps):
        rep = StepReport(step=step, loss=1.0, step_time_s=0.1)
        apply_rank_figures(rep, rows)
        c0 = time.thread_time_ns()
        alerts = det.check(rep)
        times.append((time.thread_time_ns() - c0) / 1e3)
        assert not alerts, alerts
    return statistics.median(times)


def part_c(ranks: int, steps: int, gap_s: float) -> tuple[float, int]:
    """µs per step that the alert observer costs the training thread over ``ranks`` ranks (its
    ``on_step``: a queue put; the detector runs on the observer's thread), steps ``gap_s``
    apart, and how many steps its thread dropped."""
    from charllm_nemo.alerts import AlertsConfig, alert_observer
    from charllm_nemo.steps.report import StepReport, apply_rank_figures, pack_rank_vector

    obs = alert_observer(AlertsConfig(warmup_steps=0, console=False, file=False))
    assert obs is not None
    obs.on_rank_info([{"rank": r, "host": f"node{r // 8}", "power_limit_w": 700.0} for r in range(ranks)])
    figures = {"duration_s": 0.1, "power_avg_w": 600.0, "temp_gpu_peak_c": 70.0, "clock_sm_avg_mhz": 1900}
    rows = [pack_rank_vector(step_time_s=0.1, figures=figures, timing=(0.1, 0.03, 0.05, 0.01, 0, 0))] * ranks
    times = []
    for step in range(steps):
        rep = StepReport(step=step, loss=1.0, step_time_s=0.1)
        apply_rank_figures(rep, rows)
        c0 = time.thread_time_ns()
        obs.on_step(rep)
        times.append((time.thread_time_ns() - c0) / 1e3)
        time.sleep(gap_s)
    obs.close("complete")
    return statistics.median(times), obs.dropped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000, help="timed steps per arm")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--ranks", type=int, nargs="*", default=[8, 64, 512])
    args = ap.parse_args()
    a = part_a(args.steps, args.rounds, args.microbatches)
    diff = a["on"] - a["off"]
    print(
        f"a. training-thread CPU per step, {args.microbatches} microbatches, {a['steps_per_arm']} steps "
        "per arm, interleaved (median)"
    )
    ratio = a["on"] / a["off"]
    print(f"   alerts off {a['off']:7.1f} us   alerts on {a['on']:7.1f} us   difference {diff:+6.1f} us")
    print(f"   ratio on/off {ratio:.3f}; the difference is {100 * diff / 1e5:.3f} % of a 100 ms step")
    b = {p: {n: part_b(n, 200, p) for n in args.ranks} for p in PIPELINES}
    print("b. the detector alone (rank 0, per step, steady state: nothing fires), us per step")
    print("   " + " ".join(f"{p:>12}" for p in ("ranks", *PIPELINES)) + "   ratio pp_unknown/none")
    for n in args.ranks:
        row = " ".join(f"{b[p][n]:12.1f}" for p in PIPELINES)
        print(f"   {n:12d} {row}   {b['pp_unknown'][n] / b['none'][n]:.2f}")
    c = {n: part_c(n, 100, 0.03) for n in args.ranks}
    print(
        "c. the alert observer's on_step on the training thread (the detector on its own thread), "
        "steps 30 ms apart"
    )
    for n, (us, dropped) in c.items():
        print(f"   {n:5d} ranks {us:9.1f} us   ({dropped} step(s) dropped by the alert thread)")
    print(
        "BENCH_JSON "
        + json.dumps(
            {
                "a": a,
                "b": {p: {str(k): v for k, v in b[p].items()} for p in PIPELINES},
                "c": {str(k): v for k, v in c.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
