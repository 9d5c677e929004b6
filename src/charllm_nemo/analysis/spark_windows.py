"""``charllm analyze --engine spark``: every table of the local engine, and its per-window
table, with the per-rank reduction run by Spark.

The heavy part of the analysis, linear in samples, is the per-rank reduction: the attribution
of every window, each device's whole-span figures (``ranks``), the measured span's energy, the
excursions and the driver's throttle counters (:func:`.rank_tables.rank_tables`). Spark reads
every rank's samples and windows (exactly the files the hardened scan accepts, listed one by
one, the rank from each file's ``rank=N`` folder), groups them by (run, rank) and runs that very
function on each group in its Python workers (``cogroup(...).applyInArrow``: the group arrives
as Arrow, in the order the local engine reads it: file by file, row by row), so each reduction
is declared once and both engines run it. Spark's output is the rows of one rank each (one per
device, one per window, one span row per device): the driver gathers them and computes the
tables over them with the local engine's DuckDB SQL (:func:`.analyze.assemble`: ``runs``,
``ranks``, ``nodes``, ``platforms``, the findings, the kernels, grid and pipeline tables).
The tables equal the local engine's (tests/analysis/test_spark_windows.py, every column of every
table and of the window table, on a rough store).

What the local engine's reader does that this one does not: it skips an unreadable segment (a
Spark task fails on it instead), reads a column of the wrong type as null, and drops the later
of two segments covering the same time range; a store whose files pass the hardened scan and
were written by the tool has none of these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from charllm_nemo.analysis.analyze import KEPT_WINDOW_COLUMNS, Analysis, assemble, rank_rows
from charllm_nemo.analysis.grid_power import GridOptions
from charllm_nemo.analysis.load import SAMPLE_COLUMNS, RankArrays, Run, _numpy, find_runs, open_runs
from charllm_nemo.analysis.rank_tables import rank_tables
from charllm_nemo.analysis.run_info import run_info, sweep_gaps
from charllm_nemo.errors import StoreError
from charllm_nemo.telemetry.sampler import SAMPLES_SCHEMA
from charllm_nemo.telemetry.store import WINDOWS_SCHEMA

WINDOW_COLUMNS: tuple[str, ...] = tuple(c for c in WINDOWS_SCHEMA.names if c != "timing")
"""The window columns the reduction reads (``timing`` is a label no figure uses)."""

_INT_WINDOW_COLUMNS = tuple(c for c in WINDOW_COLUMNS if c not in ("kind", "name"))
_INT_SAMPLES = frozenset(c for c in SAMPLE_COLUMNS if pa.types.is_integer(SAMPLES_SCHEMA.field(c).type))
_PARTS = ("devices", "spans", "windows")
_FILE, _ROW = "file__", "row__"
_KEYS = pa.schema(
    [("part__", pa.string()), ("run__", pa.string()), ("rank__", pa.int64()), ("seq__", pa.int64())]
)
Order = dict[tuple[str, int], dict[str, list[str]]]


def _probe() -> dict[str, pa.Schema]:
    """The Arrow schema of each kind of row a rank gives (``devices``, ``spans``, ``windows``):
    the local code run on a three-sample rank with one step, so the schemas follow the code."""
    t = np.array([0, 10_000_000, 20_000_000], np.int64)
    samples = {c: np.arange(3, dtype=np.int64) if c in _INT_SAMPLES else np.ones(3) for c in SAMPLE_COLUMNS}
    samples["t_mono_ns"], samples["device_index"] = t, np.zeros(3, np.int64)
    windows: dict[str, np.ndarray[Any, Any]] = {c: np.zeros(1, np.int64) for c in _INT_WINDOW_COLUMNS}
    windows["t_end_mono_ns"] = t[-1:]
    windows["kind"], windows["name"] = np.array(["step"], object), np.array(["step"], object)
    dt, st, wt = rank_rows("run", 0, "host", rank_tables(RankArrays(0, samples, windows)))
    if st is None or wt is None:  # one measured step makes a span row and a window row
        raise RuntimeError("the reduction gave no span or window row for one measured step")
    return {"devices": dt.schema, "spans": st.schema, "windows": wt.schema}


SCHEMAS = _probe()
"""Each kind of row's Arrow schema, as the local code gives it."""

