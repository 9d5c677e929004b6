"""Wakeups of the NeMo callback's threads in the training process, before and after issue #40,
in one run, without NeMo: rank 0's observers exactly as PowerThermalCallback sets them up
(``open_step_telemetry`` with alerts, steps.jsonl and the trainer-loggers' thread, then the
callback's ``_observers_off_thread``; the timers adapter marking 4 microbatches of forward and
backward a step), on a busy-loop step of ``--step-ms`` (28: the shrunk llama3 recipe's step on
a quiet core). Arms alternate in fresh processes: ``before`` (the observer thread woken on
every report, the alert checks on a thread of their own), ``after`` (one thread, woken every
8 reports or 0.5 s). Per thread: wakeups a second (voluntary context switches,
bench/thread_wakeups.py) and per step, and CPU.

    .venv-nemo/bin/python bench/bench_callback_threads.py --rounds 2 --steps 150
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def child(arm: str, steps: int, step_ms: float, out: str) -> None:
    sys.path.insert(0, str(HERE))
    import thread_wakeups
    from charllm_nemo.integrations import _observer_thread
    from charllm_nemo.integrations import nemo as callback
    from charllm_nemo.integrations._common import IntegrationOptions, RunFacts, open_step_telemetry
    from charllm_nemo.metrics.flops import ModelShape
    from charllm_nemo.telemetry.config import Placement

    if arm == "before":
        _observer_thread.BATCH = 1
        callback.MERGE_ALERTS = False
    shape = ModelShape(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=256,
        vocab_size=256,
        seq_length=64,
    )
    opts = IntegrationOptions(backend="synthetic", out_dir=tempfile.mkdtemp(prefix="bench-threads-"), hz=100)
    st, _ = open_step_telemetry(
        opts, Placement(), framework="nemo", sources={"step": "bench"},
        run=RunFacts(model=shape, global_batch_size=4, seq_length=64, total_steps=steps + 20),
    )  # fmt: skip
    callback._observers_off_thread(st)
    timers = st.timers()
    part = step_ms / 1e3 / 9  # 4 x (forward, backward) + the optimizer

    def step(i: int) -> None:
        st.begin_step(i)
        for _ in range(4):
            for name in ("forward-compute", "backward-compute"):
                timers(name).start()
                busy(part)
                timers(name).stop()
        busy(part)
        st.end_step(loss=1.0)

    for i in range(20):  # warm-up: the threads started, the first figures in
        step(i)
    before = thread_wakeups.snapshot()
    for i in range(20, 20 + steps):
        step(i)
    after = thread_wakeups.snapshot()
    st.finish("complete")
    rows = thread_wakeups.rates(before, after)
    Path(out).write_text(
        json.dumps({"rows": rows, "steps_per_s": steps / (after[0] - before[0]), "load": os.getloadavg()[0]})
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--step-ms", type=float, default=28.0)
    ap.add_argument("--arm", choices=["before", "after"], help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        child(args.arm, args.steps, args.step_ms, args.json)
        return
    tmp = tempfile.mkdtemp(prefix="bench-threads-")
    print(
        f"{args.rounds} rounds x (before, after), {args.steps} steps of {args.step_ms:g} ms busy; "
        f"{os.cpu_count()} CPUs"
    )
    for r in range(args.rounds):
        for arm in ("before", "after") if r % 2 == 0 else ("after", "before"):
            out = os.path.join(tmp, f"{r}-{arm}.json")
            cmd = [sys.executable, __file__, "--arm", arm, "--json", out, "--steps", str(args.steps)]
            subprocess.run(
                [*cmd, "--step-ms", str(args.step_ms)], check=True, capture_output=True, timeout=900
            )
            got = json.loads(Path(out).read_text())
            sps = got["steps_per_s"]
            ours = [x for x in got["rows"] if x["name"].startswith("charllm")]
            total = sum(x["wakeups_per_s"] for x in ours)
            print(
                f"round {r} {arm:<6} load {got['load']:.1f}, {sps:.1f} steps/s: charllm threads "
                f"{total:.1f} wakeups/s = {total / sps:.2f} a step"
            )
            for x in ours + [x for x in got["rows"] if x["name"] == "MainThread"]:
                print(
                    f"    {x['name']:<20} {x['wakeups_per_s']:7.1f} wakeups/s "
                    f"({x['wakeups_per_s'] / sps:.2f} a step), "
                    f"{100 * x['cpu_share']:.2f} % of a core"
                )


if __name__ == "__main__":
    main()
