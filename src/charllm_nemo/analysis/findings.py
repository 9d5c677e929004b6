"""The per-microbatch findings the paper could not make (it sampled at ~1 s, per run):
power excursions, thermal imbalance, throttle-to-slowdown and the per-phase energy split.

Each is one SQL query (DuckDB) over the window table ``w`` (one row per window and device:
the attributed figures of docs/attribution.md plus ``run``, ``rank``, ``host``, ``measured``)
and the run table ``info``. Definitions and units: docs/analysis.md.
"""

from __future__ import annotations

import duckdb
import pyarrow as pa

from charllm_nemo.telemetry.schema import THROTTLE_REASONS

MAIN_PHASES = ("forward", "backward", "optimizer")
"""Phase names that are their own category; every other phase (pipeline send/receive, gradient
and embedding syncs, ...) is ``communication``."""

EXCURSIONS_SQL = """
SELECT x.run, i.micro_batch_size, count(*) AS microbatches,
       median(x.power_peak_w / x.power_avg_w) AS peak_to_avg_median,
       quantile_cont(x.power_peak_w / x.power_avg_w, 0.95) AS peak_to_avg_p95,
       max(x.power_peak_w / x.power_avg_w) AS peak_to_avg_max,
       sum(x.time_above_limit_s) / sum(x.duration_s) AS time_above_limit_share,
       max(x.time_above_limit_s) AS time_above_limit_max_s,
       median(x.largest_rise_100ms_w) AS rise_100ms_median_w,
       max(x.largest_rise_100ms_w) AS rise_100ms_max_w
FROM w x JOIN info i ON x.run = i.run
-- A microbatch with no power sample inside has no peak (docs/attribution.md): left out here.
WHERE x.kind = 'microbatch' AND x.measured AND x.power_avg_w > 0 AND NOT isnan(x.power_peak_w)
GROUP BY x.run, i.micro_batch_size ORDER BY i.micro_batch_size, x.run
"""

THERMAL_STEPS_SQL = """
WITH per_rank AS (
    SELECT run, step, rank, host, max(temp_gpu_peak_c) AS temp_c, avg(clock_sm_avg_mhz) AS clock_mhz,
           max(duration_s) AS step_s
    FROM w WHERE kind = 'step' AND measured GROUP BY run, step, rank, host
), per_node AS (
    SELECT run, step, host, max(temp_c) - min(temp_c) AS node_spread_c FROM per_rank GROUP BY run, step, host
)
SELECT r.run, r.step, max(temp_c) - min(temp_c) AS imbalance_c,
       (SELECT max(node_spread_c) FROM per_node n WHERE n.run = r.run AND n.step = r.step)
           AS node_imbalance_max_c,
       max(temp_c) AS temp_hottest_c, min(temp_c) AS temp_coolest_c,
       avg(clock_mhz) AS clock_sm_avg_mhz, max(step_s) AS step_time_s, count(*) AS ranks
FROM per_rank r GROUP BY r.run, r.step ORDER BY r.run, r.step
"""

THERMAL_RUN_SQL = """
WITH per_rank AS (
    SELECT run, step, rank, max(temp_gpu_peak_c) AS temp_c, avg(clock_sm_avg_mhz) AS clock_mhz,
           max(duration_s) AS step_s
    FROM w WHERE kind = 'step' AND measured GROUP BY run, step, rank
), corr_rank AS (
    SELECT run, corr(temp_c, clock_mhz) AS corr_temp_clock, corr(temp_c, step_s) AS corr_temp_step_time
    FROM per_rank GROUP BY run
), corr_step AS (
    SELECT run, avg(imbalance_c) AS imbalance_avg_c, max(imbalance_c) AS imbalance_max_c,
           max(node_imbalance_max_c) AS node_imbalance_max_c,
           corr(imbalance_c, step_time_s) AS corr_imbalance_step_time,
           corr(imbalance_c, clock_sm_avg_mhz) AS corr_imbalance_clock
    FROM thermal_steps GROUP BY run
)
SELECT * FROM corr_step LEFT JOIN corr_rank USING (run) ORDER BY run
"""


CLOCK_TOLERANCE = 0.01
"""A rank's compute clock within this share of its replicas' highest runs as fast as theirs."""


