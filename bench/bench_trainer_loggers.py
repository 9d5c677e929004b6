"""What the charllm/* scalars cost Lightning's TensorBoardLogger, logged every step against at
Lightning's ``log_every_n_steps`` cadence (``LoggersObserver(every=...)``, issue #40).

One step report with every numeric field set (as a GPU run's, ~25 scalars) goes through
:class:`~charllm_nemo.integrations._common.LoggersObserver` into a ``TensorBoardLogger`` for
``--steps`` steps; blocks of ``every=1`` and ``every=--every`` alternate (ABBA) in one process.
CPU is the process's (``time.process_time``: the calling thread plus tensorboard's writer
thread, which computes each record's CRC in Python), the writer flushed at the end of each
block so its work lands in the block that made it.

    .venv-nemo/bin/python bench/bench_trainer_loggers.py --steps 200 --blocks 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from charllm_nemo.integrations._common import LoggersObserver
from charllm_nemo.steps.report import StepReport


def report(step: int) -> StepReport:
    r = StepReport(step=step, loss=2.5, step_time_s=0.028, grad_norm=1.2, num_microbatches=4)
    for name in ("tokens_per_s", "samples_per_s", "model_tflops_per_gpu", "hardware_tflops_per_gpu"):
        setattr(r, name, 123.4)
    r.mfu, r.energy_j, r.power_avg_w, r.power_peak_w = 0.41, 19.5, 650.0, 700.0
    r.temp_gpu_peak_c, r.throttle_share, r.sampling_gap, r.ranks_reporting = 71.0, 0.0, 0.0, 8
    r.figures = {"power_swing_w": 120.0, "power_ramp_up_w_s": 9e3, "power_ramp_down_w_s": 8e3}
    return r


def block(logger: object, every: int, steps: int, first: int) -> float:
    obs = LoggersObserver(logger.log_metrics, "charllm/", every=every)  # type: ignore[attr-defined]
    reports = [report(first + s) for s in range(steps)]
    c = time.process_time()
    for r in reports:
        obs.on_step(r)
    obs.close("complete")
    logger.experiment.flush()  # type: ignore[attr-defined]
    return (time.process_time() - c) / steps


def main() -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=6, help="ABBA blocks (each: every=1 and every=N)")
    ap.add_argument("--every", type=int, default=10, help="the trainer's log_every_n_steps")
    args = ap.parse_args()
    logger = TensorBoardLogger(tempfile.mkdtemp(prefix="bench-tb-"), name="bench")
    n_scalars = len(
        [v for v in report(0).to_dict().values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    )  # LoggersObserver's rule
    block(logger, 1, 20, 0)  # warm-up: the event file open, the protobuf classes loaded
    each, cadence = [], []
    step = 100
    for b in range(args.blocks):
        order = (1, args.every) if b % 2 == 0 else (args.every, 1)
        for every in order:
            cost = block(logger, every, args.steps, step)
            step += args.steps
            (each if every == 1 else cadence).append(cost)
    a, c = statistics.median(each), statistics.median(cadence)
    print(
        f"{n_scalars} charllm/* scalars a step to Lightning's TensorBoardLogger, {args.blocks} blocks "
        f"of {args.steps} steps each way; load average {os.getloadavg()[0]:.1f}"
    )
    print(f"every step:          {a * 1e3:.3f} ms CPU a step (median of blocks)")
    print(f"every {args.every} steps (Lightning's log_every_n_steps): {c * 1e3:.3f} ms CPU a step")
    print(f"saved {(a - c) * 1e3:.3f} ms a step; ratio {a / c:.1f}x")


if __name__ == "__main__":
    main()
