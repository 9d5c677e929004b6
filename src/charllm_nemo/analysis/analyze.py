"""``charllm analyze``: every table of a run or a sweep, written as Parquet and CSV.

Flow: find the runs (:mod:`.load`), load one rank at a time and reduce it to its rows
(:mod:`.rank_tables`: numpy over arrays), stream the full window table to disk as each rank is
done, keep only the columns the findings need, then compute the run, platform and findings
tables with DuckDB SQL over those Arrow tables (:mod:`.run_summary`, :mod:`.findings`).
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from charllm_nemo.analysis.arrow_init import keep_freed_memory
from charllm_nemo.analysis.csv_cells import csv_schema, spreadsheet_safe, write_csv
from charllm_nemo.analysis.findings import findings
from charllm_nemo.analysis.grid_power import GridOptions, grid_tables
from charllm_nemo.analysis.grid_wave import RankWave, WaveBuilder
from charllm_nemo.analysis.kernels import kernel_table
from charllm_nemo.analysis.load import Run, find_runs, open_runs
from charllm_nemo.analysis.pipeline_energy import pipeline_tables
from charllm_nemo.analysis.rank_tables import RankTables, RankTask, reduce_task
from charllm_nemo.analysis.run_info import run_info, sweep_gaps
from charllm_nemo.analysis.run_summary import node_table, platform_table, run_table
from charllm_nemo.errors import StoreError
from charllm_nemo.progress import Progress
from charllm_nemo.telemetry.layout import SIZE_CAPS, open_parquet
from charllm_nemo.telemetry.schema import INT_NULL, THROTTLE_REASONS
from charllm_nemo.telemetry.write import AtomicOutput, atomic_file, make_dir, write_text, write_with

KEPT_WINDOW_COLUMNS: tuple[str, ...] = (
    "run", "rank", "host", "device_index", "kind", "name", "step", "microbatch", "pp_stage", "tp_rank",
    "measured", "t_begin_mono_ns", "duration_s", "coverage", "gap_max_s", "energy_j", "energy_bound_j",
    "power_avg_w", "power_peak_w", "temp_gpu_peak_c",
    "clock_sm_avg_mhz", "time_above_limit_s", "largest_rise_100ms_w", "throttle_any_limiting_s",
    *(f"throttle_{name}_s" for name, _ in THROTTLE_REASONS),
)  # fmt: skip
"""Window columns held in memory for the findings (the full table goes to disk rank by rank)."""

TABLES = (
    "runs", "ranks", "nodes", "platforms", "excursions", "thermal", "thermal_steps",
    "throttle_slowdown", "phase_energy", "sampling_ranks", "sampling_steps",
)  # fmt: skip
"""The summary tables, in the order reports show them (``windows`` is written alongside)."""


@dataclass
class Analysis:
    """The tables of one ``analyze`` call, the runs they came from and what was wrong."""

    tables: dict[str, pa.Table]
    runs: list[Run]
    problems: list[str] = field(default_factory=list)
    windows_path: Path | None = None
    windows: pa.Table | None = None  # the kept columns (KEPT_WINDOW_COLUMNS)


POOL_MIN_RANKS = 4
"""Runs with at least this many ranks are reduced by this process and a pool of worker
processes, one process per usable CPU in all (``CHARLLM_ANALYZE_WORKERS`` to override; 1 = this
process alone): ranks are independent, and a worker's start (~0.3-0.5 s of imports) is paid
back from a few rank-hours on."""


def _workers(n_ranks: int) -> int:
    env = os.environ.get("CHARLLM_ANALYZE_WORKERS", "")
    cpus = int(env) if env.isdigit() and int(env) > 0 else len(os.sched_getaffinity(0))
    return 1 if n_ranks < POOL_MIN_RANKS else max(1, min(cpus, n_ranks))


RankResult = tuple[int, RankTables | None, RankWave | None, list[str]]
"""What :func:`.rank_tables.reduce_task` gives for one rank."""
Mapper = Callable[[Callable[[RankTask], RankResult], list[RankTask]], Iterable[RankResult]]
"""``mapper(reduce_task, tasks)``: the results of the task function over a run's rank tasks, in
the tasks' order, computed wherever the mapper runs them (``--engine spark``: Spark's workers)."""


def _reduced(
    run: Run, wave: WaveBuilder | None, mapper: Mapper | None
) -> Iterator[tuple[int, RankTables | None]]:
    """Each rank's tables in rank order, reduced by ``mapper`` if given, else here or by worker
    processes (spawned, not forked: DuckDB's threads may be running in this process); each
    rank's part of the job power waveform, made from the same arrays, goes to ``wave`` (None:
    not made)."""
    workers = _workers(len(run.ranks))
    step = wave.options.step_s if wave is not None else None
    tasks = [RankTask(run.files.ranks[r], run.manifests.get(r, {}), step) for r in run.ranks]
    if mapper is not None or workers == 1:
        results = map(reduce_task, tasks) if mapper is None else mapper(reduce_task, tasks)
        for rank, rt, part, problems in results:
            run.problems.extend(problems)
            if wave is not None:
                wave.add(rank, part)
            yield rank, rt
        return
    ctx = multiprocessing.get_context("spawn")
    # This process reduces every `workers`-th rank itself, between taking the pool's results:
    # one interpreter fewer to start (each costs ~0.3-0.5 s of CPU in imports, issue #45).
    with ProcessPoolExecutor(max_workers=workers - 1, mp_context=ctx, initializer=keep_freed_memory) as pool:
        # Each task carries its own rank's paths only (a task carrying the whole run made the
        # pickling, hence the call, quadratic in the rank count).
        pooled = {i: pool.submit(reduce_task, t) for i, t in enumerate(tasks) if i % workers}
        try:
            for i, task in enumerate(tasks):
                rank, rt, part, problems = pooled.pop(i).result() if i in pooled else reduce_task(task)
                run.problems.extend(problems)
                if wave is not None:
                    wave.add(rank, part)
                yield rank, rt
        finally:
            for future in pooled.values():  # stopped early (an error, Ctrl-C): the rest not run
                future.cancel()


def _arrow(cols: dict[str, np.ndarray[Any, Any]], int_nulls: bool = True) -> pa.Table:
    arrays = {}
    for k, v in cols.items():
        if v.dtype == object or v.dtype.kind == "U":
            arrays[k] = pa.array(v.astype(object) if v.dtype.kind == "U" else v, pa.string())
        elif v.dtype.kind == "i" and int_nulls:
            null = v == INT_NULL
            arrays[k] = pa.array(v, mask=null if null.any() else None)
        elif v.dtype.kind == "f":
            arrays[k] = pa.array(v, from_pandas=True)  # NaN -> null: SQL aggregates skip it
        else:
            arrays[k] = pa.array(v)
    return pa.table(arrays)


def _strings(table: pa.Table) -> list[str]:
    """The string columns of ``table``: the window table's only columns worth a Parquet
    dictionary (kind, name, run, host: a few values each). A dictionary tried on its float
    columns (all distinct) is built, abandoned and costs half the write's CPU for nothing."""
    return [f.name for f in table.schema if pa.types.is_string(f.type)]


