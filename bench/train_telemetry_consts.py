"""bench_train_telemetry.py's settings: targets, rates, step counts, arms."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_FREE = 1.005
REFERENCE_BARE_THREAD = {"free": 1.002, "busy": 1.035}
TRIM = 0.10
HZ = 100.0
FLUSH_INTERVAL_S = 0.5  # TelemetrySession's default, which run_rank uses
QUIET_CORES = 0.15  # a round is "quiet" when other processes used less than this many cores
MIN_QUIET_ROUNDS = 10
TIMINGS = ("iteration", "loop_step", "main_cpu")
DECOMPOSE_ARMS = ["off", "bare", "proc", "marks", "sampler", "session", "on"]
BUSY_MACHINE_CORES = 0.3  # mean load of other processes above which no verdict is given
# --interleave step
STEP_PAIRS = {"quick": 40, "full": 400}  # ON/OFF step pairs per configuration (~40-85 ms a step)
STEP_WARM_QUADS = 3  # untimed ABBA quads after the session opens (warms the ON path)
SEGMENT_STEPS = 32  # other processes' load is measured per segment of about this many steps
ORDERS = ("abba", "random")
CONTRASTS = ("all", "thread", "process", "figures")
