"""What the live exporter emits: every series' name, type, unit and source, in one table.

Device series keep dcgm-exporter's names (``DCGM_FI_DEV_*``, DCGM 4.6 field names, dcgm's units)
so that existing dashboards and alert rules read them unchanged; per-step figures have their own
``charllm_*`` names. The step number is a gauge, never a label. docs/export.md lists them all.
"""

from __future__ import annotations

from dataclasses import dataclass

from charllm_nemo.devices.contract import THROTTLE_BITS

EXPORT_MODES: tuple[str, ...] = ("off", "prometheus", "textfile", "otlp")
"""``telemetry.export``: off, an HTTP endpoint per rank, node_exporter's textfile directory, or
a push to an OpenTelemetry collector (OTLP/HTTP JSON)."""


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family. ``source``: the sample column (device series) or the step figure it
    reads; ``scale``: multiplies the source value into the family's unit."""

    name: str
    type: str  # gauge | counter
    help: str
    source: str
    scale: float = 1.0


DEVICE_FAMILIES: tuple[Family, ...] = (
    Family("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", "power_avg_w"),
    Family(
        "DCGM_FI_DEV_POWER_USAGE_INSTANT",
        "gauge",
        "Current instantaneous power usage (in W).",
        "power_instant_w",
    ),
    Family(
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "counter",
        "Total energy consumption since boot (in mJ).",
        "energy_mj",
    ),
    Family("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", "temp_gpu_c"),
    Family("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).", "temp_hbm_c"),
    Family("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", "clock_sm_mhz"),
    Family("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).", "clock_mem_mhz"),
    Family("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", "util_gpu_pct"),
    Family("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).", "util_mem_pct"),
    Family("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", "mem_used_bytes", 1 / 2**20),
    Family(
        "DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "gauge", "Current enforced power limit (in W).", "power_limit_w"
    ),
    Family(
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
        "gauge",
        "Current clock event (throttle) reasons, NVML bitmask.",
        "throttle_reasons",
    ),
    Family(
        "DCGM_FI_DEV_POWER_VIOLATION",
        "counter",
        "Throttling duration due to power constraints (in us).",
        "violation_power_ns",
        1e-3,
    ),
    Family(
        "DCGM_FI_DEV_THERMAL_VIOLATION",
        "counter",
        "Throttling duration due to thermal constraints (in us).",
        "violation_thermal_ns",
        1e-3,
    ),
)
"""Per device, the newest value of a sample column (counters: their newest reading)."""

THROTTLE_FAMILIES: tuple[Family, ...] = (
    Family(
        "DCGM_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP_NS",
        "counter",
        "Throttling to not exceed currently set power limits (in ns).",
        "sw_power_cap",
    ),
    Family(
        "DCGM_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST_NS",
        "counter",
        "Throttling to match minimum possible clock across Sync Boost Group (in ns).",
        "sync_boost",
    ),
    Family(
        "DCGM_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN_NS",
        "counter",
        "Throttling to keep GPU and memory temperature below their max operating temperature (in ns).",
        "sw_thermal",
    ),
    Family(
        "DCGM_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN_NS",
        "counter",
        "Throttling due to temperature being too high (in ns).",
        "hw_thermal",
    ),
    Family(
        "DCGM_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN_NS",
        "counter",
        "Throttling due to external power brake assertion trigger (in ns).",
        "hw_power_brake",
    ),
    Family(
        "charllm_clocks_event_reason_hw_slowdown_ns",
        "counter",
        "Time the hw_slowdown clock event bit was set (no DCGM field; in ns).",
        "hw_slowdown",
    ),
    *(
        Family(
            f"charllm_clocks_event_reason_{name}_ns",
            "counter",
            f"Time the {name} clock event bit (0x{THROTTLE_BITS[name]:x}) was set (no DCGM field; in ns).",
            name,
        )
        for name in ("board_limit", "reliability")
    ),
)
"""Per device, time each throttle bit was set since the exporter started (sample-and-hold over
the sampled bitmask, as the attribution counts it). ``source``: a THROTTLE_BITS name."""
assert all(f.source in THROTTLE_BITS for f in THROTTLE_FAMILIES)

STEP_FAMILIES: tuple[Family, ...] = (
    Family("charllm_step", "gauge", "Number of the last step whose figures are exported.", "step"),
    Family(
        "charllm_step_time_seconds", "gauge", "Duration of the last step on this rank (in s).", "step_time_s"
    ),
    Family(
        "charllm_step_energy_joules",
        "gauge",
        "Energy of this device over the last step (in J; attribution's energy_j).",
        "energy_j",
    ),
    Family(
        "charllm_step_power_avg_watts",
        "gauge",
        "Mean power of this device over the last step (in W; energy / duration).",
        "power_avg_w",
    ),
    Family(
        "charllm_step_throttle_share",
        "gauge",
        "Share of the last step any limiting throttle reason was set (0-1).",
        "throttle_share",
    ),
    Family(
        "charllm_step_tokens_per_second",
        "gauge",
        "Job throughput over the last step: tokens per step / this rank's step time (tokens/s).",
        "tokens_per_s",
    ),
    Family(
        "charllm_step_mfu",
        "gauge",
        "Model FLOPs utilisation over the last step (0-1).",
        "mfu",
    ),
    Family(
        "charllm_step_power_swing_watts",
        "gauge",
        "Highest minus lowest instant power of this device sampled in the last step (in W); summed "
        "over a job's series: the job's swing, an upper bound (exact when the ranks peak together).",
        "power_swing_w",
    ),
    Family(
        "charllm_power_dominant_frequency_hertz",
        "gauge",
        "Iteration frequency of this rank, 1 / median of its last 16 step times (in Hz): the "
        "fundamental of the job's power waveform when its power follows the steps.",
        "step_frequency_hz",
    ),
    Family("charllm_steps_total", "counter", "Steps this rank finished since it started.", "steps"),
    Family(
        "charllm_energy_joules_total",
        "counter",
        "Energy of this device summed over the finished steps (in J).",
        "energy_total_j",
    ),
)
"""Per device (the step's figures are per device; the rate ones repeat on each device of a rank)."""

EXPORTER_FAMILIES: tuple[Family, ...] = (
    Family("charllm_exporter_scrapes_total", "counter", "Scrapes this endpoint answered.", "scrapes"),
    Family(
        "charllm_exporter_update_seconds_total",
        "counter",
        "CPU seconds the telemetry process spent updating the exported values.",
        "update_s",
    ),
)
"""Per rank, no device labels."""

ALL_FAMILIES: tuple[Family, ...] = (*DEVICE_FAMILIES, *THROTTLE_FAMILIES, *STEP_FAMILIES, *EXPORTER_FAMILIES)


def metric_names() -> frozenset[str]:
    """Every metric name the exporter can emit (a Grafana query must name one of these)."""
    return frozenset(f.name for f in ALL_FAMILIES)


DEVICE_LABELS: tuple[str, ...] = ("gpu", "UUID", "modelName", "Hostname")
"""dcgm-exporter's own labels, spelled as it spells them (``Hostname`` with a capital H)."""
RANK_LABELS: tuple[str, ...] = (
    "run",
    "slurm_job_id",
    "dl_rank",
    "local_rank",
    "pp_stage",
    "tp_rank",
    "dp_rank",
    "ep_rank",
    "cp_rank",
)
"""The labels we add: the run, the SLURM job, the rank (``dl_rank``: nemo-lens's ``dl.rank``
resource attribute as Prometheus spells an OTel attribute) and the parallel ranks. A label with
no value (no SLURM job, no parallel state) is left out."""