def _throttle_sql() -> str:
    shares = ",\n       ".join(
        f"sum(throttle_{name}_s) / sum(duration_s) AS throttle_{name}_share" for name, _ in THROTTLE_REASONS
    )
    # Two measures of what a rank's device speed cost it (docs/analysis.md, Throttle-to-slowdown):
    # the clock its compute ran at against the fastest device's compute clock in the run, and its
    # compute time against its data-parallel replicas' (same pipeline stage and tensor rank). The
    # clock is the one that exists in every layout and names the slow rank: a pipeline-only run
    # has no replicas, and a collective inside a phase (tensor and expert parallel, a gradient
    # reduce overlapped with the backward) makes the *waiting* rank's phase the longer one. The
    # time is the fallback for devices without clock readings.
    return f"""
WITH steps AS (
    SELECT run, rank, any_value(pp_stage) AS pp_stage, any_value(tp_rank) AS tp_rank,
       sum(duration_s) AS step_s,
       {shares},
       sum(throttle_any_limiting_s) / sum(duration_s) AS throttle_any_limiting_share
    FROM w WHERE kind = 'step' AND measured GROUP BY run, rank
), busy AS (
    SELECT run, rank, median(busy_s) AS busy_median_s FROM (
        SELECT run, rank, step, sum(duration_s) AS busy_s FROM w
        WHERE kind = 'phase' AND name IN ('forward', 'backward') AND measured
        GROUP BY run, rank, step) GROUP BY run, rank
), clock AS (
    SELECT run, rank, sum(clock_sm_avg_mhz * duration_s) / sum(duration_s) AS compute_clock_mhz
    FROM w WHERE kind = 'phase' AND name IN ('forward', 'backward') AND measured
        AND clock_sm_avg_mhz > 0 AND duration_s > 0
    GROUP BY run, rank
), joined AS (
    SELECT s.*, b.busy_median_s, c.compute_clock_mhz,
       count(b.busy_median_s) OVER (PARTITION BY s.run, s.pp_stage, s.tp_rank) AS dp_peers,
       min(b.busy_median_s) OVER (PARTITION BY s.run, s.pp_stage, s.tp_rank) AS peers_busy_min_s,
       max(c.compute_clock_mhz) OVER (PARTITION BY s.run, s.pp_stage, s.tp_rank) AS peers_clock_max_mhz,
       max(c.compute_clock_mhz) OVER (PARTITION BY s.run) AS fastest_clock_mhz
    FROM steps s LEFT JOIN busy b USING (run, rank) LEFT JOIN clock c USING (run, rank)
), measures AS (
    SELECT *,
       CASE WHEN dp_peers >= 2 THEN busy_median_s / peers_busy_min_s - 1 END AS busy_vs_dp_peers,
       fastest_clock_mhz / compute_clock_mhz - 1 AS slowdown_vs_fastest_clock
    FROM joined
)
SELECT * EXCLUDE (dp_peers, peers_busy_min_s, peers_clock_max_mhz, busy_vs_dp_peers),
       busy_vs_dp_peers,
       -- as the alerts (docs/alerts.md): a rank whose device clock is its replicas' highest is
       -- not slowed by its device; its longer busy time is the host's or a wait, not a slowdown
       CASE WHEN busy_vs_dp_peers IS NULL THEN NULL
            WHEN compute_clock_mhz IS NOT NULL AND peers_clock_max_mhz IS NOT NULL
                 AND compute_clock_mhz >= peers_clock_max_mhz * {1 - CLOCK_TOLERANCE} THEN 0.0
            ELSE busy_vs_dp_peers END AS slowdown_vs_dp_peers,
       coalesce(slowdown_vs_fastest_clock, slowdown_vs_dp_peers, 0) AS slowdown_vs_fastest,
       CASE WHEN slowdown_vs_fastest_clock IS NOT NULL THEN 'fastest_device_clock'
            WHEN slowdown_vs_dp_peers IS NOT NULL THEN 'dp_peers_compute_time'
            ELSE 'none' END AS slowdown_baseline
FROM measures ORDER BY run, rank
"""


