"""``charllm analyze --engine spark``: every table of the local engine, and its per-window table,
with the per-rank reduction run by Spark; and the Spark session it runs on.

The heavy part of the analysis, linear in samples, is the per-rank reduction: reading a rank's
segments, the attribution of every window, each device's whole-span figures (``ranks``), the
measured span's energy, the excursions, the driver's throttle counters and the rank's part of the
job power waveform. The local engine runs it in this process or in a pool of worker processes,
one task per rank (:func:`.rank_tables.reduce_task`: the rank's file paths in, its rows out).
The Spark engine is the local engine's :func:`.analyze.analyze` with one thing changed, where
that task runs (its ``mapper``): the driver opens the runs as the local engine does (the hardened
scan lists each rank's files) and hands each run's rank tasks to Spark
(``parallelize(tasks).map(reduce_task)``, one job per run); each Python worker reads its ranks'
files through the same hardened reader (``O_NOFOLLOW``, bounded reads, an unreadable segment
skipped and named) and reduces them. The driver gathers the ranks' rows and makes every table,
the findings and the window file exactly as the local engine does: the per-rank functions, the
loop over them and the SQL over their rows exist once (tests/analysis/test_spark.py: every
column of every table and of the window table equal, on a rough store).

Spark does no SQL here: no Parquet scan in the JVM, no shuffle, no generated code; one stage of
Python tasks, its results collected. That is what makes a small run cheap (issue #45: the
cogroup of Spark-read Parquet this replaced cost ~3 x the JVM CPU; docs/analysis.md, "Engines").
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from charllm_nemo.analysis.analyze import Analysis, RankResult, analyze
from charllm_nemo.analysis.grid_power import GridOptions
from charllm_nemo.analysis.rank_tables import RankTask
from charllm_nemo.progress import Progress

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


def map_on_spark(
    session: Any, fn: Callable[[RankTask], RankResult], tasks: list[RankTask]
) -> list[RankResult]:
    """``fn`` over ``tasks`` on the session's Python workers (an :data:`.analyze.Mapper`), the
    results in the tasks' order."""
    if not tasks:
        return []
    sc = session.sparkContext
    slices = max(1, min(len(tasks), TASKS_PER_CORE * int(sc.defaultParallelism)))
    results: list[RankResult] = sc.parallelize(tasks, slices).map(fn).collect()
    return results


def spark_analysis(
    session: Any,
    path: str | Path,
    grid: GridOptions | None = None,
    windows_out: Path | None = None,
    progress: Progress | None = None,
) -> Analysis:
    """Every run under ``path`` analysed as :func:`.analyze.analyze` does (the same arguments),
    with the per-rank reduction on ``session`` (a pyspark ``SparkSession``)."""
    return analyze(path, windows_out, progress, grid, mapper=partial(map_on_spark, session))
