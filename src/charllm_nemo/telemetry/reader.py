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
from charllm_nemo.telemetry.filecheck import printable, validate_manifest
from charllm_nemo.telemetry.layout import (
    SIZE_CAPS,
    RankFiles,
    RunFiles,
    UnpackBudget,
    UnsafeFileError,
    read_json,
    read_parquet,
    scan_run,
)
from charllm_nemo.telemetry.overlap import read_once
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


MAX_DEVICES_PER_RANK = 256
"""Most distinct ``device_index`` values a rank's samples may hold (a node has at most 8-16
accelerators; a rank usually samples one). Rows of further devices are dropped, with a line in
``problems``: every reader's work is per device, so 30,000 ids in one segment would cost
minutes and gigabytes."""


def _kind(typ: pa.DataType) -> str:
    if pa.types.is_dictionary(typ):
        return _kind(typ.value_type)
    if pa.types.is_integer(typ):
        return "int"
    if pa.types.is_floating(typ):
        return "float"
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return "string"
    if pa.types.is_boolean(typ):
        return "bool"
    return str(typ)


_CASTS_TO = {"int": ("int",), "float": ("float", "int"), "string": ("string",), "bool": ("bool",)}
"""The kinds of a file's column that convert to the expected kind without loss of meaning
(an integer energy counter read where a float belongs, say); anything else is the wrong type."""


def conform(table: pa.Table, schema: pa.Schema, path: Path, kind: str, problems: list[str]) -> pa.Table:
    """``table`` (one segment as read) with exactly ``schema``'s columns and types: a column of
    the wrong type (strings where numbers belong, bytes that are not UTF-8) or missing is all
    null, with a line in ``problems`` naming the file and the column; extra columns dropped."""
    cols = []
    blank: dict[
        pa.DataType, pa.Array
    ] = {}  # one all-null array per type, shared (Arrow arrays are immutable)

    def nulls(typ: pa.DataType) -> pa.Array:
        if typ not in blank:
            blank[typ] = pa.nulls(table.num_rows, typ)
        return blank[typ]

    for f in schema:
        want = _kind(f.type)
        if f.name not in table.column_names:
            cols.append(nulls(f.type))
            continue
        col = table.column(f.name)
        got = _kind(col.type)
        try:
            if got not in _CASTS_TO.get(want, (want,)):
                raise TypeError(f"holds {col.type}, expected {f.type}")
            if want == "string":
                col.validate(full=True)  # a string column with bytes that are not UTF-8
            col = col.cast(f.type, safe=want != "float")
        except (TypeError, pa.ArrowException) as exc:
            problems.append(
                f"{path}: {kind} column {printable(f.name)!r} {printable(exc, 120)}; read as null"
            )
            col = nulls(f.type)
        cols.append(_bounded_values(col, f.name, path, problems) if want in ("int", "float") else col)
    return pa.Table.from_arrays(cols, schema=nullable(schema))


MAX_ABS_FLOAT = 1e12
"""Largest magnitude a float sample or window value may have (watts, degrees, MHz, seconds,
joules are all far below); NaN, inf and larger values are read as null, so that no sum or
figure axis of a reader overflows."""

MAX_ABS_INT = 2**62
"""Most negative an integer value may be (below -2**62, other than the null marker, is read as
null). Large positive values are kept: a 64-bit hardware counter legitimately passes 2**62
(stored exactly, tests/telemetry/test_sampler_process.py), and the readers take differences
only of non-negative counter values, which always fit int64."""


def _all_in_bounds(col: Any) -> bool:
    """True when no value of ``col`` (float64 or int64, nulls aside) is out of bounds: the
    common case, told by its minimum and maximum (two passes, no temporaries; a NaN makes both
    NaN, so a float column holding one is not in bounds here). False: not known, check each."""
    if pa.types.is_floating(col.type):
        x = (pc.fill_null(col, 0.0) if col.null_count else col).to_numpy()
        return bool(x.min() >= -MAX_ABS_FLOAT) and bool(x.max() <= MAX_ABS_FLOAT)
    if col.type != pa.int64():
        return False
    low = pc.min(col).as_py()  # nulls skipped; exact in int64
    return low is None or low > -MAX_ABS_INT


def _bounded_values(col: Any, name: str, path: Path, problems: list[str]) -> Any:
    if col.null_count == len(col) or _all_in_bounds(col):
        return col
    if pa.types.is_floating(col.type):
        bad = pc.invert(pc.less_equal(pc.abs(col), MAX_ABS_FLOAT))  # NaN compares false: bad
    else:
        wide = col.cast(pa.int64())  # exact comparisons: int64 values do not all fit a float
        big = pa.scalar(MAX_ABS_INT, pa.int64())
        bad = pc.and_(
            pc.less_equal(wide, pc.negate(big)), pc.not_equal(wide, pa.scalar(INT_NULL, pa.int64()))
        )
    n_bad = pc.sum(pc.fill_null(bad, False).cast(pa.int64())).as_py() or 0
    if not n_bad:
        return col
    problems.append(
        f"{path}: column {printable(name)!r}: {n_bad} value(s) not finite or beyond "
        f"{MAX_ABS_FLOAT:g} in magnitude; read as null"
    )
    return pc.if_else(pc.fill_null(bad, False), pa.nulls(len(col), col.type), col)


