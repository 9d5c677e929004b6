"""The ``ranks``, ``nodes`` and ``runs`` tables as Spark DataFrames (window expressions), for a
fleet's store on shared or object storage; and the Spark session of ``--engine spark``.

Written against the PySpark DataFrame API only (``functions``, ``Window``, ``DataFrame``), so the
same code runs on a Spark cluster (``pyspark``; also under ``spark-submit``) and, for tests and
small stores, on DuckDB through sqlframe (the PySpark API without a JVM). The session is the
caller's: :func:`spark_tables` takes any object with PySpark's ``SparkSession`` interface.

What is read: exactly the files the hardened scan accepts (``telemetry/layout.py``: no links,
documented names, compacted files taking the place of the segments they cover), listed
explicitly, so Spark never globs a directory an attacker arranged; the rank is each file's
``rank=N`` folder, as a Hive partition. The run's small files (manifests, summary, config) are read on the
driver as the single-host analysis reads them.

Tables, with the columns analysis/columns.py declares for each engine (one declaration: the
node and run aggregates are the same SQL text the local engine's DuckDB runs, through ``F.expr``):

* ``ranks``: one row per (run, rank, device) over the whole sampled span: samples, duration,
  coverage and the longest gap, time-weighted average and peak power, GPU and HBM temperatures,
  SM clock, the energy counter's increase (non-negative deltas only), its resets and update
  period, integrated power and the two's disagreement, throttle shares (sample-and-hold),
  traffic counter increases, the power limit, the host. Every window is a running frame (rows
  from the partition's start, in ascending or descending time) or ``lag``: linear in samples.
  Not here: the attribution's whole-span ``energy_j``, ``energy_bound_j``, ``energy_method``.
* ``nodes``: per (run, host), from ``ranks``;
* ``runs``: per run, its description (run_info.py), the measured span (every step window but
  the first, as ``summary.json``'s medians) with its energy summed over devices, the figures
  derived from it, and the per-run aggregates over ``ranks``. The span's energy is the energy
  counter's non-negative steps from the last sample at or before the span's start to the first
  at or after its end (integrated power where a device has no counter): the single-host engine
  interpolates at the span's edges instead, so the two agree within one counter period's energy
  per device (tests: within 1 %). Not here: ``energy_bound_j``, ``energy_methods``.

Not in these DataFrame tables: the per-window attribution, the findings and the other tables.
``charllm analyze --engine spark`` does not use them: it runs the local engine's per-rank
reduction on Spark (analysis/spark_windows.py) and writes every table and the window table.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from charllm_nemo.analysis.columns import NODE_REDUCTIONS, RUN_DERIVED, RUN_DEVICE_REDUCTIONS, names
from charllm_nemo.analysis.load import find_runs, open_run
from charllm_nemo.analysis.run_info import INFO_TYPES, run_info
from charllm_nemo.telemetry.schema import THROTTLE_REASONS
from charllm_nemo.telemetry.timelines import GAP_PERIODS

FLOAT_MEANS = (("power_instant_w", "power_avg_w"), ("temp_gpu_c", "temp_gpu_avg_c"),
               ("temp_hbm_c", "temp_hbm_avg_c"), ("clock_sm_mhz", "clock_sm_avg_mhz"))  # fmt: skip
PEAKS = (
    ("power_instant_w", "power_peak_w"),
    ("temp_gpu_c", "temp_gpu_peak_c"),
    ("temp_hbm_c", "temp_hbm_peak_c"),
)
COUNTERS = (
    ("energy_mj", "energy_counter"),
    ("pcie_tx_bytes", "pcie_tx_bytes"),
    ("pcie_rx_bytes", "pcie_rx_bytes"),
    ("nvlink_tx_bytes", "nvlink_tx_bytes"),
    ("nvlink_rx_bytes", "nvlink_rx_bytes"),
)
KEYS = ("run", "rank", "device_index")

RANK_COLUMNS = names("ranks", "spark")
"""The ``ranks`` columns the Spark engine computes (analysis/columns.py declares them)."""


@dataclass
class SparkTables:
    """The Spark engine's tables as Spark DataFrames (``toPandas`` / ``collect`` to bring home)."""

    ranks: Any
    nodes: Any
    runs: Any
    problems: list[str]


