"""The grouped map of ``--engine spark`` (analysis/spark_windows.py) without a JVM: a rank's rows
arrive in any order, as Spark hands a group over, and the reduction still gives the local
engine's rows for that rank, value for value (the order rebuilt from file names and row
positions); a group without samples gives nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from charllm_nemo.analysis.analyze import rank_rows
from charllm_nemo.analysis.load import open_run
from charllm_nemo.analysis.rank_tables import reduce_files
from charllm_nemo.analysis.spark_windows import (
    _FILE,
    _ROW,
    _SAMPLES_READ,
    _WINDOWS_READ,
    OUT_SCHEMA,
    reduce_group,
    unstack,
)

from .helpers import rough_run


def _as_spark_gives(paths: tuple[Path, ...], schema: pa.Schema, seed: int) -> pa.Table:
    """The files' rows with the columns Spark's read selects, shuffled."""
    parts = []
    for p in paths:
        t = pq.read_table(p)
        cols = {f.name: pa.nulls(t.num_rows, f.type) for f in schema}
        cols.update({f.name: t.column(f.name).cast(f.type) for f in schema if f.name in t.column_names})
        cols[_FILE] = pa.array([p.name] * t.num_rows, pa.string())
        cols[_ROW] = pa.array(np.arange(t.num_rows, dtype=np.int64))
        parts.append(pa.table(cols))
    table = pa.concat_tables(parts)
    return table.take(pa.array(np.random.default_rng(seed).permutation(table.num_rows)))


def test_a_shuffled_group_reduces_to_the_local_engines_rows(tmp_path: Path) -> None:
    rough_run(tmp_path / "run", seed=3)
    run = open_run(tmp_path / "run", tmp_path)
    order = {
        (run.key, r): {"samples": [p.name for p in rf.samples], "windows": [p.name for p in rf.windows]}
        for r, rf in run.files.ranks.items()
    }
    hosts = {(run.key, r): str(m.get("host")) for r, m in run.manifests.items()}
    for r, rf in sorted(run.files.ranks.items()):
        assert len(rf.samples) > 1  # several segments: the order across files matters
        samples = _as_spark_gives(rf.samples, _SAMPLES_READ, seed=r)
        windows = _as_spark_gives(rf.windows, _WINDOWS_READ, seed=10 + r)
        out = reduce_group((pa.scalar(run.key), pa.scalar(r)), samples, windows, order, hosts)
        assert out.schema == OUT_SCHEMA
        _, rt, _ = reduce_files(rf)
        assert rt is not None
        want = dict(
            zip(("devices", "spans", "windows"), rank_rows(run.key, r, hosts[(run.key, r)], rt), strict=True)
        )
        for part, table in want.items():
            assert table is not None
            got = unstack(out, part)
            assert got.num_rows == table.num_rows > 0, part
            assert got.equals(table.cast(got.schema)), part


def test_a_group_without_samples_gives_no_row(tmp_path: Path) -> None:
    rough_run(tmp_path / "run", seed=4)
    run = open_run(tmp_path / "run", tmp_path)
    rf = run.files.ranks[0]
    samples = _as_spark_gives(rf.samples, _SAMPLES_READ, seed=0).slice(0, 0)
    windows = _as_spark_gives(rf.windows, _WINDOWS_READ, seed=0)
    out = reduce_group((pa.scalar(run.key), pa.scalar(0)), samples, windows, {}, {})
    assert out.num_rows == 0 and out.schema == OUT_SCHEMA