def _with(table: pa.Table, **consts: Any) -> pa.Table:
    for i, (k, v) in enumerate(consts.items()):
        table = table.add_column(
            i, k, pa.array([v] * table.num_rows, pa.string() if isinstance(v, str) else None)
        )
    return table


def analyze(
    path: str | os.PathLike[str],
    windows_out: Path | None = None,
    progress: Progress | None = None,
    grid: GridOptions | None = None,
    mapper: Mapper | None = None,
) -> Analysis:
    """Analyse every run at or below ``path``. ``windows_out``: where the full per-window table
    (Parquet) is streamed; None keeps nothing but the columns the findings need; ``progress``:
    told how many runs are read (charllm_nemo/progress.py); ``grid``: how the job power waveform
    is read (:mod:`.grid_power`; None: the defaults); ``mapper``: runs the per-rank task over a
    run's ranks (:data:`Mapper`; None: this process or its worker pool). Raises StoreError only
    when there is no run at all; anything else becomes a line of ``problems``."""
    keep_freed_memory()  # this process's allocation policy, set when an analysis runs, not at import
    root = Path(path)
    run_dirs = find_runs(root)
    if progress is not None:
        progress.stage("reading and attributing the runs", total=len(run_dirs), unit="runs")
    runs: list[Run] = []
    problems: list[str] = []
    infos, devices, spans, kept = [], [], [], []
    waves: dict[str, WaveBuilder] = {}  # each run's job power waveform, from the ranks' own read
    writer: pq.ParquetWriter | None = None
    out_file: AtomicOutput | None = None  # windows_out, renamed into place once every run is read
    try:
        for run in open_runs(run_dirs, root, problems):
            runs.append(run)
            infos.append(run_info(run))
            hosts = {r: str(m.get("host") or "?") for r, m in run.manifests.items()}
            n_ranks = 0
            waves[run.key] = WaveBuilder(run.path, grid or GridOptions())
            for rank, rt in _reduced(run, waves[run.key], mapper):
                if rt is None or not rt.devices:
                    continue
                n_ranks += 1
                dt, st, wt = rank_rows(run.key, rank, hosts.get(rank, "?"), rt)
                devices.append(dt)
                if st is not None:
                    spans.append(st)
                if wt is not None:
                    if windows_out is not None:
                        if writer is None:
                            out_file = AtomicOutput(windows_out)
                            writer = pq.ParquetWriter(out_file.file, wt.schema, use_dictionary=_strings(wt))
                        writer.write_table(wt.cast(writer.schema))
                    kept.append(wt.select(list(KEPT_WINDOW_COLUMNS)))
            if n_ranks == 0:
                run.problems.append(f"{run.path}: no rank has samples; the run has no figures")
            problems.extend(run.problems)
            if progress is not None:
                progress.update(len(runs))
    except BaseException:
        if out_file is not None:
            out_file.discard()
        raise
    finally:
        if writer is not None:
            writer.close()
    if out_file is not None:
        out_file.commit()
    infos += sweep_gaps(run_dirs, {r.path for r in runs})
    if not runs:
        raise StoreError(f"{root}: no run could be read ({'; '.join(problems) or 'none found'})")
    analysis = assemble(runs, infos, devices, spans, kept, problems, grid, waves)
    analysis.windows_path = windows_out if writer else None
    return analysis


