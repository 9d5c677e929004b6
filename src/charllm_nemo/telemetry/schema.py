"""Names, units and types of everything the telemetry layer records.

The device contract (:data:`METRICS`, :data:`Reading`, the throttle bits) lives in
``charllm_nemo.devices.contract`` and is re-exported here; this module adds the columns the
sampler puts around a reading (timestamps, read time, device index, source) and the window
marks' kinds and labels. Units live in the names (``power_w``, ``energy_mj``, ``temp_c``,
``clock_mhz``, ``t_mono_ns``); vendor units are converted once, at the backend boundary.
"""

from __future__ import annotations

from charllm_nemo.devices.contract import (
    FLOAT_METRICS,
    INT_METRICS,
    INT_NULL,
    LIMITING_REASONS,
    METRIC_INDEX,
    METRIC_NAMES,
    METRICS,
    THROTTLE_BITS,
    THROTTLE_REASONS,
    VIOLATION_COUNTERS,
    Metric,
    MetricKind,
    Reading,
    decode_throttle,
)

__all__ = [
    "FLOAT_METRICS",
    "INT_METRICS",
    "INT_NULL",
    "LIMITING_REASONS",
    "METRICS",
    "METRIC_INDEX",
    "METRIC_NAMES",
    "SAMPLE_COLUMNS",
    "STANDARD_PHASES",
    "THROTTLE_BITS",
    "THROTTLE_REASONS",
    "VIOLATION_COUNTERS",
    "WINDOW_KINDS",
    "WINDOW_LABELS",
    "Metric",
    "MetricKind",
    "Reading",
    "decode_throttle",
]

# Per-sample columns the sampler adds around the metrics.
SAMPLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("t_mono_ns", "int64", "CLOCK_MONOTONIC at the start of the read; joins with window marks"),
    ("t_wall_ns", "int64", "wall clock (time.time_ns) at the start of the read, for humans"),
    ("read_ns", "int64", "how long the backend read took"),
    ("device_index", "int16", "the device's index on this host"),
    ("source", "string", "backend that produced the sample: nvml | amdsmi | synthetic"),
)

# Window marks written by the training loop (see telemetry/windows.py).
WINDOW_KINDS: tuple[str, ...] = ("step", "microbatch", "phase")
STANDARD_PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")
WINDOW_LABELS: tuple[str, ...] = ("pp_stage", "tp_rank", "dp_rank", "ep_rank", "cp_rank", "vpp_chunk")
