"""``charllm analyze --engine spark``: every table of the local engine, and its per-window table,
with the per-rank reduction run by Spark; and the Spark session it runs on.

The heavy part of the analysis, linear in samples, is the per-rank reduction: reading a rank's
segments, the attribution of every window, each device's whole-span figures (``ranks``), the
measured span's energy, the excursions and the driver's throttle counters. The local engine runs
it in this process or in a pool of worker processes, one task per rank
(:func:`.rank_tables.reduce_files`: the rank's file paths in, its rows out). Spark runs that very
task: the driver opens the runs as the local engine does (the hardened scan lists each rank's
files), hands the ranks' file lists to Spark (``parallelize(...).map(reduce_files)``), and each
Python worker reads its ranks' files through the same hardened reader (``O_NOFOLLOW``, bounded
reads, an unreadable segment skipped and named) and reduces them. The per-rank functions exist
once, and both engines run them. The driver gathers the ranks' rows (one per device, one per
window, one span row per device) and computes the tables over them with the local engine's
DuckDB SQL (:func:`.analyze.assemble`: ``runs``, ``ranks``, ``nodes``, ``platforms``, the
findings, the kernels, grid and pipeline tables). The tables equal the local engine's
(tests/analysis/test_spark.py: every column of every table and of the window table, on a rough
store).

Spark does no SQL here: no Parquet scan in the JVM, no shuffle, no generated code; one stage of
Python tasks, its results collected. That is what makes a small run cheap (issue #45: the
cogroup of Spark-read Parquet this replaced cost ~3 x the JVM CPU; docs/analysis.md, "Engines").
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa

from charllm_nemo.analysis.analyze import KEPT_WINDOW_COLUMNS, Analysis, assemble, rank_rows
from charllm_nemo.analysis.grid_power import GridOptions
from charllm_nemo.analysis.load import Run, find_runs, open_runs
from charllm_nemo.analysis.rank_tables import RankTables, reduce_files
from charllm_nemo.analysis.run_info import run_info, sweep_gaps
from charllm_nemo.errors import StoreError
from charllm_nemo.telemetry.layout import RankFiles

TASKS_PER_CORE = 4
"""Spark tasks per core of the session (``defaultParallelism``), ranks permitting: a task is a
slice of the ranks, and a few per core even out ranks of unequal length."""

LOCAL_CONF: dict[str, str] = {
    "spark.ui.enabled": "false",
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
}
"""Settings for a ``local[...]`` master this process starts (not under spark-submit or on a
cluster, whose settings are the user's): no web UI, and a JVM that compiles with C1 only and
collects garbage in one thread. On this 2-core VM they halved the JVM's CPU for a session's start
(11.6 to 5.7 s); the JVM here schedules Python tasks and runs no SQL, where C2's code would pay."""


def spark_session(master: str | None) -> Any:
    """A pyspark session (``master``: ``local[2]``, ``spark://host:7077``, ``yarn``; default
    ``$SPARK_MASTER``, else spark-submit's ``--master``, else ``local[*]``). ImportError names
    the extra when pyspark is missing."""
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:
        raise ImportError("--engine spark needs pyspark: pip install -e '.[spark]' (and Java 17)") from exc
    builder = SparkSession.builder.appName("charllm analyze")
    url = master or os.environ.get("SPARK_MASTER")
    if url and url.startswith("local"):  # the workers run this Python, where the package is
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        for key, value in LOCAL_CONF.items():
            builder = builder.config(key, value)
    # no master named: spark-submit's --master (its default: local[*]), never overridden here
    return (builder.master(url) if url else builder).getOrCreate()


def reduce_on_spark(session: Any, tasks: list[RankFiles]) -> list[tuple[int, RankTables | None, list[str]]]:
    """:func:`.rank_tables.reduce_files` of every task, run by the session's Python workers, the
    results in the tasks' order."""
    if not tasks:
        return []
    sc = session.sparkContext
    slices = max(1, min(len(tasks), TASKS_PER_CORE * int(sc.defaultParallelism)))
    results: list[tuple[int, RankTables | None, list[str]]] = (
        sc.parallelize(tasks, slices).map(reduce_files).collect()
    )
    return results


def spark_analysis(session: Any, path: str | Path, grid: GridOptions | None = None) -> Analysis:
    """Every run under ``path`` (found and opened as the local engine does) analysed with the
    per-rank reduction on ``session`` (a pyspark ``SparkSession``): the local engine's
    :class:`.analyze.Analysis`, its ``windows`` the whole per-window table."""
    root = Path(path)
    run_dirs = find_runs(root)
    runs: list[Run] = []
    problems: list[str] = []
    infos: list[dict[str, Any]] = []
    tasks: list[RankFiles] = []
    for run in open_runs(run_dirs, root, problems):
        runs.append(run)
        infos.append(run_info(run))
        tasks += [run.files.ranks[r] for r in run.ranks]
    infos += sweep_gaps(run_dirs, {r.path for r in runs})
    if not runs:
        raise StoreError(f"{root}: no run could be read ({'; '.join(problems) or 'none found'})")
    results = iter(reduce_on_spark(session, tasks))
    devices: list[pa.Table] = []
    spans: list[pa.Table] = []
    every: list[pa.Table] = []
    for run in runs:  # as analyze.analyze takes each run's ranks, in the same order
        hosts = {r: str(m.get("host") or "?") for r, m in run.manifests.items()}
        n_ranks = 0
        for _ in run.ranks:
            rank, rt, rank_problems = next(results)
            run.problems.extend(rank_problems)
            if rt is None or not rt.devices:
                continue
            n_ranks += 1
            dt, st, wt = rank_rows(run.key, rank, hosts.get(rank, "?"), rt)
            devices.append(dt)
            if st is not None:
                spans.append(st)
            if wt is not None:
                every.append(wt)
        if n_ranks == 0:
            run.problems.append(f"{run.path}: no rank has samples; the run has no figures")
        problems.extend(run.problems)
    kept = [t.select(list(KEPT_WINDOW_COLUMNS)) for t in every]
    analysis = assemble(runs, infos, devices, spans, kept, problems, grid)
    # the window table as the local engine streams it: each rank's rows cast to the first's schema
    analysis.windows = pa.concat_tables([t.cast(every[0].schema) for t in every]) if every else None
    return analysis
