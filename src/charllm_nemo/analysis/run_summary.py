"""Per run: execution time, energy, the paper's efficiency metric, tokens per joule, MFU; and the
same runs side by side across platforms.

The paper's efficiency metric (MICRO'25, Figures 4, 8, 13; its artifact's
``scripts/visualization/figure_4.py``) is throughput divided by energy: samples per second
(global batch over the execution time) per megajoule of energy spent by all GPUs over that
execution, in ``samples / (s x MJ)``. It grows with speed and shrinks with energy; because the
energy grows with the run's length, it compares runs of the same number of steps (a sweep's
runs). ``energy_per_sample_j`` and ``tokens_per_j`` do not depend on the length.
"""

from __future__ import annotations

from typing import Any

import duckdb
import pyarrow as pa

from charllm_nemo.analysis.columns import NODE_REDUCTIONS, RUN_DERIVED, RUN_DEVICE_REDUCTIONS, select_list

RUN_SQL = f"""
WITH span AS (
    SELECT run,
           max(span_s) AS execution_time_s,
           sum(span_energy_j) AS energy_j,
           count(*) FILTER (WHERE span_energy_j IS NULL OR isnan(span_energy_j)) AS devices_without_energy,
           string_agg(DISTINCT span_energy_method, ',') AS energy_methods,
           max(measured_steps) AS measured_steps,
           -- The mean power of a device over the same span as energy_j and execution_time_s
           -- (energy_j = power_avg_w x execution_time_s x devices with energy): the measured steps.
           sum(span_energy_j) / max(span_s)
               / nullif(count(*) FILTER (WHERE span_energy_j IS NOT NULL AND NOT isnan(span_energy_j)), 0)
               AS power_avg_w,
           -- Bounds add; unknown when a device with energy has none (docs/attribution.md).
           CASE WHEN count(*) FILTER (
                    WHERE NOT isnan(span_energy_j)
                      AND (span_energy_bound_j IS NULL OR isnan(span_energy_bound_j))) = 0
                THEN sum(span_energy_bound_j) FILTER (WHERE NOT isnan(span_energy_j))
           END AS energy_bound_j
    FROM spans GROUP BY run
), dev AS (
    SELECT run,
           {select_list(RUN_DEVICE_REDUCTIONS, "           ")}
    FROM devices GROUP BY run
)
SELECT i.*, s.measured_steps, s.execution_time_s, s.energy_j, s.energy_bound_j, s.energy_methods,
       s.devices_without_energy,
       {select_list(RUN_DERIVED)},
       s.power_avg_w, {", ".join(f"d.{name}" for name, _ in RUN_DEVICE_REDUCTIONS)}
FROM info i LEFT JOIN span s USING (run) LEFT JOIN dev d USING (run)
ORDER BY i.sweep NULLS FIRST, i.model, i.run
"""

PLATFORM_SQL = """
SELECT model, layout, platform, device, world_size, nodes, run,
       samples_per_s, tokens_per_s, efficiency_samples_per_s_per_mj, energy_per_token_j, tokens_per_j,
       samples_per_s / max(samples_per_s) OVER (PARTITION BY model) AS throughput_vs_best,
       efficiency_samples_per_s_per_mj / max(efficiency_samples_per_s_per_mj) OVER (PARTITION BY model)
           AS efficiency_vs_best
FROM runs
WHERE platform IS NOT NULL AND model IS NOT NULL
ORDER BY model, layout, platform
"""


NODE_SQL = f"""
SELECT run, host,
       {select_list(NODE_REDUCTIONS)}
FROM devices GROUP BY run, host ORDER BY run, host
"""


def node_table(con: duckdb.DuckDBPyConnection, devices: pa.Table) -> pa.Table:
    """One row per run and host (node): ranks and devices there, the node's summed average power
    and energy (the counter's, else integrated power), its hottest device and the spread of peak
    temperatures across its devices, average and slowest SM clocks. Needs ``devices`` registered
    (the ``ranks`` table, which carries each rank's host)."""
    needed = {"host", "power_avg_w", "power_peak_w", "energy_counter_j", "energy_trapezoid_j",
              "temp_gpu_avg_c", "temp_gpu_peak_c", "clock_sm_avg_mhz"}  # fmt: skip
    if not needed <= set(devices.column_names):
        return pa.table({"run": pa.array([], pa.string()), "host": pa.array([], pa.string())})
    return con.sql(NODE_SQL).to_arrow_table()


def run_table(con: duckdb.DuckDBPyConnection, info: list[dict[str, Any]]) -> pa.Table:
    """One row per run. Needs the connection's ``spans`` and ``devices`` tables registered."""
    from charllm_nemo.analysis.run_info import INFO_TYPES

    # Typed columns (run_info.typed made each value of its type): rows may lack keys (gaps)
    types = {"string": pa.string(), "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_()}
    keys = list(dict.fromkeys([*INFO_TYPES, *(k for row in info for k in row)]))
    cols = {k: pa.array([row.get(k) for row in info], types.get(INFO_TYPES.get(k, ""))) for k in keys}
    con.register("info", pa.Table.from_pydict(cols))
    return con.sql(RUN_SQL).to_arrow_table()


def platform_table(con: duckdb.DuckDBPyConnection, runs: pa.Table) -> pa.Table:
    """The runs of each model side by side across platforms (``<GPUs>x <device>``), with each
    one's throughput and efficiency relative to the model's best run."""
    con.register("runs", runs)
    return con.sql(PLATFORM_SQL).to_arrow_table()
