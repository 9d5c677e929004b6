"""Read a run directory back: one rank, or a whole run as one table.

A run directory is untrusted input: its files are found by
:func:`~charllm_nemo.telemetry.layout.scan_run` (documented names only, no links, regular files
only) and read with bounded reads. A corrupt or truncated segment (a disk that filled, a file
someone copied half of), a manifest with fields of the wrong type and anything the scan ignored
are reported in ``problems``; they never stop the rest from loading. Temporary files left by a
killed writer (dot-prefixed) are ignored.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from charllm_nemo.errors import StoreError
from charllm_nemo.telemetry.filecheck import validate_manifest
from charllm_nemo.telemetry.layout import SIZE_CAPS, RankFiles, RunFiles, read_json, read_parquet, scan_run
from charllm_nemo.telemetry.sampler import SAMPLES_SCHEMA
from charllm_nemo.telemetry.schema import INT_NULL
from charllm_nemo.telemetry.store import WINDOWS_SCHEMA


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
    """The run's accepted ranks (:func:`~charllm_nemo.telemetry.layout.scan_run`), ascending;
    StoreError when there is none."""
    return accepted_ranks(scan_run(run_dir))


def accepted_ranks(files: RunFiles) -> list[int]:
    """``files``' ranks, ascending; StoreError naming the folder when it has none."""
    if not files.ranks:
        raise StoreError(
            f"{files.path} is not a charllm run directory (no rank=N folders); "
            "point at the folder given as --out / telemetry.out_dir"
        )
    return files.rank_ids


def _read_segments(paths: tuple[Path, ...], kind: str, schema: pa.Schema, problems: list[str]) -> pa.Table:
    tables = []
    for p in paths:
        try:
            t = read_parquet(p)
            tables.append(t.select(schema.names).cast(schema))
        except Exception as exc:  # pyarrow raises several types for a damaged file
            msg = f"{p}: unreadable {kind} segment skipped ({type(exc).__name__}: {exc})"
            problems.append(msg)
            warnings.warn(msg, CorruptSegmentWarning, stacklevel=3)
    if not tables:
        return schema.empty_table()
    return pa.concat_tables(tables)


def read_manifest(files: RankFiles, problems: list[str]) -> dict[str, Any]:
    """The rank's manifest, validated against docs/store.md (fields of the wrong type are
    dropped, each with a line in ``problems``); ``{}`` when absent or unreadable."""
    if files.manifest is None:
        problems.append(f"{files.folder / 'manifest.json'}: no readable manifest")
        return {}
    return validate_manifest(
        read_json(files.manifest, SIZE_CAPS["manifest"], problems), files.manifest, problems
    )


def load_rank(run_dir: str | os.PathLike[str], rank: int, files: RankFiles | None = None) -> RankData:
    """Load one rank's manifest, samples and windows (segments in write order). ``files``: the
    rank's entry of an earlier :func:`scan_run` (else the run is scanned now; what the scan
    ignored in this rank's folder is then in ``problems``)."""
    problems: list[str] = []
    if files is None:
        run = scan_run(run_dir)
        if rank not in run.ranks:
            folder = Path(run_dir) / f"rank={rank}"
            raise StoreError(
                f"{folder} is not a rank folder of the run; ranks present: {accepted_ranks(run)}"
            )
        files = run.ranks[rank]
        problems += [
            i.message() for i in run.ignored if i.kind != "temporary" and files.folder in i.path.parents
        ]
    manifest = read_manifest(files, problems)
    status = manifest.get("status")
    if status == "running":
        problems.append(
            f"rank {rank}: manifest status is 'running': the process did not close the store "
            "(killed?); data up to the last flush is present"
        )
    elif status == "killed":
        problems.append(
            f"rank {rank}: the training process was killed; its telemetry process stored every "
            "sample and every window finished before that (windows still open are missing)"
        )
    samples = _read_segments(files.samples, "samples", SAMPLES_SCHEMA, problems)
    windows = _read_segments(files.windows, "windows", WINDOWS_SCHEMA, problems)
    return RankData(rank, manifest, samples, windows, problems)


def load_run(run_dir: str | os.PathLike[str], files: RunFiles | None = None) -> RunData:
    """Load every rank of a run; tables gain an int32 ``rank`` column as their first column.
    Only what :func:`scan_run` accepts is read (``files``: its result, if the caller has it);
    what it ignored is in ``problems``."""
    files = scan_run(run_dir) if files is None else files
    ranks = accepted_ranks(files)
    manifests: dict[int, dict[str, Any]] = {}
    samples, windows = [], []
    problems = files.problems()
    for r in ranks:
        rd = load_rank(run_dir, r, files.ranks[r])
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
