"""``kill -9`` of the local launcher alone, N times: does every rank still end with a true record?

Run:  .venv/bin/python bench/kill_launcher.py [--tries 10] [--nproc 2] [--real]

Each try starts a launcher (train/launch.py's ``launch_local``, with a second thread as
``charllm train``'s launcher has) whose ranks run a stand-in of the trainer's telemetry side:
``train/worker.py``'s ``sigterm_unwinds`` around a process-mode :class:`TelemetrySession` on the
synthetic device, 50 ms steps marked as windows, and a ``summary.json`` written in a ``finally``
after the session's close, as the trainer does. Once every rank has stored a segment, the
launcher is killed with SIGKILL; its ranks then get PR_SET_PDEATHSIG's SIGTERM once per launcher
thread that exits. The try counts as good when every rank's manifest ends with status
``terminated`` and ``ended_wall_ns``, the store reads back without problems, and every rank wrote
its summary. No torch: what is measured is the telemetry core and the rank's signal handling.

``--real``: the same with ``charllm train`` itself (tiny_gpt on the CPU, ``nproc`` ranks, in
its own process group, killed with ``kill -9 -PGID`` once rank 0 has reported a step); the try
is good when every rank's manifest says ``terminated`` with ``ended_wall_ns`` and
``summary.json`` exists. Slow: torch's import and a Megatron-Core set-up per rank.

The last line printed is ``BENCH_JSON {...}`` with the counts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_LAUNCHER = """
import sys, threading, time
from charllm_nemo.train.launch import launch_local
threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()  # charllm train has two
launch_local(None, int(sys.argv[2]), run_dir=sys.argv[1],
             worker_argv=[sys.executable, sys.argv[3], "--rank", sys.argv[1]])
"""


def rank_main(out: str) -> None:
    """One rank: telemetry session, steps until killed, summary after the close."""
    from charllm_nemo.telemetry.session import TelemetrySession
    from charllm_nemo.telemetry.session_options import Placement, SessionOptions, StoreOptions
    from charllm_nemo.train.worker import sigterm_unwinds

    rank = int(os.environ["RANK"])
    with sigterm_unwinds():
        session = TelemetrySession(
            out,
            SessionOptions(
                backend="synthetic", hz=100, sampler="process", store=StoreOptions(flush_interval_s=0.2)
            ),
            placement=Placement(rank=rank, world_size=int(os.environ["WORLD_SIZE"])),
        ).start()
        status = "complete"
        try:
            for step in range(100_000):
                with session.windows.window("step", step=step):
                    time.sleep(0.05)
        except SystemExit:
            status = "terminated"
            raise
        finally:
            session.close(status)
            tmp = Path(out) / f"summary-rank{rank}.json.tmp"
            tmp.write_text(json.dumps({"status": status}))
            tmp.rename(Path(out) / f"summary-rank{rank}.json")


def one_try(root: Path, nproc: int) -> dict[str, object]:
    """Start, wait for every rank's first segment, kill -9 the launcher, wait for the ranks."""
    out = root / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(out), str(nproc), __file__],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(list(out.glob(f"rank={r}/samples-*.parquet")) for r in range(nproc)):
            break
        time.sleep(0.1)
    time.sleep(0.3)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    # The ranks are in their own sessions: wait until none has its manifest open any more.
    from charllm_nemo.telemetry.reader import load_run

    deadline = time.monotonic() + 30
    statuses: list[str] = []
    while time.monotonic() < deadline:
        paths = [out / f"rank={r}" / "manifest.json" for r in range(nproc)]
        statuses = [json.loads(p.read_text()).get("status", "?") if p.exists() else "missing" for p in paths]
        summaries = [(out / f"summary-rank{r}.json").exists() for r in range(nproc)]
        if all(summaries):
            break
        time.sleep(0.2)
    time.sleep(1.0)  # a rank killed mid-close leaves no summary: the wait above ran out
    run = load_run(out)
    ended = [("ended_wall_ns" in m) for m in run.manifests.values()]
    good = all(s == "terminated" for s in statuses) and all(ended) and all(summaries) and not run.problems
    return {"statuses": statuses, "summaries": summaries, "problems": len(run.problems), "good": good}


def one_real_try(root: Path, nproc: int) -> dict[str, object]:
    """``charllm train`` in its own group; kill -9 the group once a step is reported."""
    out = root / "run"
    cmd = [sys.executable, "-m", "charllm_nemo.cli", "train", f"nproc={nproc}", "logger=none",
           "batch.train_steps=100000", f"telemetry.out_dir={out}"]  # fmt: skip
    launcher = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and launcher.poll() is None:
        steps = out / "steps.jsonl"
        if steps.exists() and steps.read_text().count("\n") >= 2:
            break
        time.sleep(0.2)
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()
    paths = [out / f"rank={r}" / "manifest.json" for r in range(nproc)]
    deadline = time.monotonic() + 60
    statuses: list[str] = []
    while time.monotonic() < deadline:
        statuses = [json.loads(p.read_text()).get("status", "?") if p.exists() else "missing" for p in paths]
        if "running" not in statuses and (out / "summary.json").exists():
            break
        time.sleep(0.2)
    time.sleep(2.0)
    statuses = [json.loads(p.read_text()).get("status", "?") if p.exists() else "missing" for p in paths]
    ended = [p.exists() and "ended_wall_ns" in json.loads(p.read_text()) for p in paths]
    summary = (out / "summary.json").exists()
    good = all(s == "terminated" for s in statuses) and all(ended) and summary
    return {"statuses": statuses, "summaries": [summary], "problems": 0, "good": good}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--real", action="store_true", help="kill charllm train itself (slow)")
    ap.add_argument("--rank", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args.rank)
        return
    results = []
    for i in range(args.tries):
        with tempfile.TemporaryDirectory(prefix="kill-launcher-") as tmp:
            r = (one_real_try if args.real else one_try)(Path(tmp), args.nproc)
        results.append(r)
        print(f"try {i + 1}: {'good' if r['good'] else 'BAD '} statuses={r['statuses']} "
              f"summaries={r['summaries']} problems={r['problems']}", flush=True)  # fmt: skip
    good = sum(1 for r in results if r["good"])
    print(f"{good} of {len(results)} tries left every rank terminated, closed, with its summary")
    print("BENCH_JSON " + json.dumps({"tries": len(results), "good": good}))


if __name__ == "__main__":
    main()
