"""What telemetry costs the training thread per step, without training: marks and figures.

Run:  .venv/bin/python bench/bench_step_marks.py [--steps 2000] [--microbatches 4]

Replays the calls a Megatron-Core step makes on the training thread with telemetry on (the
StepMarker's begin/end of the step, ``forward-compute`` / ``backward-compute`` timers per
microbatch, ``all-grads-sync``, the loop's ``optimizer`` phase, then ``request_figures`` for
this step and ``step_figures`` + ``rank_figures`` for the previous one), against a session in
each mode, interleaved in rounds so that machine noise hits both alike:

* ``process``: the default; records go to shared memory, figures are read back;
* ``thread``: sampler and flusher threads in this process, figures computed here;
* ``py-timers``: ``process`` with mcore's timer calls handled in Python (``PyStepMarker``)
  rather than in C (``StepMarker``, where charllm_nemo._hot is built).

It times the training thread's CPU (``time.thread_time_ns``) and wall time per step. The
thread mode's wall time includes waiting for the GIL behind its own sampler and flusher
threads; its CPU time does not. A step here has no work between marks, so the figures are
the telemetry calls alone: divide by a real step's time to get their share (a tiny_gpt CPU step
is ~40-80 ms here; a GPU step of a large model is seconds). The last line is ``BENCH_JSON``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

HZ = 100.0


def replay_step(marker: Any, session: Any, step: int, n_micro: int, previous: Any, figures: Any) -> Any:
    marker.begin_step(step)
    for _ in range(n_micro):
        t = marker("forward-compute")
        t.start()
        t.stop()
        t = marker("backward-compute")
        t.start()
        t.stop()
    t = marker("all-grads-sync")
    t.start()
    t.stop()
    opt = marker.phase("optimizer")
    opt.start()
    opt.stop()
    timing = marker.end_step()
    session.request_figures(timing.t_begin_mono_ns, timing.t_end_mono_ns, _wanted())
    if previous is not None:
        figures(session.step_figures(previous[0], previous[1], figures=_wanted()))
    return (timing.t_begin_mono_ns, timing.t_end_mono_ns)


def _wanted() -> tuple[str, ...]:
    from charllm_nemo.train.report import CONSOLE_FIGURES

    return CONSOLE_FIGURES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000, help="timed steps per mode")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args()

    from charllm_nemo.speedups import IN_C
    from charllm_nemo.telemetry.session import TelemetrySession
    from charllm_nemo.train.marks import PyStepMarker, StepMarker
    from charllm_nemo.train.report import rank_figures

    modes = ("process", "thread", "py-timers")
    sessions = {}
    markers = {}
    for mode in modes:
        s = TelemetrySession(
            tempfile.mkdtemp(prefix=f"bench-marks-{mode}-"),
            backend="synthetic",
            hz=HZ,
            sampler="thread" if mode == "thread" else "process",
            backend_options={"activity": "marks"},
            handle_signals=False,
        ).start()
        s.windows.set_labels(pp_stage=0, tp_rank=0, dp_rank=0, ep_rank=0, cp_rank=0)
        sessions[mode] = s
        marker_cls = PyStepMarker if mode == "py-timers" else StepMarker
        markers[mode] = marker_cls(s.windows, num_microbatches=args.microbatches)
    per_round = max(1, args.steps // args.rounds)
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    wall: dict[str, list[float]] = {m: [] for m in modes}
    previous: dict[str, Any] = dict.fromkeys(modes)
    step = 0
    time.sleep(0.3)
    try:
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else reversed(modes):
                for _ in range(per_round):
                    c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
                    previous[mode] = replay_step(
                        markers[mode], sessions[mode], step, args.microbatches, previous[mode], rank_figures
                    )
                    cpu[mode].append((time.thread_time_ns() - c0) / 1e3)
                    wall[mode].append((time.perf_counter_ns() - t0) / 1e3)
                    step += 1
                    time.sleep(0.001)  # a step boundary: let the sampler and flusher run
    finally:
        for s in sessions.values():
            s.close()
    out: dict[str, Any] = {
        "microbatches": args.microbatches,
        "steps_per_mode": len(cpu["process"]),
        "timers_in_c": IN_C,
    }
    print(
        f"training-thread cost of telemetry per step ({args.microbatches} microbatches: "
        f"{2 * args.microbatches + 3} windows + figure request + previous step's figures), "
        f"{len(cpu['process'])} steps per mode, interleaved; StepMarker's timers in "
        f"{'C' if IN_C else 'Python (charllm_nemo._hot not in use)'}"
    )
    for mode in modes:
        med_cpu, med_wall = statistics.median(cpu[mode]), statistics.median(wall[mode])
        p90 = sorted(wall[mode])[int(0.9 * len(wall[mode]))]
        out[mode] = {"cpu_us_median": med_cpu, "wall_us_median": med_wall, "wall_us_p90": p90}
        print(f"  {mode:<9} CPU {med_cpu:7.1f} us   wall {med_wall:7.1f} us (p90 {p90:7.1f} us)")
    ratio = out["thread"]["wall_us_median"] / out["process"]["wall_us_median"]
    out["thread_over_process_wall"] = ratio
    print(f"  thread / process, median wall: {ratio:.2f}")
    ratio = out["py-timers"]["cpu_us_median"] / out["process"]["cpu_us_median"]
    out["py_timers_over_process_cpu"] = ratio
    print(f"  py-timers / process, median CPU: {ratio:.2f}")
    print("BENCH_JSON " + json.dumps(out))


if __name__ == "__main__":
    main()