def assemble(
    runs: list[Run],
    infos: list[dict[str, Any]],
    devices: list[pa.Table],
    spans: list[pa.Table],
    kept: list[pa.Table],
    problems: list[str],
    grid: GridOptions | None = None,
    waves: dict[str, WaveBuilder] | None = None,
) -> Analysis:
    """Every table from the runs' per-rank rows (``devices``, ``spans`` and the ``kept`` window
    columns, each as :func:`analyze` builds them from :mod:`.rank_tables`), once the per-rank
    reduction is done, wherever it ran (``--engine spark`` is :func:`analyze` with Spark as its
    mapper: analysis/spark.py).
    ``waves``: run key -> its job power waveform built during the reduction (a run without one
    is read again for it)."""
    windows = pa.concat_tables(kept) if kept else None
    tables = _tables(infos, devices, spans, kept)
    stages = _stages(windows)
    kernels = kernel_table([(r.key, r.path, stages.get(r.key, {})) for r in runs], problems)
    if kernels.num_rows:  # only runs recorded with telemetry.profile_steps have traces
        tables["kernels"] = kernels
    # docs/grid.md:
    tables.update(grid_tables(runs, tables["runs"], grid or GridOptions(), problems, waves))
    tables.update(pipeline_tables(runs, windows))  # pp_bloat, pp_profile: runs with a pipeline
    return Analysis(tables, runs, problems, None, windows)


def rank_rows(
    run: str, rank: int, host: str, rt: RankTables
) -> tuple[pa.Table, pa.Table | None, pa.Table | None]:
    """A reduced rank's rows as Arrow tables: its ``ranks`` rows, its span row (None without
    measured steps) and its windows (None without any), keyed by run, rank and host."""
    devices = _with(_arrow(rt.devices), run=run, rank=str(rank), host=host)
    span = _with(_arrow(rt.span), run=run) if rt.span else None
    if not rt.windows:
        return devices, span, None
    wt = _with(_arrow(rt.windows), run=run)
    wt = wt.add_column(1, "rank", pa.array(np.full(wt.num_rows, rank, np.int32)))
    wt = wt.add_column(2, "host", pa.array([host] * wt.num_rows, pa.string()))
    return devices, span, wt


def _stages(windows: pa.Table | None) -> dict[str, dict[int, Any]]:
    """Each run's rank -> pipeline stage, from the window table (one row per rank)."""
    out: dict[str, dict[int, Any]] = {}
    if windows is None:
        return out
    per = windows.group_by(["run", "rank"]).aggregate([("pp_stage", "min")])
    for row in per.to_pylist():
        out.setdefault(row["run"], {})[row["rank"]] = row["pp_stage_min"]
    return out


