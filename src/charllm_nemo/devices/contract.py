"""The device contract: what every backend's ``Device.read()`` returns, by name, in which units.

A backend returns one value per entry of :data:`METRICS`, in that order (a :data:`Reading`),
with ``None`` for a metric the device does not support. Units live in the names (``power_w``,
``energy_mj``, ``temp_c``, ``clock_mhz``, ``*_bytes``, ``*_ns``); vendor units are converted
once, at the backend boundary. Throttle (clock-event) reasons are a bitmask with NVML's bit
values (:data:`THROTTLE_BITS`); other backends map into them. In memory (sampler buffers, the
arrays the attribution takes) a null float is ``NaN`` and a null int is :data:`INT_NULL`; on
disk (Parquet) both are real nulls. ``charllm_nemo.telemetry.schema`` re-exports all of it, with
the columns the telemetry layer adds (timestamps, windows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

INT_NULL = -1
"""In-memory null for int metrics. Every int metric is a counter, a size or a bitmask, all >= 0."""

MetricKind = Literal["float", "int"]


@dataclass(frozen=True, slots=True)
class Metric:
    """One per-sample device metric.

    ``cumulative`` marks a counter that only grows (energy, traffic bytes, violation time):
    windows use its deltas, never its absolute value.
    """

    name: str
    kind: MetricKind
    unit: str
    description: str
    cumulative: bool = False


METRICS: tuple[Metric, ...] = (
    Metric(
        "power_instant_w",
        "float",
        "W",
        "instantaneous board power (NVML_FI_DEV_POWER_INSTANT; AMD current socket power)",
    ),
    Metric(
        "power_avg_w",
        "float",
        "W",
        "vendor-averaged board power (NVML: 1 s average on Hopper; AMD average socket power)",
    ),
    Metric("power_memory_w", "float", "W", "memory-scope power where the device reports it"),
    Metric("energy_mj", "int", "mJ", "hardware energy counter, monotonic since driver load", cumulative=True),
    Metric("temp_gpu_c", "float", "degC", "GPU die temperature (AMD: edge)"),
    Metric("temp_hbm_c", "float", "degC", "HBM / memory temperature"),
    Metric("temp_hotspot_c", "float", "degC", "hotspot / junction temperature (AMD)"),
    Metric("clock_sm_mhz", "float", "MHz", "SM / GFX clock"),
    Metric("clock_mem_mhz", "float", "MHz", "memory clock"),
    Metric("throttle_reasons", "int", "bitmask", "clock-event (throttle) reasons, bits in THROTTLE_REASONS"),
    Metric(
        "violation_power_ns",
        "int",
        "ns",
        "cumulative time clocks were held below max by the power limit",
        cumulative=True,
    ),
    Metric(
        "violation_thermal_ns",
        "int",
        "ns",
        "cumulative time clocks were held below max by a thermal limit",
        cumulative=True,
    ),
    Metric("util_gpu_pct", "float", "%", "GPU (AMD: GFX) activity"),
    Metric("util_mem_pct", "float", "%", "memory controller activity"),
    Metric("mem_used_bytes", "int", "B", "device memory in use"),
    Metric("power_limit_w", "float", "W", "enforced power limit"),
    Metric("pcie_tx_bytes", "int", "B", "PCIe bytes transmitted, cumulative 64-bit counter", cumulative=True),
    Metric("pcie_rx_bytes", "int", "B", "PCIe bytes received, cumulative 64-bit counter", cumulative=True),
    Metric(
        "nvlink_tx_bytes",
        "int",
        "B",
        "NVLink (AMD: XGMI) bytes transmitted, all links, cumulative",
        cumulative=True,
    ),
    Metric(
        "nvlink_rx_bytes",
        "int",
        "B",
        "NVLink (AMD: XGMI) bytes received, all links, cumulative",
        cumulative=True,
    ),
    *(
        Metric(f"violation_{name}_ns", "int", "ns", f"cumulative time {what}", cumulative=True)
        for name, what in (
            ("sync_boost", "clocks were held down to match the sync-boost group"),
            ("board_limit", "clocks were held down by a board limit"),
            ("low_util", "clocks were held down by the low-utilization policy"),
            ("reliability", "clocks were held down by the reliability policy"),
            ("total_app_clocks", "clocks were below the application clocks, any reason"),
            ("total_base_clocks", "clocks were below the base clocks, any reason"),
            ("sw_thermal", "the sw_thermal clock-event reason held clocks down"),
            ("hw_thermal", "the hw_thermal clock-event reason held clocks down"),
            ("hw_power_brake", "the hw_power_brake clock-event reason held clocks down"),
        )
    ),
    *(
        Metric(
            f"violation_{name}_ts_us",
            "int",
            "us",
            f"the driver's own timestamp of violation_{name}_ns's value (wall clock, us since the epoch)",
            cumulative=True,
        )
        for name in (
            "power",
            "thermal",
            "sync_boost",
            "board_limit",
            "low_util",
            "reliability",
            "total_app_clocks",
            "total_base_clocks",
            "sw_thermal",
            "hw_thermal",
            "hw_power_brake",
        )
    ),
    Metric(
        "power_module_w",
        "float",
        "W",
        "instantaneous module power (NVML_POWER_SCOPE_MODULE: the whole Grace module, GPU + CPU + "
        "memory, on GH200 / GB200) where the device reports it",
    ),
    Metric(
        "power_module_avg_w",
        "float",
        "W",
        "module power averaged by the driver (1 s; NVML_POWER_SCOPE_MODULE) where the device reports it",
    ),
)

METRIC_NAMES: tuple[str, ...] = tuple(m.name for m in METRICS)
METRIC_INDEX: dict[str, int] = {name: i for i, name in enumerate(METRIC_NAMES)}
FLOAT_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS if m.kind == "float")
INT_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS if m.kind == "int")

Reading = tuple[float | int | None, ...]
"""What ``Device.read()`` returns: one value per METRICS entry, in order; None = unsupported."""

# Throttle (clock-event) reasons. The bit values are NVML's; other backends map into them.
THROTTLE_REASONS: tuple[tuple[str, int], ...] = (
    ("idle", 0x1),
    ("applications_clocks", 0x2),
    ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8),
    ("sync_boost", 0x10),
    ("sw_thermal", 0x20),
    ("hw_thermal", 0x40),
    ("hw_power_brake", 0x80),
    ("display_clocks", 0x100),
    ("board_limit", 0x200),  # nvmlClocksThrottleReasonBoardLimit (no ClocksEvent alias in pynvml)
    ("reliability", 0x400),  # nvmlClocksThrottleReasonReliability
)
THROTTLE_BITS: dict[str, int] = dict(THROTTLE_REASONS)

# Reasons that mean "the hardware is slowing us down", as opposed to idle or a clock setting.
LIMITING_REASONS: tuple[str, ...] = (
    "sw_power_cap",
    "hw_slowdown",
    "sw_thermal",
    "hw_thermal",
    "hw_power_brake",
    "board_limit",
    "reliability",
)

VIOLATION_COUNTERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("power", ("sw_power_cap",)),
    ("thermal", ("sw_thermal", "hw_thermal")),
    ("sync_boost", ("sync_boost",)),
    ("board_limit", ("board_limit",)),
    ("low_util", ()),
    ("reliability", ("reliability",)),
    ("total_app_clocks", ()),
    ("total_base_clocks", ()),
    ("sw_thermal", ("sw_thermal",)),
    ("hw_thermal", ("hw_thermal",)),
    ("hw_power_brake", ("hw_power_brake",)),
)
"""The driver's per-reason throttle time counters: ``violation_<name>_ns`` (cumulative ns) with
its value's timestamp ``violation_<name>_ts_us``, and the reason bits whose sampled time (any of
them set, sample-and-hold) the counter is compared with; () = no bit matches the counter."""


def decode_throttle(mask: int | None) -> tuple[str, ...]:
    """Names of the reasons set in a throttle bitmask; empty for 0, None or INT_NULL."""
    if mask is None or mask <= 0:
        return ()
    return tuple(name for name, bit in THROTTLE_REASONS if mask & bit)
