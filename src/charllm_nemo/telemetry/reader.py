"""Read a run directory back: one rank, or a whole run as one table.

A corrupt or truncated segment (a disk that filled, a file someone copied half of) is skipped
and reported in ``problems``; it never stops the rest from loading. Temporary files left by a
killed writer (dot-prefixed) are ignored.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from charllm_nemo.errors import StoreError
from charllm_nemo.telemetry.sampler import SAMPLES_SCHEMA
from charllm_nemo.telemetry.schema import INT_NULL
from charllm_nemo.telemetry.store import WINDOWS_SCHEMA

_RANK_DIR = re.compile(r"^rank=(\d+)$")
_SEGMENT = re.compile(r"^(samples|windows)-(\d+)\.parquet$")


class CorruptSegmentWarning(UserWarning):
    """A segment could not be read and was skipped."""


@dataclass
class RankData:
    """One rank's telemetry: samples and windows tables, its manifest, and what was skipped."""

    rank: int
    manifest: dict[str, Any]
    samples: pa.Table
    windows: pa.Table
    problems: list[str] = field(default_factory=list)


@dataclass
class RunData:
    """A whole run: every rank's tables concatenated with a ``rank`` column."""

    path: Path
    manifests: dict[int, dict[str, Any]]
    samples: pa.Table
    windows: pa.Table
    problems: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.manifests)


def list_ranks(run_dir: str | os.PathLike[str]) -> list[int]:
    path = Path(run_dir)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise StoreError(f"run directory {path} {what}")
    ranks = sorted(int(m.group(1)) for p in path.iterdir() if p.is_dir() and (m := _RANK_DIR.match(p.name)))
    if not ranks:
        raise StoreError(
            f"{path} is not a charllm run directory (no rank=N folders); "
            "point at the folder given as --out / telemetry.out_dir"
        )
    return ranks


def _read_segments(folder: Path, kind: str, schema: pa.Schema, problems: list[str]) -> pa.Table:
    segs = sorted(
        (int(m.group(2)), p) for p in folder.iterdir() if (m := _SEGMENT.match(p.name)) and m.group(1) == kind
    )
    tables = []
    for _, p in segs:
        try:
            t = pq.read_table(p)
            tables.append(t.select(schema.names).cast(schema))
        except Exception as exc:  # pyarrow raises several types for a damaged file
            msg = f"{p}: unreadable {kind} segment skipped ({type(exc).__name__}: {exc})"
            problems.append(msg)
            warnings.warn(msg, CorruptSegmentWarning, stacklevel=3)
    if not tables:
        return schema.empty_table()
    return pa.concat_tables(tables)


def load_rank(run_dir: str | os.PathLike[str], rank: int) -> RankData:
    """Load one rank's manifest, samples and windows (segments in write order)."""
    folder = Path(run_dir) / f"rank={rank}"
    if not folder.is_dir():
        raise StoreError(f"{folder} does not exist; ranks present: {list_ranks(run_dir)}")
    problems: list[str] = []
    manifest: dict[str, Any] = {}
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        problems.append(f"{folder / 'manifest.json'}: unreadable manifest ({exc})")
    if manifest.get("status") == "running":
        problems.append(
            f"rank {rank}: manifest status is 'running': the process did not close the store "
            "(killed?); data up to the last flush is present"
        )
    elif manifest.get("status") == "killed":
        problems.append(
            f"rank {rank}: the training process was killed; its telemetry process stored every "
            "sample and every window finished before that (windows still open are missing)"
        )
    samples = _read_segments(folder, "samples", SAMPLES_SCHEMA, problems)
    windows = _read_segments(folder, "windows", WINDOWS_SCHEMA, problems)
    return RankData(rank, manifest, samples, windows, problems)


def load_run(run_dir: str | os.PathLike[str]) -> RunData:
    """Load every rank of a run; tables gain an int32 ``rank`` column as their first column."""
    ranks = list_ranks(run_dir)
    manifests: dict[int, dict[str, Any]] = {}
    samples, windows, problems = [], [], []
    for r in ranks:
        rd = load_rank(run_dir, r)
        manifests[r] = rd.manifest
        problems.extend(rd.problems)
        samples.append(rd.samples.add_column(0, "rank", pa.array(np.full(rd.samples.num_rows, r, np.int32))))
        windows.append(rd.windows.add_column(0, "rank", pa.array(np.full(rd.windows.num_rows, r, np.int32))))
    return RunData(Path(run_dir), manifests, pa.concat_tables(samples), pa.concat_tables(windows), problems)


def to_arrays(table: pa.Table, columns: list[str] | None = None) -> dict[str, np.ndarray]:
    """Arrow columns -> numpy with the in-memory null convention (NaN floats, INT_NULL ints)."""
    out: dict[str, np.ndarray] = {}
    for name in columns or table.column_names:
        col = table.column(name)
        typ = col.type
        if pa.types.is_floating(typ):
            out[name] = col.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
        elif pa.types.is_integer(typ):
            out[name] = pc.fill_null(col, INT_NULL).to_numpy().astype(np.int64, copy=False)
        else:
            out[name] = np.asarray(col.to_pylist(), dtype=object)
    return out
