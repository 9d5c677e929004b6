"""A stand-in for charllm_nemo.train.loop.run_rank, for the launcher tests (no torch).

Selected with CHARLLM_WORKER_TARGET=_fake_worker:run (tests/train on PYTHONPATH). What it does
is set by CHARLLM_FAKE_MODE:
  ok            write <out_dir>/fake/rank<R>.json with the rank's environment and return 0
  fail:<R>:<C>  rank R exits with code C once the others are ready; the others wait to be stopped
  hang          write <out_dir>/fake/rank<R>.ready, then wait; on SIGTERM (SystemExit from the
                worker's handler) write <out_dir>/fake/rank<R>.flushed and exit
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def run(cfg: Any) -> int:
    out = Path(cfg.telemetry.out_dir) / "fake"
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    mode = os.environ.get("CHARLLM_FAKE_MODE", "ok")
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    env = {k: os.environ.get(k) for k in keys}
    if mode == "ok":
        info = {
            "env": env,
            "model": cfg.model.name,
            "device": cfg.launch.device,
            "tp": cfg.parallel.tp,
            "extra": cfg.extra,
        }
        (out / f"rank{rank}.json").write_text(json.dumps(info))
        print(f"fake rank {rank} done", flush=True)
        return 0
    if mode.startswith("fail:"):
        _, bad, code = mode.split(":")
        if rank == int(bad):
            # once every other rank runs (its .ready written): on a loaded machine a rank still
            # importing when the launcher stops it cannot have its SIGTERM handler yet
            world = int(os.environ.get("WORLD_SIZE", "1"))  # unset: the worker run alone, in-process
            others = [out / f"rank{r}.ready" for r in range(world) if r != rank]
            deadline = time.monotonic() + 120
            while not all(p.exists() for p in others) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
            print(f"fake rank {rank} failing with {code}", flush=True)
            return int(code)
        _wait_forever(out, rank)
    if mode == "hang":
        _wait_forever(out, rank)
    if mode == "unavailable":
        from charllm_nemo.errors import BackendUnavailable

        raise BackendUnavailable("no NVIDIA driver found (a stand-in)")
    raise ValueError(f"unknown CHARLLM_FAKE_MODE {mode!r}")


def _wait_forever(out: Path, rank: int) -> None:
    (out / f"rank{rank}.ready").write_text("ready")
    try:
        while True:
            time.sleep(0.05)
    finally:
        # Runs when the worker's SIGTERM handler unwinds the stack: the "telemetry flush".
        (out / f"rank{rank}.flushed").write_text("flushed")