def _api(session: Any) -> tuple[Any, Any]:
    """``(functions, Window)`` for the session's flavour: pyspark's, or sqlframe's DuckDB."""
    import importlib

    flavour = "sqlframe.duckdb" if type(session).__module__.startswith("sqlframe") else "pyspark.sql"
    F = importlib.import_module(f"{flavour}.functions")
    Window = importlib.import_module(flavour).Window
    return F, Window


def _read(session: Any, F: Any, files: list[tuple[str, Path, Path]]) -> Any:
    """One DataFrame of the given files (run key, run directory, file) of every run, with
    ``run`` and ``rank`` columns: the rank is the Hive partition of each file's ``rank=N``
    folder (Spark: partition discovery below the run directory, ``basePath``; DuckDB through
    sqlframe: its own Hive detection)."""
    by_run: dict[tuple[str, Path], list[str]] = {}
    for run, run_dir, path in files:
        by_run.setdefault((run, run_dir), []).append(str(path))
    frames = []
    for (run, run_dir), paths in by_run.items():
        reader = session.read
        if not type(session).__module__.startswith("sqlframe"):
            reader = reader.option("basePath", str(run_dir))
        df = reader.parquet(*paths)
        if "rank" not in df.columns:
            raise ValueError(f"{run_dir}: the engine found no rank=N partition in {paths[0]}")
        frames.append(df.withColumn("rank", F.col("rank").cast("int")).withColumn("run", F.lit(run)))
    out = frames[0]
    for f in frames[1:]:
        out = out.unionByName(f, allowMissingColumns=True)
    return out


