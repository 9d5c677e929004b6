"""Write a run directory in the store's real format from arrays: for tests with hand-computed
traces and for the analysis benchmark (a 32-rank hour at 100 Hz without sampling for an hour).

The files are what the telemetry writer produces (docs/store.md): ``rank=N/manifest.json``,
``samples-NNNNNN.parquet`` with the samples schema, ``windows-NNNNNN.parquet`` with the windows
schema, and at the top ``summary.json`` when given. Columns not given are null; the manifest
says ``synthetic: true`` and ``backend: synthetic`` unless told otherwise."""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from charllm_nemo.telemetry.sample_loop import DEFAULT_HZ
from charllm_nemo.telemetry.sampler import SAMPLES_SCHEMA
from charllm_nemo.telemetry.schema import INT_NULL
from charllm_nemo.telemetry.store import WINDOWS_SCHEMA
from charllm_nemo.telemetry.write import make_dir, write_text, write_with

Arrays = Mapping[str, Any]


def _table(cols: Arrays, schema: pa.Schema, n: int) -> pa.Table:
    arrays = []
    for f in schema:
        if f.name not in cols:
            arrays.append(pa.nulls(n, f.type))
            continue
        v = np.asarray(cols[f.name]) if not isinstance(cols[f.name], list) else cols[f.name]
        if isinstance(v, np.ndarray) and v.dtype.kind == "i":
            null = v == INT_NULL
            arrays.append(pa.array(v, f.type, mask=null if null.any() else None))
        elif isinstance(v, np.ndarray) and v.dtype.kind == "f" and pa.types.is_integer(f.type):
            arrays.append(pa.array(np.nan_to_num(v, nan=0).astype(np.int64), f.type, mask=np.isnan(v)))
        elif isinstance(v, np.ndarray) and v.dtype.kind == "f":
            arrays.append(pa.array(v, f.type, from_pandas=True))
        else:
            arrays.append(pa.array(v, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def write_rank(
    run_dir: Path,
    rank: int,
    samples: Arrays,
    windows: Arrays,
    manifest: Mapping[str, Any] | None = None,
    segment_rows: int = 50_000,
) -> Path:
    """Write one rank's folder. ``samples``/``windows``: column -> array (ints: INT_NULL = null,
    floats: NaN = null); ``segment_rows``: rows per samples segment. Returns the folder."""
    folder = run_dir / f"rank={rank}"
    make_dir(folder)
    n = len(samples["t_mono_ns"])
    t = np.asarray(samples["t_mono_ns"], dtype=np.int64)
    defaults = {
        "source": ["synthetic"] * n,
        "device_index": np.zeros(n, np.int64),
        "t_wall_ns": t + 1_700_000_000 * 10**9,  # a wall clock: the schema requires one
        "read_ns": np.zeros(n, np.int64),
    }
    table = _table({**defaults, **samples}, SAMPLES_SCHEMA, n)
    for k, start in enumerate(range(0, max(n, 1), segment_rows)):
        part = table.slice(start, segment_rows)
        write_with(folder / f"samples-{k:06d}.parquet", partial(pq.write_table, part, compression="lz4"))
    m = len(windows["t_begin_mono_ns"])
    if m:
        wt = _table(
            {"timing": ["host"] * m, "t_begin_wall_ns": windows["t_begin_mono_ns"], **windows},
            WINDOWS_SCHEMA,
            m,
        )
        write_with(folder / "windows-000000.parquet", lambda f: pq.write_table(wt, f))
    base: dict[str, Any] = {
        "kind": "charllm-nemo telemetry",
        "store_format": 1,
        "status": "complete",
        "rank": rank,
        "world_size": 1,
        "host": "node0",
        "backend": "synthetic",
        "synthetic": True,
        "sampling_hz": DEFAULT_HZ,
        "devices": [
            {"index": 0, "name": "Synthetic accelerator (model, not hardware)", "vendor": "synthetic"}
        ],
    }
    base.update(manifest or {})
    write_text(folder / "manifest.json", json.dumps(base))
    return folder


def write_summary(run_dir: Path, summary: Mapping[str, Any]) -> None:
    """``summary.json`` at the top of the run directory."""
    write_text(run_dir / "summary.json", json.dumps(summary))
