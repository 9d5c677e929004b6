"""Why a telemetry process on ANOTHER core slows training: controlled loads beside tiny_gpt.

Run:  .venv/bin/python bench/bench_side_load.py [--pairs 300] [--rounds 2] [--loads none,spin,mem,...]

``bench_train_telemetry.py --contrast process`` found the telemetry process slowing a tiny_gpt
step by 1-3 % on this 2-core VM although it runs on the other, otherwise idle core. This bench
asks what kind of work does that. One process trains ``tiny_gpt`` on one thread (built the way
``train/loop.py`` builds it, no telemetry); beside it runs a side process with a known load,
frozen (SIGSTOP) for OFF steps and running (SIGCONT) for ON steps, in ABBA quads, every step
timed, as the step mode of bench_train_telemetry does. Loads (``--loads``, comma-separated, each
run ``--rounds`` times, in turn):

* ``none``: the side process sleeps (the control: expect 1.000);
* ``wake``: wakes every 1 ms and does nothing (timer wake-ups, scheduler, the VM's IPIs);
* ``spin``: a pure-Python busy loop of 150 µs every 5 ms (CPU time, almost no memory);
* ``hog``: a pure-Python busy loop that never sleeps (a whole core of CPU time, almost no
  memory: if it slows training, the two vCPUs share more than caches, e.g. one physical core);
* ``mem``: 150 µs of ``b += 1`` over a 4 MB numpy array every 5 ms (memory traffic);
* ``py``: 330 µs of dict / list / sort work in pure Python every 34 ms;
* ``fig``: one live figure computation (``attribute_windows`` of the step API's figures,
  ``STEP_FIGURE_KEYS``, over 12 samples; of five figures it was ~330 µs hot before commit
  1cd3820, ~160 µs after 59f630e) every 34 ms: what the telemetry process does per tiny_gpt step.

Per load: the ON/OFF ratio of the median step time with a 95 % bootstrap interval over quads,
the per-quad geometric mean with its t interval, and the side process's CPU as a share of the
ON steps' time. The last line is ``BENCH_JSON {...}``.

Reading it: a load that uses CPU on the other core but touches little memory (``spin``) should
leave the training step alone; if ``mem`` or ``fig`` slow it at a similar CPU share, the cost
travels through the shared cache and memory, not through the CPU time (docs/bench-train.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train_telemetry import free_port, process_cpu_ns, summarize_units

FIG_SETUP = """
import numpy as np
from charllm_nemo.telemetry.attribution import attribute_windows
from charllm_nemo.sinks.keys import STEP_FIGURE_KEYS
n = 12
t = np.arange(n, dtype=np.int64) * 10_000_000
cols = {"t_mono_ns": t, "power_instant_w": np.linspace(300, 500, n), "power_avg_w": np.linspace(300, 500, n),
        "energy_mj": (np.arange(n) * 4000).astype(np.int64), "temp_gpu_c": np.linspace(50, 60, n),
        "throttle_reasons": np.zeros(n, np.int64)}