def rank_table(session: Any, samples: Any, hosts: Any) -> Any:
    """The ``ranks`` table from every sample (``run``, ``rank`` columns added): one pass of
    window expressions (for each metric, the next non-null sample's time and value, or the
    previous counter value) and one aggregation, so the plan stays one shuffle deep."""
    F, W = _api(session)
    have = set(samples.columns)
    s = samples.where(F.col("t_mono_ns").isNotNull()).dropDuplicates([*KEYS, "t_mono_ns"])
    # "Every later row" as a running frame over the rows in descending time: Spark evaluates
    # rowsBetween(1, unboundedFollowing) with its UnboundedFollowingWindowFunctionFrame, which
    # re-aggregates the whole rest of the partition for each row (O(n^2) in samples per device;
    # 1,367 s for 2 x 26 k samples, issue #45), and a frame from the partition's start
    # incrementally (O(n)). Times are unique here (dropDuplicates), so the two frames hold the
    # same rows.
    ahead = W.partitionBy(*KEYS).orderBy(F.col("t_mono_ns").desc()).rowsBetween(W.unboundedPreceding, -1)
    behind = W.partitionBy(*KEYS).orderBy("t_mono_ns").rowsBetween(W.unboundedPreceding, -1)
    cols: list[Any] = [F.col(k) for k in (*KEYS, "t_mono_ns")]
    aggs: list[Any] = [
        ((F.max("t_mono_ns") - F.min("t_mono_ns")) / 1e9).alias("duration_s"),
        F.count("t_mono_ns").cast("double").alias("n_samples"),
    ]
    for c, name in PEAKS:
        if c in have:
            aggs.append(F.max(F.when(~F.isnan(c), F.col(c))).alias(name))
    for c, name in FLOAT_MEANS:
        if c not in have:
            continue
        ok = F.col(c).isNotNull() & ~F.isnan(c)
        v = F.when(ok, F.col(c))
        # the next non-null sample: the smallest (time, value) pair ahead (a struct orders by time)
        nxt = F.min(F.when(ok, F.struct(F.col("t_mono_ns").alias("t"), F.col(c).alias("v")))).over(ahead)
        cols += [v.alias(f"{c}__v"), nxt.alias(f"{c}__n")]

        piece = F.when(
            F.col(f"{c}__v").isNotNull(),
            (F.col(f"{c}__n.t") - F.col("t_mono_ns")) * (F.col(f"{c}__v") + F.col(f"{c}__n.v")) / 2,
        )
        area = F.sum(piece)
        span = F.max(F.when(F.col(f"{c}__v").isNotNull(), F.col("t_mono_ns"))) - F.min(
            F.when(F.col(f"{c}__v").isNotNull(), F.col("t_mono_ns"))
        )
        aggs.append((area / span).alias(name))
        if c == "power_instant_w":
            aggs.append((area / 1e9).alias("energy_trapezoid_j"))
    for c, name in COUNTERS:
        if c not in have:
            continue
        v = F.when(F.col(c) >= 0, F.col(c))
        prev = F.max(
            F.when(F.col(c) >= 0, F.struct(F.col("t_mono_ns").alias("t"), F.col(c).alias("v")))
        ).over(behind)
        cols += [v.alias(f"{c}__v"), prev.alias(f"{c}__p")]
        d = F.col(f"{c}__v") - F.col(f"{c}__p.v")
        total = F.sum(F.when(d >= 0, d))
        if name == "energy_counter":
            resets = F.sum(F.when(d < 0, 1).otherwise(0)).cast("double")
            aggs += [(total / 1e3).alias("energy_counter_j"), resets.alias("energy_counter_resets")]
        else:
            aggs.append(total.cast("double").alias(name))
    if "throttle_reasons" in have:
        known = F.col("throttle_reasons") >= 0
        cols += [F.when(known, F.col("throttle_reasons")).alias("m__v"),
                 F.min(F.when(known, F.col("t_mono_ns"))).over(ahead).alias("m__t2")]  # fmt: skip
        dt = F.col("m__t2") - F.col("t_mono_ns")
        span = F.max(F.when(F.col("m__v").isNotNull(), F.col("t_mono_ns"))) - F.min(
            F.when(F.col("m__v").isNotNull(), F.col("t_mono_ns"))
        )
        for name, bit in THROTTLE_REASONS:
            # the bit as arithmetic (floor(mask / bit) odd): sqlframe has no bitwiseAND
            held = F.when(F.col("m__v").isNotNull() & (F.floor(F.col("m__v") / bit) % 2 == 1), dt).otherwise(
                0
            )
            aggs.append((F.sum(held) / span).alias(f"throttle_{name}_share"))
    # The sampling's gaps: each step between consecutive samples (coverage, gap_max_s)
    cols.append(
        (F.col("t_mono_ns") - F.lag("t_mono_ns").over(W.partitionBy(*KEYS).orderBy("t_mono_ns"))).alias("g__")
    )
    if "power_limit_w" in have:
        cols.append(F.when(~F.isnan("power_limit_w"), F.col("power_limit_w")).alias("limit__"))
        aggs.append(F.median("limit__").alias("power_limit_w"))
    else:
        aggs.append(F.lit(None).cast("double").alias("power_limit_w"))
    rows = s.select(*cols, *[F.col(c) for c in have if c in {p for p, _ in PEAKS}])
    if "energy_mj" in have:
        # the counter's update period: the median time between the samples at which it changed
        changed = F.col("energy_mj__v").isNotNull() & (F.col("energy_mj__v") != F.col("energy_mj__p.v"))
        rows = rows.withColumn("chg__", F.when(changed, F.col("t_mono_ns")))
        rows = rows.withColumn("chg_prev__", F.max("chg__").over(behind))
        aggs.append((F.median(F.col("chg__") - F.col("chg_prev__")) / 1e9).alias("energy_counter_period_s"))
    else:
        aggs.append(F.lit(None).cast("double").alias("energy_counter_period_s"))
    aggs += [
        F.median("g__").alias("g_median__"),
        F.max("g__").alias("g_max__"),
        (F.max("t_mono_ns") - F.min("t_mono_ns")).alias("span_ns__"),
    ]
    out = rows.groupBy(*KEYS).agg(*aggs)
    # a step longer than GAP_PERIODS median steps is uncovered (docs/attribution.md, Coverage)
    med = out.select(*KEYS, "g_median__")
    ok = rows.select(*KEYS, "g__").join(med, on=list(KEYS))
    ok = ok.groupBy(*KEYS).agg(
        F.sum(F.when(F.col("g__") <= GAP_PERIODS * F.col("g_median__"), F.col("g__")).otherwise(0)).alias(
            "ok__"
        )
    )
    out = out.join(ok, on=list(KEYS), how="left")
    n, span = F.col("n_samples"), F.col("span_ns__")
    out = out.withColumn(
        "coverage", F.when(n >= 3, F.col("ok__") / span).when(n == 2, F.lit(0.0)).otherwise(F.lit(None))
    ).withColumn("gap_max_s", F.when(n >= 2, F.col("g_max__") / 1e9))
    trap = F.col("energy_trapezoid_j") if "power_instant_w" in have else F.lit(None).cast("double")
    counter = F.col("energy_counter_j") if "energy_mj" in have else F.lit(None).cast("double")
    out = out.withColumn(
        "energy_disagreement", F.when(trap.isNotNull() & (trap != 0), (counter - trap) / trap)
    ).drop("g_median__", "g_max__", "ok__", "span_ns__")
    return out.join(hosts, on=["run", "rank"], how="left")


