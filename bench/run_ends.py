"""How each way a `charllm train` run ends leaves its run directory (docs/reliability.md).

    .venv/bin/python bench/run_ends.py [--nproc 2] [--only sigterm,kill_rank] [--tries 1]

Each scenario starts a real local run (tiny_gpt, synthetic telemetry, CPU), waits until rank 0
has reported a few steps, ends it as named, and prints what is on disk: the exit code, the
seconds from the act to the launcher's exit, each rank's manifest status, summary.json's status
and step count, steps.jsonl's line count (and whether every line parses), and leftover
temporaries. Scenarios: complete, sigint (Ctrl-C to the launcher), sigterm (SLURM's preemption
signal to the launcher), kill_rank (SIGKILL to rank 1), kill_launcher (SIGKILL to the launcher
alone: its ranks get the parent-death SIGTERM).
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
from typing import Any

SCENARIOS = ("complete", "sigint", "sigterm", "kill_rank", "kill_launcher")


def _steps(out: Path) -> tuple[int, bool]:
    path = out / "steps.jsonl"
    if not path.is_file():
        return 0, True
    lines = path.read_text(errors="replace").splitlines()
    whole = True
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            whole = False
    return len(lines), whole


def _rank_pids(launcher: int) -> list[int]:
    """The launcher's children (its ranks), by /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        cmdline = (entry / "cmdline").read_text(errors="replace")
        if ppid == launcher and "charllm_nemo.train.worker" in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def run(scenario: str, nproc: int, root: Path) -> dict[str, Any]:
    out = root / scenario
    steps = 5 if scenario == "complete" else 100_000
    argv = [sys.executable, "-m", "charllm_nemo.cli", "train", "model=tiny_gpt", "telemetry=synthetic"]
    argv += [f"nproc={nproc}", f"batch.global_batch_size={4 * nproc}", f"batch.train_steps={steps}"]
    argv += [f"telemetry.out_dir={out}", "logger=none", "launch.device=cpu"]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    acted = None
    if scenario != "complete":
        while _steps(out)[0] < 3 and proc.poll() is None and time.monotonic() - t0 < 300:
            time.sleep(0.2)
        acted = time.monotonic()
        if scenario == "sigint":
            proc.send_signal(signal.SIGINT)
        elif scenario == "sigterm":
            proc.send_signal(signal.SIGTERM)
        elif scenario == "kill_launcher":
            proc.kill()
        elif scenario == "kill_rank":
            victims = [p for p in _rank_pids(proc.pid) if _rank_of(p) == 1] or _rank_pids(proc.pid)[-1:]
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    ended = time.monotonic()
    if scenario == "kill_launcher":  # its ranks outlive it a moment: wait for their manifests
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(
            json.loads((f / "manifest.json").read_text() or "{}").get("status") == "running"
            for f in out.glob("rank=*")
            if (f / "manifest.json").is_file()
        ):
            time.sleep(0.5)
        ended = time.monotonic()
    statuses = {}
    for folder in sorted(out.glob("rank=*")):
        try:
            statuses[folder.name] = json.loads((folder / "manifest.json").read_text()).get("status")
        except (OSError, ValueError) as exc:
            statuses[folder.name] = f"unreadable ({type(exc).__name__})"
    summary: dict[str, Any] = {}
    if (out / "summary.json").is_file():
        summary = json.loads((out / "summary.json").read_text())
    n_lines, whole = _steps(out)
    leftovers = sorted(str(p.relative_to(out)) for p in out.rglob("*.tmp"))
    return {
        "scenario": scenario,
        "rc": proc.returncode,
        "s_to_exit": round(ended - (acted or t0), 1),
        "manifests": statuses,
        "summary": summary.get("status", "absent"),
        "summary_steps": summary.get("steps"),
        "steps_jsonl": n_lines,
        "lines_whole": whole,
        "tmp_left": leftovers,
        "traceback": "Traceback" in err.decode(errors="replace"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--only", default=",".join(SCENARIOS))
    ap.add_argument("--tries", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="charllm-ends-") as tmp:
        for scenario in args.only.split(","):
            for k in range(args.tries):
                print(json.dumps(run(scenario, args.nproc, Path(tmp) / str(k))), flush=True)


if __name__ == "__main__":
    main()
