"""Training-step cost of the W&B sink (offline): steps with the sink on versus off, interleaved.

Run:  .venv/bin/python bench/bench_wandb.py [--quick] [--pairs N] [--block-steps N] [--ranks R]

A step is a stand-in for a ~50 ms training step: a float64 matmul loop (BLAS, GIL released)
plus a pure-Python part that holds the GIL (``--python-ms``, as a framework's per-step Python
does), so the sink's thread competes for both the cores and the GIL.

* ON:  after the work, what the training loop does on rank 0 with ``logger=wandb``:
  ``AsyncSink.log_figures(step, summary, gathered)`` with ``--ranks`` ranks' figure vectors;
  the sink's thread builds the keys (27 per rank plus aggregates, throughput and loss) and
  writes the W&B run (offline, in a temporary directory).
* OFF: the work only (``logger=none``: no keys built, nothing logged).

One W&B run for the whole benchmark (started before, finished after, outside the timed steps).
Blocks of ``--block-steps`` steps in pairs, the order inside each pair drawn at random; the
time of a step is ``time.perf_counter()`` around the whole step. Two configurations, each in
its own child process: ``free`` (OPENBLAS/OMP threads = 1: a core left for the sink thread, as
on a GPU node) and ``busy`` (BLAS on every core). Figures: ON/OFF ratio of the medians and of
the 10 % trimmed means, the mean of per-pair ratios of block medians, the caller's cost of one
``log_figures`` call (µs), the sink's report (dropped, errors)
and the .wandb file's size. The last line printed is ``BENCH_JSON {...}``.

This machine has 2 cores and is noisy: only the side-by-side ratio means something.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRIM = 0.10


def _trimmed_mean(xs: list[float], trim: float = TRIM) -> float:
    s = sorted(xs)
    k = int(len(s) * trim)
    core = s[k : len(s) - k] or s
    return statistics.fmean(core)


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from charllm_nemo.sinks.config import LoggerConfig, build_sink
    from charllm_nemo.sinks.keys import STEP_FIGURE_KEYS, step_metrics, unpack_gathered

    tmp = Path(tempfile.mkdtemp(prefix="bench-wandb-"))
    for k, v in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DATA_DIR": str(tmp / "data"),
        "WANDB_CACHE_DIR": str(tmp / "cache"),
        "WANDB_CONFIG_DIR": str(tmp / "config"),
    }.items():
        os.environ[k] = v
    os.environ.pop("WANDB_API_KEY", None)

    rng = np.random.default_rng(0)
    a = rng.random((args.matrix, args.matrix))

    def work() -> None:
        t_end = time.perf_counter() + args.python_ms / 1e3
        x = 0
        while time.perf_counter() < t_end:  # GIL held, like a framework's Python per step
            x += 1
        for _ in range(args.matmuls):
            a @ a

    # Calibrate the matmul count so a step is about --step-ms.
    for _ in range(3):
        a @ a
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    per = (time.perf_counter() - t0) / 20
    args.matmuls = max(1, round((args.step_ms - args.python_ms) / 1e3 / per))

    cfg = LoggerConfig(
        name="wandb",
        project="bench",
        upload_artifact=False,
        log_windows_table=False,
        settings={"x_disable_stats": True, "console": "off", "disable_git": True},
    )
    sink = build_sink(cfg, rank=0, run_dir=tmp / "run")
    assert sink is not None
    sink.start(
        {"model": {"name": "bench"}, "parallel": {"tp": 1, "pp": 1, "dp": args.ranks}},
        {"world_size": args.ranks, "backend": "synthetic"},
    )
    n_fig = len(STEP_FIGURE_KEYS)
    summary = {"loss": 2.0, "step_time_s": 0.05, "tokens_per_s": 1e5, "mfu": 0.4}

    def gathered(step: int) -> list[list[float]]:
        return [[100.0 + r + step * 1e-3 + i for i in range(n_fig)] for r in range(args.ranks)]

    times: dict[str, list[float]] = {"on": [], "off": []}
    block_medians: list[tuple[float, float]] = []
    call_us: list[float] = []
    n_keys = len(step_metrics(0, summary=summary, per_rank=unpack_gathered(gathered(0))))
    step = 0
    for _ in range(args.warmup):
        work()
    for _pair in range(args.pairs):
        order = ["on", "off"]
        random.shuffle(order)
        med: dict[str, float] = {}
        for arm in order:
            ts: list[float] = []
            for _ in range(args.block_steps):
                t0 = time.perf_counter()
                work()
                if arm == "on":
                    g = gathered(step)  # what the step API hands rank 0 (outside the call)
                    c0 = time.perf_counter()
                    sink.log_figures(step, summary, g)
                    call_us.append((time.perf_counter() - c0) * 1e6)
                ts.append(time.perf_counter() - t0)
                step += 1
            times[arm].extend(ts)
            med[arm] = statistics.median(ts)
        block_medians.append((med["on"], med["off"]))
    t0 = time.perf_counter()
    sink.finish(tmp / "run", timeout_s=60)
    finish_s = time.perf_counter() - t0
    wandb_files = list((tmp / "run").rglob("run-*.wandb"))
    wandb_bytes = wandb_files[0].stat().st_size if wandb_files else None
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "config": args.config,
        "step_ms_off_median": 1e3 * statistics.median(times["off"]),
        "ratio_median": statistics.median(times["on"]) / statistics.median(times["off"]),
        "ratio_trimmed_mean": _trimmed_mean(times["on"]) / _trimmed_mean(times["off"]),
        "ratio_pairs_mean": statistics.fmean(on / off for on, off in block_medians),
        "log_step_call_us_median": statistics.median(call_us),
        "log_step_call_us_p99": sorted(call_us)[int(0.99 * (len(call_us) - 1))],
        "keys_per_step": n_keys,
        "steps_logged": len(call_us),
        "finish_s": finish_s,
        "report": sink.report.to_dict(),
        "wandb_file_bytes": wandb_bytes,
        "matmuls_per_step": args.matmuls,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--block-steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--python-ms", type=float, default=10.0)
    p.add_argument("--matrix", type=int, default=256)
    p.add_argument("--quick", action="store_true", help="3 pairs of 10 steps")
    p.add_argument("--configs", default="free,busy")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json-only", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.pairs, args.block_steps = 3, 10
    if args.child:
        args.config = args.child
        args.matmuls = 1
        print("CHILD_JSON " + json.dumps(_child(args)), flush=True)
        return
    results = []
    for config in args.configs.split(","):
        env = dict(os.environ)
        if config == "free":
            env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        cmd = [sys.executable, __file__, "--child", config, *sys.argv[1:]]
        out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=True).stdout
        line = next(x for x in out.splitlines() if x.startswith("CHILD_JSON "))
        r = json.loads(line[len("CHILD_JSON ") :])
        results.append(r)
        if not args.json_only:
            rep = r["report"]
            print(
                f"{config:5s}: step {r['step_ms_off_median']:.1f} ms off; "
                f"ON/OFF median {r['ratio_median']:.4f}, "
                f"trimmed mean {r['ratio_trimmed_mean']:.4f}, pairs {r['ratio_pairs_mean']:.4f}; "
                f"log_figures {r['log_step_call_us_median']:.0f} µs median "
                f"({r['log_step_call_us_p99']:.0f} p99) "
                f"for {r['keys_per_step']} keys; {rep['logged']} logged, {rep['dropped']} dropped, "
                f"{rep['errors']} errors; finish {r['finish_s']:.2f} s; .wandb {r['wandb_file_bytes']} B"
            )
    print("BENCH_JSON " + json.dumps({"bench": "wandb_sink", "results": results}))


if __name__ == "__main__":
    main()