OUT_SCHEMA = pa.schema(
    [*_KEYS, *(pa.field(f"{part}__{f.name}", f.type) for part in _PARTS for f in SCHEMAS[part])]
)
"""The grouped map's output: each row's kind (``part__``), its run and rank and its position in
the rank's output, then every kind's columns prefixed with it (null in the other kinds' rows)."""


def _ordered(table: pa.Table, files: list[str]) -> pa.Table:
    """The rows in the local reader's order: file by file (the scan's order), row by row."""
    idx = pc.index_in(table.column(_FILE), value_set=pa.array(files, pa.string()))
    table = table.append_column("file_idx__", idx)
    return table.sort_by([("file_idx__", "ascending"), (_ROW, "ascending")])


def reduce_group(
    key: tuple[Any, ...],
    samples: pa.Table,
    windows: pa.Table,
    order: Order,
    hosts: dict[tuple[str, int], str],
) -> pa.Table:
    """One (run, rank) group: the local engine's reduction of it (nothing when it has no
    sample), as rows of :data:`OUT_SCHEMA`."""
    run, rank = str(key[0].as_py()), int(key[1].as_py())
    if samples.num_rows == 0:
        return OUT_SCHEMA.empty_table()
    files = order.get((run, rank), {})
    s = _ordered(samples, files.get("samples", []))
    w = _ordered(windows, files.get("windows", []))
    wa = _numpy(w, list(_INT_WINDOW_COLUMNS))
    for c in ("kind", "name"):
        wa[c] = np.asarray(w.column(c).to_pylist() if c in w.column_names else [None] * w.num_rows, object)
    rt = rank_tables(RankArrays(rank, _numpy(s, list(SAMPLE_COLUMNS)), wa))
    if not rt.devices:
        return OUT_SCHEMA.empty_table()
    dt, st, wt = rank_rows(run, rank, hosts.get((run, rank), "?"), rt)
    parts = {"devices": dt, "spans": st, "windows": wt}
    tables, seq = [], 0
    for part in _PARTS:
        table = parts[part]
        if table is None:
            continue
        n = table.num_rows
        cols: list[Any] = [
            pa.array([part] * n, pa.string()),
            pa.array([run] * n, pa.string()),
            pa.array(np.full(n, rank, np.int64)),
            pa.array(np.arange(seq, seq + n, dtype=np.int64)),
        ]
        seq += n
        for p in _PARTS:
            for f in SCHEMAS[p]:
                cols.append(table.column(f.name).cast(f.type) if p == part else pa.nulls(n, f.type))
        tables.append(pa.Table.from_arrays(cols, schema=OUT_SCHEMA))
    return pa.concat_tables(tables)


def unstack(table: pa.Table, part: str) -> pa.Table:
    """The rows of one kind, with their own column names."""
    rows = table.filter(pc.equal(table.column("part__"), part))
    names = [f.name for f in SCHEMAS[part]]
    return pa.Table.from_arrays([rows.column(f"{part}__{n}") for n in names], names=names)


def _read(session: Any, files: list[tuple[str, Path, Path]], schema: pa.Schema) -> Any:
    """One DataFrame of the given files (run key, run directory, file) with ``schema``'s columns
    (the store's types, given: Spark infers nothing, so no job reads the files' footers first),
    ``run``, ``rank`` (each file's ``rank=N`` folder, a Hive partition below the run directory)
    and each row's file name and position in it (``_metadata``), for :func:`_ordered`."""
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    typed = from_arrow_schema(pa.schema([*(f.with_nullable(True) for f in schema), ("rank", pa.int32())]))
    by_run: dict[tuple[str, Path], list[str]] = {}
    for run, run_dir, path in files:
        by_run.setdefault((run, run_dir), []).append(str(path))
    frames = []
    for (run, run_dir), paths in by_run.items():
        df = session.read.schema(typed).option("basePath", str(run_dir)).parquet(*paths)
        frames.append(
            df.select(
                F.lit(run).alias("run"),
                F.col("rank").cast("int").alias("rank"),
                *schema.names,
                F.col("_metadata.file_name").alias(_FILE),
                F.col("_metadata.row_index").alias(_ROW),
            )
        )
    out = frames[0]
    for f in frames[1:]:
        out = out.unionByName(f)
    return out