def node_table(session: Any, ranks: Any) -> Any:
    """The ``nodes`` table from ``ranks`` (docs/analysis.md)."""
    F, _ = _api(session)
    return ranks.groupBy("run", "host").agg(*(F.expr(expr).alias(name) for name, expr in NODE_REDUCTIONS))


def run_table(session: Any, samples: Any, windows: Any, info: Any, ranks: Any) -> Any:
    """The ``runs`` table's measured-span figures per run (see the module docstring)."""
    F, W = _api(session)
    steps = windows.where((F.col("kind") == "step") & F.col("t_end_mono_ns").isNotNull())
    first = steps.groupBy("run", "rank").agg(F.min("step").alias("first_step"), F.count("*").alias("n"))
    steps = steps.join(first, on=["run", "rank"]).where(
        (F.col("step") > F.col("first_step")) | (F.col("n") == 1)
    )
    span = steps.groupBy("run", "rank").agg(
        F.min("t_begin_mono_ns").alias("b"),
        F.max("t_end_mono_ns").alias("e"),
        F.countDistinct("step").alias("k"),
    )
    w = W.partitionBy(*KEYS).orderBy("t_mono_ns")
    s = samples.join(span, on=["run", "rank"])
    has_counter = "energy_mj" in samples.columns
    s = s.where(F.col("energy_mj") >= 0) if has_counter else s.where(F.col("power_instant_w").isNotNull())
    if has_counter:  # the counter's non-negative steps (a reset's interval is left out, as locally)
        step = F.col("energy_mj") / 1e3 - F.lag(F.col("energy_mj") / 1e3).over(w)
    else:  # integrated power, trapezoid from the previous sample
        step = (
            (F.col("t_mono_ns") - F.lag("t_mono_ns").over(w))
            * (F.col("power_instant_w") + F.lag("power_instant_w").over(w))
            / 2e9
        )
    s = s.withColumn("d", step).withColumn("t_prev", F.lag("t_mono_ns").over(w))
    # the steps inside the samples bracketing the span: after the last sample at or before its
    # begin, up to the first at or after its end
    first = F.max(F.when(F.col("t_mono_ns") <= F.col("b"), F.col("t_mono_ns"))).over(W.partitionBy(*KEYS))
    last = F.min(F.when(F.col("t_mono_ns") >= F.col("e"), F.col("t_mono_ns"))).over(W.partitionBy(*KEYS))
    s = s.withColumn("t_first", first).withColumn("t_last", last)
    inside = (
        (F.col("t_prev") >= F.col("t_first")) & (F.col("t_mono_ns") <= F.col("t_last")) & (F.col("d") >= 0)
    )
    dev = s.groupBy(*KEYS).agg(
        F.sum(F.when(inside, F.col("d"))).alias("span_energy_j"),
        F.max((F.col("e") - F.col("b")) / 1e9).alias("span_s"),
        F.max("k").alias("measured_steps"),
    )
    has_energy = F.col("span_energy_j").isNotNull() & ~F.isnan("span_energy_j")
    per_run = dev.groupBy("run").agg(
        F.max("span_s").alias("execution_time_s"),
        F.sum("span_energy_j").alias("energy_j"),
        F.max("measured_steps").alias("measured_steps"),
        F.sum(F.when(has_energy, 0).otherwise(1)).alias("devices_without_energy"),
        F.sum(F.when(has_energy, 1).otherwise(0)).alias("devices_with_energy__"),
    )
    per_run = per_run.withColumn(
        "power_avg_w",
        F.col("energy_j")
        / F.col("execution_time_s")
        / F.when(F.col("devices_with_energy__") > 0, F.col("devices_with_energy__")),
    ).drop("devices_with_energy__")
    out = info.join(per_run, on="run", how="left")
    for name, expr in RUN_DERIVED:
        out = out.withColumn(name, F.expr(expr))
    return _with_devices(session, out, ranks)


