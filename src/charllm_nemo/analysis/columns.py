"""The columns of the ``ranks``, ``nodes`` and ``runs`` tables, declared once (issue #45).

Both engines run one implementation of every reduction: the per-rank reductions are numpy in
analysis/rank_tables.py (over the attribution's timelines), run in this process or in worker
processes by the local engine and in Spark's Python workers by ``--engine spark``
(analysis/spark.py); the reductions over other tables' rows are the SQL expressions below, which
the driver's DuckDB runs for both engines (analysis/run_summary.py). This module names each
column and says what it is: tests/analysis/test_columns.py fails when a table holds a column
declared nowhere here or lacks one declared, and when ``--engine spark`` writes any table with
columns other than the local engine's.
"""

from __future__ import annotations

from dataclasses import dataclass

from charllm_nemo.analysis.run_info import INFO_TYPES
from charllm_nemo.telemetry.schema import THROTTLE_REASONS, VIOLATION_COUNTERS


@dataclass(frozen=True)
class Column:
    """One column of a table and what it is."""

    name: str
    definition: str


RANK_COLUMNS: tuple[Column, ...] = (
    Column("run", "the run's key (its path below the analysed folder)"),
    Column("rank", "the rank"),
    Column("host", "the rank's host, from its manifest"),
    Column("device_index", "the device"),
    Column("duration_s", "last sample's time - first's"),
    Column("n_samples", "samples (after dropping repeated and null times)"),
    Column("coverage", "share of the span in stretches between samples <= 2 median sample periods"),
    Column("gap_max_s", "longest stretch between consecutive samples"),
    Column("power_avg_w", "time-weighted mean of instant power over its non-null samples"),
    Column("power_peak_w", "highest instant power sampled"),
    Column("temp_gpu_avg_c", "time-weighted mean GPU temperature"),
    Column("temp_gpu_peak_c", "highest GPU temperature sampled"),
    Column("temp_hbm_avg_c", "time-weighted mean HBM temperature"),
    Column("temp_hbm_peak_c", "highest HBM temperature sampled"),
    Column("clock_sm_avg_mhz", "time-weighted mean SM clock"),
    Column("energy_counter_j", "the energy counter's non-negative steps, summed"),
    Column("energy_counter_period_s", "median time between the samples at which the counter changed"),
    Column("energy_counter_resets", "times the energy counter went down"),
    Column("energy_trapezoid_j", "instant power integrated (trapezoids between non-null samples)"),
    Column("energy_disagreement", "(energy_counter_j - energy_trapezoid_j) / energy_trapezoid_j"),
    Column("energy_j", "the attribution's energy over the whole sampled span"),
    Column("energy_bound_j", "the bound on energy_j"),
    Column("energy_method", "how energy_j was measured"),
    *(
        Column(name, f"the {name} counter's non-negative steps, summed")
        for name in ("pcie_tx_bytes", "pcie_rx_bytes", "nvlink_tx_bytes", "nvlink_rx_bytes")
    ),
    *(
        Column(f"throttle_{name}_share", f"share of the span the '{name}' bit was held (sample-and-hold)")
        for name, _ in THROTTLE_REASONS
    ),
    Column("power_limit_w", "median of the power limit samples"),
    *(
        Column(f"throttle_{name}_per_min", f"times a minute the '{name}' bit turned on")
        for name, _ in THROTTLE_REASONS
    ),
    *(
        Column(f"violation_{name}_{kind}", f"{what} (analysis/throttle_counters.py)")
        for name, _ in VIOLATION_COUNTERS
        for kind, what in (
            ("counter_s", f"the driver's '{name}' time counter's increase over its counted segments"),
            ("sampled_s", "time its reason bits were sampled set over the same segments"),
            ("diff_s", "counter_s - sampled_s"),
        )
    ),
)
"""The ``ranks`` table: one row per (run, rank, device) over the whole sampled span."""