_SAMPLES_READ = pa.schema([SAMPLES_SCHEMA.field(c) for c in SAMPLE_COLUMNS])
_WINDOWS_READ = pa.schema([WINDOWS_SCHEMA.field(c) for c in WINDOW_COLUMNS])


def spark_analysis(session: Any, path: str | Path, grid: GridOptions | None = None) -> Analysis:
    """Every run under ``path`` (found and opened as the local engine does) analysed with the
    per-rank reduction on ``session`` (a pyspark ``SparkSession``): the local engine's
    :class:`.analyze.Analysis`, its ``windows`` the whole per-window table."""
    root = Path(path)
    run_dirs = find_runs(root)
    runs: list[Run] = []
    problems: list[str] = []
    infos: list[dict[str, Any]] = []
    samples_files: list[tuple[str, Path, Path]] = []
    window_files: list[tuple[str, Path, Path]] = []
    order: Order = {}
    hosts: dict[tuple[str, int], str] = {}
    for run in open_runs(run_dirs, root, problems):
        d = run.path
        runs.append(run)
        infos.append(run_info(run))
        for r, rf in sorted(run.files.ranks.items()):
            samples_files += [(run.key, d, p) for p in rf.samples]
            window_files += [(run.key, d, p) for p in rf.windows]
            order[(run.key, r)] = {
                "samples": [p.name for p in rf.samples],
                "windows": [p.name for p in rf.windows],
                "folder": [str(rf.folder)],
            }
            hosts[(run.key, r)] = str(run.manifests.get(r, {}).get("host") or "?")
    infos += sweep_gaps(run_dirs, {r.path for r in runs})
    if not runs:
        raise StoreError(f"{root}: no run could be read ({'; '.join(problems) or 'none found'})")
    out = _gather(session, samples_files, window_files, order, hosts)
    # the local engine's row order: runs as found, ranks ascending, each rank's rows as it gave them
    out = out.sort_by([("run__", "ascending"), ("rank__", "ascending"), ("seq__", "ascending")])
    run_keys = [r.key for r in runs]
    got = {
        part: {k: unstack(out.filter(pc.equal(out.column("run__"), k)), part) for k in run_keys}
        for part in _PARTS
    }
    seen = set(zip(out.column("run__").to_pylist(), out.column("rank__").to_pylist(), strict=True))
    for run in runs:
        for r, rf in sorted(run.files.ranks.items()):
            if (run.key, r) not in seen:
                run.problems.append(f"{rf.folder}: no readable samples; rank skipped")
        if not got["devices"][run.key].num_rows:
            run.problems.append(f"{run.path}: no rank has samples; the run has no figures")
        problems.extend(run.problems)
    every = [got["windows"][k] for k in run_keys if got["windows"][k].num_rows]
    analysis = assemble(
        runs,
        infos,
        [got["devices"][k] for k in run_keys if got["devices"][k].num_rows],
        [got["spans"][k] for k in run_keys if got["spans"][k].num_rows],
        [t.select(list(KEPT_WINDOW_COLUMNS)) for t in every],
        problems,
        grid,
    )
    analysis.windows = pa.concat_tables(every) if every else None
    return analysis


def _gather(
    session: Any,
    samples_files: list[tuple[str, Path, Path]],
    window_files: list[tuple[str, Path, Path]],
    order: Order,
    hosts: dict[tuple[str, int], str],
) -> pa.Table:
    """The grouped map's output, brought to the driver (each rank's rows: small beside its
    samples)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    samples = _read(session, samples_files, _SAMPLES_READ)
    if window_files:
        windows = _read(session, window_files, _WINDOWS_READ)
    else:  # no window at all: an empty side with the columns the reduction reads
        empty = pa.schema([("run", pa.string()), ("rank", pa.int32()), *_WINDOWS_READ,
                           (_FILE, pa.string()), (_ROW, pa.int64())])  # fmt: skip
        windows = session.createDataFrame([], from_arrow_schema(empty))

    def reduce(key: tuple[Any, ...], s: pa.Table, w: pa.Table) -> pa.Table:
        return reduce_group(key, s, w, order, hosts)

    grouped = samples.groupBy("run", "rank").cogroup(windows.groupBy("run", "rank"))
    table: pa.Table = grouped.applyInArrow(reduce, from_arrow_schema(OUT_SCHEMA)).toArrow()
    return table.cast(OUT_SCHEMA)