def _tables(
    infos: list[dict[str, Any]], devices: list[pa.Table], spans: list[pa.Table], kept: list[pa.Table]
) -> dict[str, pa.Table]:
    con = duckdb.connect()
    dev = pa.concat_tables(devices, promote_options="default") if devices else _empty_devices()
    dev = dev.set_column(dev.column_names.index("rank"), "rank", dev.column("rank").cast(pa.int32()))
    con.register("devices", dev)
    sp = pa.concat_tables(spans) if spans else _EMPTY_SPANS
    con.register("spans", sp)
    runs = run_table(con, infos)
    tables = {
        "runs": runs,
        "ranks": dev,
        "nodes": node_table(con, dev),
        "platforms": platform_table(con, runs),
    }
    if kept:
        con.register("w", pa.concat_tables(kept))
        con.register("info", runs)
        tables.update(findings(con))
    return {k: tables[k] for k in TABLES if k in tables}


_EMPTY_SPANS = pa.table(
    {
        "run": pa.array([], pa.string()),
        "device_index": pa.array([], pa.int64()),
        "span_s": pa.array([], pa.float64()),
        "span_energy_j": pa.array([], pa.float64()),
        "span_energy_method": pa.array([], pa.string()),
        "span_energy_bound_j": pa.array([], pa.float64()),
        "measured_steps": pa.array([], pa.int64()),
    }
)


_DEVICE_FIGURES = (
    "power_avg_w", "power_peak_w", "temp_gpu_avg_c", "temp_gpu_peak_c", "temp_hbm_avg_c",
    "temp_hbm_peak_c", "clock_sm_avg_mhz",
)  # fmt: skip
"""The device figures the run table's SQL reads: present (empty) when no rank had samples."""


def _empty_devices() -> pa.Table:
    cols = {"run": pa.array([], pa.string()), "rank": pa.array([], pa.string())}
    return pa.table({**cols, **{c: pa.array([], pa.float64()) for c in _DEVICE_FIGURES}})


WINDOWS_CSV_MAX_ROWS = 200_000
"""Above this many windows their CSV is written only on request (``windows_csv=True``): a
32-rank hour has ~600k windows x 50 columns, a CSV of ~0.3 GB that costs seconds to write and
that no spreadsheet opens; ``windows.parquet`` holds the same."""


def write_tables(analysis: Analysis, out_dir: Path, windows_csv: bool | None = None) -> list[Path]:
    """Each table as ``<name>.parquet`` and ``<name>.csv`` in ``out_dir``, plus the window table's
    CSV beside its Parquet (``windows_csv``: always / never; None: when it has at most
    :data:`WINDOWS_CSV_MAX_ROWS` rows, else a line in ``problems.txt`` says so); returns the
    paths written."""
    make_dir(out_dir)
    written = []
    for name, table in analysis.tables.items():
        written.append(write_with(out_dir / f"{name}.parquet", partial(pq.write_table, table)))
        written.append(write_csv(out_dir / f"{name}.csv", table))
    path = analysis.windows_path
    if path is not None:
        written.append(path)
        with open_parquet(path, SIZE_CAPS["table"]) as pf:
            rows = pf.metadata.num_rows
            if windows_csv is None:
                windows_csv = rows <= WINDOWS_CSV_MAX_ROWS
                if not windows_csv:
                    analysis.problems.append(
                        f"windows.csv not written: {rows} windows (over {WINDOWS_CSV_MAX_ROWS}); "
                        "windows.parquet holds them all (charllm analyze --windows-csv writes the CSV anyway)"
                    )
            if windows_csv:
                schema = csv_schema(pf.schema_arrow)
                with atomic_file(path.with_suffix(".csv")) as f, pacsv.CSVWriter(f, schema) as w:
                    for batch in pf.iter_batches(batch_size=65536):
                        w.write_batch(spreadsheet_safe(batch))
                written.append(path.with_suffix(".csv"))
    written.append(write_text(out_dir / "problems.txt", "".join(f"{p}\n" for p in analysis.problems)))
    return written


def to_jsonable(analysis: Analysis) -> dict[str, Any]:
    """The tables as lists of row objects (NaN -> null) and the problems, for ``--format json``."""

    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and not math.isfinite(v) else v

    return {
        "tables": {
            name: [{k: clean(v) for k, v in row.items()} for row in t.to_pylist()]
            for name, t in analysis.tables.items()
        },
        "windows": str(analysis.windows_path) if analysis.windows_path else None,
        "problems": analysis.problems,
    }