NODE_REDUCTIONS: tuple[tuple[str, str], ...] = (
    ("ranks", "count(DISTINCT rank)"),
    ("devices", "count(*)"),
    ("power_avg_w", "sum(power_avg_w)"),
    ("device_power_peak_w", "max(power_peak_w)"),
    ("energy_j", "sum(coalesce(energy_counter_j, energy_trapezoid_j))"),
    ("temp_gpu_avg_c", "avg(temp_gpu_avg_c)"),
    ("temp_gpu_peak_c", "max(temp_gpu_peak_c)"),
    ("temp_gpu_peak_spread_c", "max(temp_gpu_peak_c) - min(temp_gpu_peak_c)"),
    ("clock_sm_avg_mhz", "avg(clock_sm_avg_mhz)"),
    ("clock_sm_avg_min_mhz", "min(clock_sm_avg_mhz)"),
)
"""The ``nodes`` table: per (run, host), each column an aggregate over its ``ranks`` rows."""

NODE_COLUMNS: tuple[Column, ...] = (
    Column("run", "the run"),
    Column("host", "the node"),
    *(Column(name, expr) for name, expr in NODE_REDUCTIONS),
)

RUN_DEVICE_REDUCTIONS: tuple[tuple[str, str], ...] = (
    ("power_avg_sampled_w", "avg(power_avg_w)"),
    ("power_peak_w", "max(power_peak_w)"),
    ("temp_gpu_avg_c", "avg(temp_gpu_avg_c)"),
    ("temp_gpu_peak_c", "max(temp_gpu_peak_c)"),
    ("temp_hbm_avg_c", "avg(temp_hbm_avg_c)"),
    ("temp_hbm_peak_c", "max(temp_hbm_peak_c)"),
    ("clock_sm_avg_mhz", "avg(clock_sm_avg_mhz)"),
    ("devices_sampled", "count(*)"),
)
"""Per run, aggregates over its ``ranks`` rows (each device's whole sampled span)."""

RUN_DERIVED: tuple[tuple[str, str], ...] = (
    ("samples_per_s", "global_batch_size * measured_steps / execution_time_s"),
    ("tokens_per_s", "global_batch_size * seq_length * measured_steps / execution_time_s"),
    (
        "efficiency_samples_per_s_per_mj",
        "(global_batch_size * measured_steps / execution_time_s) / (energy_j / 1e6)",
    ),
    ("tokens_per_j", "global_batch_size * seq_length * measured_steps / energy_j"),
    ("energy_per_sample_j", "energy_j / (global_batch_size * measured_steps)"),
    ("energy_per_token_j", "energy_j / (global_batch_size * seq_length * measured_steps)"),
)
"""Per run, from its description (run_info) and its measured span's figures."""

RUN_COLUMNS: tuple[Column, ...] = (
    *(Column(name, f"the run's description ({kind}; run_info.py)") for name, kind in INFO_TYPES.items()),
    Column("measured_steps", "steps of the measured span (every step but the first)"),
    Column("execution_time_s", "the measured span: first measured step's begin to the last's end"),
    Column("energy_j", "energy of every device over the measured span"),
    Column("energy_bound_j", "sum of the devices' span bounds"),
    Column("energy_methods", "the span energies' methods"),
    Column("devices_without_energy", "devices whose span energy was not measurable"),
    *(Column(name, expr) for name, expr in RUN_DERIVED),
    Column("power_avg_w", "energy_j / execution_time_s / devices with energy"),
    *(Column(name, expr) for name, expr in RUN_DEVICE_REDUCTIONS),
)
"""The ``runs`` table: one row per run."""

TABLE_COLUMNS: dict[str, tuple[Column, ...]] = {
    "ranks": RANK_COLUMNS,
    "nodes": NODE_COLUMNS,
    "runs": RUN_COLUMNS,
}


def names(table: str) -> tuple[str, ...]:
    """The columns declared for ``table``, in order."""
    return tuple(c.name for c in TABLE_COLUMNS[table])


def select_list(reductions: tuple[tuple[str, str], ...], indent: str = "       ") -> str:
    """``expr AS name, ...`` for a SQL SELECT (the DuckDB side of a declaration)."""
    return f",\n{indent}".join(f"{expr} AS {name}" for name, expr in reductions)
