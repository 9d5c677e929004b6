"""What telemetry costs the training thread per step, without training: the step API's calls.

Run:  .venv/bin/python bench/bench_step_marks.py [--steps 2000] [--microbatches 4] [--against DIR]

Replays, on the training thread, what one Megatron-Core step calls with telemetry on, through
the framework-free step API (charllm_nemo.steps.StepTelemetry, as ``charllm train`` and every
integration use it): ``begin_step``; per microbatch the ``forward-compute`` /
``backward-compute`` timers of ``st.timers()``; ``all-grads-sync``; ``with st.phase("optimizer")``;
``end_step(loss=...)``: the step's window to the session, its figure request, the figures of an
earlier step now due (``step_figures``), the one per-rank vector (one rank: no collective), the
report with its rates, and the report of the earlier step to an observer. Against a session in
each mode, interleaved in rounds so that machine noise hits both alike:

* ``process``: the default; records go to shared memory, figures are read back;
* ``thread``: sampler and flusher threads in this process, figures computed here.

It times the training thread's CPU (``time.thread_time_ns``) and wall time per step. A step here
has no work between marks, so the figures are the telemetry calls alone: divide by a real step's
time to get their share. The target (issue #26): <= 0.5 ms a step on the training thread.

``--against DIR``: a checkout of an earlier version (e.g. ``git worktree add /tmp/base 800453a``)
whose own ``bench/bench_step_marks.py`` is run with its ``src/`` (before the step API: the loop's
StepMarker + request_figures + step_figures + rank_figures), alternating with this tree's in
``--rounds`` child processes (A, B, A, B, ...); the ratios of the medians are printed. The last
line is ``BENCH_JSON {...}``.
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

HZ = 100.0
MODES = ("process", "thread")


def replay_step(st: Any, timers: Any, step: int, n_micro: int) -> None:
    """One step's calls, as Megatron-Core's schedule and the loop make them."""
    st.begin_step(step)
    for _ in range(n_micro):
        t = timers("forward-compute", log_level=2)
        t.start()
        t.stop()
        t = timers("backward-compute", log_level=2)
        t.start()
        t.stop()
    t = timers("all-grads-sync", log_level=2)
    t.start()
    t.stop()
    with st.phase("optimizer"):
        pass
    st.end_step(loss=2.5, num_microbatches=n_micro)


def child(steps: int, rounds: int, n_micro: int) -> dict[str, Any]:
    """This tree's figures (in this process): per mode, the median CPU and wall µs a step."""
    from charllm_nemo.metrics.flops import ModelShape
    from charllm_nemo.steps import FunctionObserver, RateInputs, StepOptions, StepTelemetry
    from charllm_nemo.telemetry.config import Placement
    from charllm_nemo.telemetry.session import TelemetrySession
    from charllm_nemo.telemetry.session_options import SessionOptions

    # tiny_gpt's shape: the rates are computed every step; their size does not matter
    shape = ModelShape(2, 64, 4, 256, 1024, 64)  # layers, hidden, heads, ffn, vocab, seq
    sessions, apis, timers = {}, {}, {}
    reported = dict.fromkeys(MODES, 0)
    for mode in MODES:
        s = TelemetrySession(
            tempfile.mkdtemp(prefix=f"bench-marks-{mode}-"),
            SessionOptions(backend="synthetic", hz=HZ, sampler=mode, backend_options={"activity": "marks"}),
            handle_signals=False,
        ).start()
        s.windows.set_labels(pp_stage=0, tp_rank=0, dp_rank=0, ep_rank=0, cp_rank=0)
        sessions[mode] = s

        def count(_report: Any, mode: str = mode) -> None:
            reported[mode] += 1

        apis[mode] = StepTelemetry(
            s,
            Placement(),
            options=StepOptions(num_microbatches=n_micro),
            rates=RateInputs(shape, 4, peak_tflops_per_gpu=1.0),
            observers=[FunctionObserver(count)],
        )
        timers[mode] = apis[mode].timers()
    per_round = max(1, steps // rounds)
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    wall: dict[str, list[float]] = {m: [] for m in MODES}
    step = 0
    time.sleep(0.3)
    try:
        for r in range(rounds):
            for mode in MODES if r % 2 == 0 else reversed(MODES):
                for _ in range(per_round):
                    c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
                    replay_step(apis[mode], timers[mode], step, n_micro)
                    cpu[mode].append((time.thread_time_ns() - c0) / 1e3)
                    wall[mode].append((time.perf_counter_ns() - t0) / 1e3)
                    step += 1
                    time.sleep(0.001)  # a step boundary: let the sampler and flusher run
    finally:
        for mode in MODES:
            apis[mode].finish("complete")
    out: dict[str, Any] = {"microbatches": n_micro, "steps_per_mode": len(cpu["process"])}
    for mode in MODES:
        p90 = sorted(wall[mode])[int(0.9 * len(wall[mode]))]
        out[mode] = {
            "cpu_us_median": statistics.median(cpu[mode]),
            "wall_us_median": statistics.median(wall[mode]),
            "wall_us_p90": p90,
            "reports": reported[mode],
        }
    return out


def _bench_json(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith("BENCH_JSON "):
            return dict(json.loads(line[len("BENCH_JSON ") :]))
    raise RuntimeError(f"no BENCH_JSON line in:\n{stdout[-2000:]}")


def _run(tree: Path, script: Path, args: list[str]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    done = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{script} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return _bench_json(done.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000, help="timed steps per mode")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--against", type=Path, help="an earlier checkout, measured by its own bench")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child or args.against is None:
        out = child(args.steps, args.rounds, args.microbatches)
        print(
            f"training-thread cost of the step API per step ({args.microbatches} microbatches: "
            f"{2 * args.microbatches + 3} windows, figure request, an earlier step's figures, the report), "
            f"{out['steps_per_mode']} steps per mode, interleaved"
        )
        for mode in MODES:
            m = out[mode]
            print(
                f"  {mode:<8} CPU {m['cpu_us_median']:7.1f} us   wall {m['wall_us_median']:7.1f} us "
                f"(p90 {m['wall_us_p90']:7.1f} us); {m['reports']} steps reported"
            )
        print("BENCH_JSON " + json.dumps(out))
        return
    here = Path(__file__).resolve().parent.parent
    other = args.against.resolve()
    script = other / "bench" / "bench_step_marks.py"
    if not (other / "src" / "charllm_nemo").is_dir() or not script.is_file():
        ap.error(f"--against {other}: no src/charllm_nemo and bench/bench_step_marks.py there")
    rounds = max(2, args.rounds // 5)
    steps = max(100, args.steps // rounds)
    child_args = ["--steps", str(steps), "--rounds", "5", "--microbatches", str(args.microbatches)]
    runs: dict[str, list[dict[str, Any]]] = {"this tree": [], "against": []}
    for r in range(rounds):
        order = [("this tree", here), ("against", other)]
        for label, tree in order if r % 2 == 0 else reversed(order):
            extra = ["--child"] if label == "this tree" else []
            runs[label].append(_run(tree, tree / "bench" / "bench_step_marks.py", child_args + extra))
    summary: dict[str, Any] = {"rounds": rounds, "steps_per_round": steps, "against": str(other)}
    print(f"training-thread CPU per step: median of {rounds} alternating child runs, {steps} steps a mode")
    for mode in MODES:
        mine = statistics.median(x[mode]["cpu_us_median"] for x in runs["this tree"])
        theirs = statistics.median(x[mode]["cpu_us_median"] for x in runs["against"])
        summary[mode] = {"this_tree_cpu_us": mine, "against_cpu_us": theirs, "ratio": mine / theirs}
        print(f"  {mode:<8} this tree {mine:7.1f} us   against {theirs:7.1f} us   ratio {mine / theirs:.2f}")
    if all("py-timers" in x for x in runs["against"]):  # the earlier tree's Python timers (it had C ones)
        theirs = statistics.median(x["py-timers"]["cpu_us_median"] for x in runs["against"])
        mine = summary["process"]["this_tree_cpu_us"]
        summary["process_vs_against_py_timers"] = {"against_cpu_us": theirs, "ratio": mine / theirs}
        print(f"  process vs against's py-timers {theirs:7.1f} us   ratio {mine / theirs:.2f}")
    print("BENCH_JSON " + json.dumps(summary))


if __name__ == "__main__":
    main()