def bound_devices(table: pa.Table, where: Path, problems: list[str]) -> pa.Table:
    """``table`` with rows of at most :data:`MAX_DEVICES_PER_RANK` devices (the lowest ids)."""
    if "device_index" not in table.column_names or table.num_rows == 0:
        return table
    ids = pc.unique(table.column("device_index").drop_null())
    if len(ids) <= MAX_DEVICES_PER_RANK:
        return table
    keep = pc.array_take(pc.sort_indices(ids), pa.array(range(MAX_DEVICES_PER_RANK)))
    kept_ids = pc.take(ids, keep)
    problems.append(
        f"{where}: samples of {len(ids)} distinct device ids; only the {MAX_DEVICES_PER_RANK} lowest "
        "are read (a rank samples the accelerators of one node)"
    )
    return table.filter(pc.is_in(table.column("device_index"), value_set=kept_ids))


def read_segments(
    paths: tuple[Path, ...],
    kind: str,
    schema: pa.Schema,
    problems: list[str],
    columns: list[str] | None = None,
) -> pa.Table | None:
    """A rank's segments of one kind, each read with :func:`read_parquet` (bounded: size,
    unpacked bytes, rows) and conformed to ``schema`` (only ``columns`` of it where given),
    concatenated, devices bounded; None when no segment could be read. Every reader of the
    store (``inspect``, ``analyze``, ``report``, ``advise``) reads segments here. An unreadable
    segment is skipped with a line in ``problems`` (and a :class:`CorruptSegmentWarning`)."""
    if columns is not None:
        schema = pa.schema([schema.field(c) for c in columns])
    tables = []
    read: list[Path] = []

    def null_ok(name: str, typ: pa.DataType) -> bool:
        """An all-null column that :func:`conform` takes as it is (no line in ``problems``):
        left unread, conform makes the same nulls."""
        want = _kind(schema.field(name).type)
        return _kind(typ) in _CASTS_TO.get(want, (want,))

    budget = UnpackBudget()  # the files held together: a bomb spread over many is refused too
    for p in paths:
        try:
            t = read_parquet(p, columns=schema.names, missing_ok=True, budget=budget, null_ok=null_ok)
            tables.append(conform(t, schema, p, kind, problems))
            read.append(p)
        except UnsafeFileError as exc:  # not opened: says which file and why itself
            msg = f"{exc} ({kind} segment skipped)"
            problems.append(msg)
            warnings.warn(printable(msg, 1000), CorruptSegmentWarning, stacklevel=3)
        except Exception as exc:  # pyarrow raises several types for a damaged file
            msg = f"{p}: unreadable {kind} segment skipped ({type(exc).__name__}: {printable(exc)})"
            problems.append(msg)
            warnings.warn(printable(msg, 1000), CorruptSegmentWarning, stacklevel=3)
    if not tables:
        return None
    tables = read_once(list(zip(read, tables, strict=True)), kind, problems)  # overlapping ranges
    table = pa.concat_tables(tables).combine_chunks()
    return bound_devices(table, paths[0].parent, problems)


def nullable(schema: pa.Schema) -> pa.Schema:
    """``schema`` with every field nullable: what :func:`conform` gives (a hostile file's
    column of the wrong type is read as null, whatever the writer's schema promises)."""
    return pa.schema([f.with_nullable(True) for f in schema])


def _read_segments(paths: tuple[Path, ...], kind: str, schema: pa.Schema, problems: list[str]) -> pa.Table:
    table = read_segments(paths, kind, schema, problems)
    return nullable(schema).empty_table() if table is None else table


def read_manifest(files: RankFiles, problems: list[str]) -> dict[str, Any]:
    """The rank's manifest, validated against docs/store.md (fields of the wrong type are
    dropped, each with a line in ``problems``); ``{}`` when absent or unreadable."""
    if files.manifest is None:
        problems.append(f"{files.folder / 'manifest.json'}: no readable manifest")
        return {}
    raw = read_json(files.manifest, SIZE_CAPS["manifest"], problems)
    manifest = validate_manifest(raw, files.manifest, problems)
    if manifest.get("rank", files.rank) != files.rank:  # a rank folder copied or renamed
        problems.append(
            f"{files.manifest}: field 'rank' says {manifest['rank']}, but the folder is "
            f"rank={files.rank}; read as rank {files.rank}"
        )
    return manifest


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
