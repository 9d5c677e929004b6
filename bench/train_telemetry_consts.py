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
PROFILE_FUNCS = {
    # (file suffix, function): label
    ("steps/telemetry.py", "_figures"): "StepTelemetry._figures (an earlier step's figures)",
    ("telemetry/session.py", "step_figures"): "  session.step_figures",
    ("telemetry/session.py", "live_rows"): "  session.live_rows",
    ("telemetry/sampler.py", "rows_to_arrays"): "  sampler.rows_to_arrays",
    ("telemetry/attribution.py", "attribute_windows"): "  attribution.attribute_windows",
    ("steps/marks.py", "start"): "MarkTimer.start (phase begin)",
    ("steps/marks.py", "stop"): "MarkTimer.stop (phase end)",
    ("steps/marks.py", "begin_step"): "StepMarker.begin_step",
    ("steps/marks.py", "end_step"): "StepMarker.end_step",
    ("telemetry/windows.py", "begin"): "  WindowRecorder.begin",
    ("telemetry/windows.py", "end"): "  WindowRecorder.end",
    ("telemetry/windows.py", "record"): "  WindowRecorder.record",
    ("devices/synthetic.py", "__call__"): "  MarkActivity listener",
    ("steps/telemetry.py", "end_step"): "StepTelemetry.end_step (all of it, both arms)",
    ("steps/telemetry.py", "_exchange"): "  StepTelemetry._exchange (the one vector over the ranks)",
}