win = {"t_begin_mono_ns": np.array([15_000_000]), "t_end_mono_ns": np.array([95_000_000])}
"""

LOADS = {
    "none": "import time\nwhile True:\n    time.sleep(1)",
    "wake": "import time\nwhile True:\n    time.sleep(0.001)",
    "spin": (
        "import time\nwhile True:\n    t = time.perf_counter()\n"
        "    while time.perf_counter() - t < 150e-6:\n        pass\n    time.sleep(0.005)"
    ),
    "hog": "while True:\n    pass",
    "mem": (
        "import time, numpy as np\nb = np.ones(4 * 131072)\nwhile True:\n    t = time.perf_counter()\n"
        "    while time.perf_counter() - t < 150e-6:\n        b += 1.0\n    time.sleep(0.005)"
    ),
    "py": (
        "import time\nwhile True:\n    t = time.perf_counter()\n    while time.perf_counter() - t < 330e-6:\n"
        "        d = {i: (i, str(i), [i] * 3) for i in range(50)}\n"
        "        s = sorted(d.items(), key=lambda x: -x[0])\n    time.sleep(0.034)"
    ),
    "fig": FIG_SETUP
    + "import time\nwhile True:\n"
    + "    attribute_windows(cols, win, figures=STEP_FIGURE_KEYS)\n    time.sleep(0.034)",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=300, help="ON/OFF pairs per load, round (default 300)")
    ap.add_argument("--rounds", type=int, default=2, help="times each load is run, in turn (default 2)")
    ap.add_argument("--loads", default=",".join(LOADS), help="comma-separated, from: " + ", ".join(LOADS))
    args = ap.parse_args()
    loads = [x.strip() for x in args.loads.split(",") if x.strip()]
    bad = [x for x in loads if x not in LOADS]
    if bad or not loads:
        ap.error(f"--loads: unknown {bad}; choose from {', '.join(LOADS)}")
    if args.pairs < 2 or args.rounds < 1:
        ap.error("--pairs must be at least 2 and --rounds at least 1")

    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from charllm_nemo.train.config import BatchConfig, LaunchConfig, TelemetryConfig, TrainConfig
    from charllm_nemo.train.data import DataLayout, MicrobatchIterator, build_train_dataset
    from charllm_nemo.train.dist import init_distributed, rank_env, shutdown_distributed
    from charllm_nemo.train.loop import _forward_step
    from charllm_nemo.train.model import build_model
    from charllm_nemo.train.presets import model_preset
    from charllm_nemo.train.validate import validate

    n_quads = (args.pairs + 1) // 2
    steps = 10 + len(loads) * args.rounds * 4 * n_quads
    cfg = TrainConfig(
        model=model_preset("tiny_gpt"),
        batch=BatchConfig(micro_batch_size=1, global_batch_size=4, train_steps=steps),
        telemetry=TelemetryConfig(enabled=False),
        launch=LaunchConfig(device="cpu"),
    )
    layout = validate(cfg, world_size=1, device="cpu")
    init_distributed(cfg, rank_env(cfg), "cpu")
    b = cfg.batch
    bundle = build_model(cfg, on_cpu=True, pipeline_layout=layout.mcore_pipeline_layout())
    dl = DataLayout(b.micro_batch_size, b.global_batch_size, 1, 0)
    data = MicrobatchIterator(build_train_dataset(cfg, steps * b.global_batch_size), dl, steps, "cpu")
    model, forward_backward = bundle.chunks[0], get_forward_backward_func()

    def step() -> float:
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        bundle.optimizer.zero_grad()
        forward_backward(
            forward_step_func=_forward_step,
            data_iterator=data,
            model=model,
            num_microbatches=dl.num_microbatches,
            seq_length=cfg.model.seq_length,
            micro_batch_size=b.micro_batch_size,
            forward_only=False,
        )
        bundle.optimizer.step()
        return time.perf_counter() - t0

    for _ in range(10):
        step()
    print(f"tiny_gpt, one training thread; {n_quads} ABBA quads per load and round; {loads}", flush=True)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in loads}
    for r in range(args.rounds):
        for name in loads:
            side = subprocess.Popen([sys.executable, "-c", LOADS[name]])
            try:
                time.sleep(0.5)  # its imports, before the first timed step
                running = True
                units: list[tuple[list[float], list[float]]] = []
                on_s = 0.0
                cpu0 = process_cpu_ns(side.pid)
                for _ in range(n_quads):
                    unit: tuple[list[float], list[float]] = ([], [])
                    for arm in ("on", "off", "off", "on"):
                        if arm == "off" and running:
                            os.kill(side.pid, signal.SIGSTOP)
                            running = False
                        elif arm == "on" and not running:
                            os.kill(side.pid, signal.SIGCONT)
                            running = True
                        t = step()
                        unit[0 if arm == "on" else 1].append(t)
                        on_s += t if arm == "on" else 0.0
                    units.append(unit)
                if not running:
                    os.kill(side.pid, signal.SIGCONT)
                cpu_share = (process_cpu_ns(side.pid) - cpu0) / 1e9 / on_s
            finally:
                side.kill()
                side.wait()
            it = summarize_units(units)
            res = {
                "ratio_median": it["ratio_median"],
                "ratio_median_ci95": it["ratio_median_ci95"],
                "ratio_paired_mean": it["ratio_paired_mean"],
                "ratio_paired_mean_ci95": it["ratio_paired_mean_ci95"],
                "median_off_ms": it["median_off_ms"],
                "side_cpu_share_of_on": cpu_share,
            }
            results[name].append(res)
            lo, hi = res["ratio_median_ci95"]
            glo, ghi = res["ratio_paired_mean_ci95"]
            print(
                f"round {r + 1} {name:5s}: ON/OFF median {res['ratio_median']:.4f} [{lo:.4f}, {hi:.4f}], "
                f"per-quad geo. mean {res['ratio_paired_mean']:.4f} [{glo:.4f}, {ghi:.4f}]; "
                f"OFF {res['median_off_ms']:.1f} ms; side process CPU {100 * cpu_share:.1f} % of ON time",
                flush=True,
            )
    shutdown_distributed()
    print("per load, over rounds: geo. mean of the per-quad ratios (median of rounds), side CPU share")
    for name in loads:
        geo = statistics.median(x["ratio_paired_mean"] for x in results[name])
        share = statistics.median(x["side_cpu_share_of_on"] for x in results[name])
        print(f"  {name:5s}: {geo:.4f}  ({100 * share:.1f} % CPU)")
    print("BENCH_JSON " + json.dumps({"bench": "side_load", "pairs": args.pairs, "results": results}))


if __name__ == "__main__":
    main()