SAMPLING_RANKS_SQL = """
SELECT run, rank, count(*) AS steps,
       count(*) FILTER (WHERE coverage < 1) AS steps_with_gaps,
       min(coverage) AS coverage_min, max(gap_max_s) AS gap_max_s,
       count(*) FILTER (WHERE coverage < 1) > 0 AS flagged
FROM w WHERE kind = 'step' AND measured GROUP BY run, rank ORDER BY run, rank
"""

SAMPLING_STEPS_SQL = """
SELECT run, step, min(coverage) AS coverage, max(gap_max_s) AS gap_max_s,
       count(DISTINCT rank) AS ranks_with_gaps, string_agg(DISTINCT CAST(rank AS VARCHAR), ' ') AS ranks
FROM w WHERE kind = 'step' AND measured AND coverage < 1 GROUP BY run, step ORDER BY run, step
"""
"""Steps with a sampling gap (docs/attribution.md, Coverage): only the flagged ones, one row each."""


# bubble_j is clamped per step at 0 (docs/analysis.md, Per-phase energy): the phases' energies can
# add up to more than their step's, from phase windows that overlap (a gradient sync overlapped
# with the backward pass) and from the step's energy coming from the hardware counter while the
# short phases' come from the power trapezoid; phases_over_step_j shows what was clamped.
PHASE_SQL = """
WITH phases AS (
    SELECT run, rank, step,
           CASE WHEN name IN ('forward', 'backward', 'optimizer') THEN name ELSE 'communication' END
               AS category,
           sum(energy_j) AS energy_j
    FROM w WHERE kind = 'phase' AND measured GROUP BY ALL
), steps AS (
    SELECT run, rank, step, sum(energy_j) AS step_j FROM w WHERE kind = 'step' AND measured GROUP BY ALL
), split AS (
    SELECT s.run, s.rank, s.step, s.step_j,
           coalesce(sum(p.energy_j) FILTER (WHERE category = 'forward'), 0) AS forward_j,
           coalesce(sum(p.energy_j) FILTER (WHERE category = 'backward'), 0) AS backward_j,
           coalesce(sum(p.energy_j) FILTER (WHERE category = 'optimizer'), 0) AS optimizer_j,
           coalesce(sum(p.energy_j) FILTER (WHERE category = 'communication'), 0) AS communication_j
    FROM steps s LEFT JOIN phases p USING (run, rank, step) GROUP BY s.run, s.rank, s.step, s.step_j
)
SELECT run, rank, sum(step_j) AS step_j, sum(forward_j) AS forward_j, sum(backward_j) AS backward_j,
       sum(optimizer_j) AS optimizer_j, sum(communication_j) AS communication_j,
       sum(greatest(step_j - phases_j, 0)) AS bubble_j,
       sum(greatest(phases_j - step_j, 0)) AS phases_over_step_j,
       sum(forward_j) / sum(step_j) AS forward_share, sum(backward_j) / sum(step_j) AS backward_share,
       sum(optimizer_j) / sum(step_j) AS optimizer_share,
       sum(communication_j) / sum(step_j) AS communication_share,
       sum(greatest(step_j - phases_j, 0)) / sum(step_j) AS bubble_share
FROM (SELECT *, forward_j + backward_j + optimizer_j + communication_j AS phases_j FROM split)
GROUP BY run, rank ORDER BY run, rank
"""


def findings(con: duckdb.DuckDBPyConnection) -> dict[str, pa.Table]:
    """Every findings table, from the connection's ``w`` and ``info`` tables."""
    out = {
        "excursions": con.sql(EXCURSIONS_SQL).to_arrow_table(),
        "thermal_steps": con.sql(THERMAL_STEPS_SQL).to_arrow_table(),
    }
    con.register("thermal_steps", out["thermal_steps"])
    out["thermal"] = con.sql(THERMAL_RUN_SQL).to_arrow_table()
    out["throttle_slowdown"] = con.sql(_throttle_sql()).to_arrow_table()
    out["sampling_ranks"] = con.sql(SAMPLING_RANKS_SQL).to_arrow_table()
    out["sampling_steps"] = con.sql(SAMPLING_STEPS_SQL).to_arrow_table()
    out["phase_energy"] = con.sql(PHASE_SQL).to_arrow_table()
    return out