def _with_devices(session: Any, runs: Any, ranks: Any) -> Any:
    """The runs table's per-run aggregates over its ``ranks`` rows (analysis/columns.py)."""
    F, _ = _api(session)
    dev = ranks.groupBy("run").agg(*(F.expr(expr).alias(name) for name, expr in RUN_DEVICE_REDUCTIONS))
    return runs.join(dev, on="run", how="left")


INFO_COLUMNS = tuple(INFO_TYPES)
_SPARK_TYPES = {"string": "string", "int": "bigint", "float": "double", "bool": "boolean"}
INFO_SCHEMA = ", ".join(f"{k} {_SPARK_TYPES[v]}" for k, v in INFO_TYPES.items())
"""Typed: a column that is null in every run (no sweep) leaves nothing for Spark to infer."""


def spark_tables(session: Any, path: str | Path) -> SparkTables:
    """Every run under ``path`` (found and scanned as the single-host engine does) reduced on
    ``session`` (a pyspark ``SparkSession``, or sqlframe's ``DuckDBSession``)."""
    F, _ = _api(session)
    root = Path(path)
    problems: list[str] = []
    samples_files: list[tuple[str, Path, Path]] = []
    window_files: list[tuple[str, Path, Path]] = []
    host_rows: list[tuple[str, int, str]] = []
    info_rows: list[tuple[Any, ...]] = []
    for d in find_runs(root):
        run = open_run(d, root)
        problems += run.problems
        for r, rf in sorted(run.files.ranks.items()):
            samples_files += [(run.key, d, p) for p in rf.samples]
            window_files += [(run.key, d, p) for p in rf.windows]
            host_rows.append((run.key, r, str(run.manifests.get(r, {}).get("host") or "?")))
        info = run_info(run)
        info_rows.append(tuple(info.get(k) for k in INFO_COLUMNS))  # typed by run_info
    if not samples_files:
        raise ValueError(f"{root}: no samples to analyse")
    samples = _read(session, F, samples_files)
    hosts = session.createDataFrame(host_rows, "run string, rank int, host string")
    ranks = rank_table(session, samples, hosts)
    info = session.createDataFrame(info_rows, INFO_SCHEMA)
    if window_files:
        runs = run_table(session, samples, _read(session, F, window_files), info, ranks)
    else:
        runs = _with_devices(session, info, ranks)
    return SparkTables(ranks, node_table(session, ranks), runs, problems)


def collect(df: Any, columns: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """A DataFrame's rows as dicts (``columns`` only where given), for printing and tests."""
    cols = list(columns) if columns is not None else list(df.columns)
    return [{c: row[c] for c in cols if c in row.asDict()} for row in df.collect()]


def to_arrow(df: Any) -> Any:
    """A (small) DataFrame as a pyarrow Table, through its rows: no pandas needed."""
    import pyarrow as pa

    rows = collect(df)
    return pa.Table.from_pylist(rows) if rows else pa.table({c: pa.array([]) for c in df.columns})


def spark_session(master: str | None) -> Any:
    """A pyspark session (``master``: ``local[2]``, ``spark://host:7077``, ``yarn``; default
    ``$SPARK_MASTER``, else spark-submit's ``--master``, else ``local[*]``). ImportError names
    the extra when pyspark is missing."""
    import os
    import sys

    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:
        raise ImportError("--engine spark needs pyspark: pip install -e '.[spark]' (and Java 17)") from exc
    builder = SparkSession.builder.appName("charllm analyze")
    url = master or os.environ.get("SPARK_MASTER")
    if url and url.startswith("local"):  # the workers run this Python, where the package is
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # no master named: spark-submit's --master (its default: local[*]), never overridden here
    return (builder.master(url) if url else builder).getOrCreate()
