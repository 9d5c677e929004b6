"""Find the runs under a path and load them one rank at a time.

A path is a run directory (it holds ``rank=N`` folders) or any tree of them: a sweep laid out as
``sweep=<name>/run=<key>/rank=<r>/``, or a folder of run directories. Every file is found and
opened through :mod:`charllm_nemo.telemetry.layout` (the one place that decides what a run
directory may hold: no links followed, regular files only, size caps), and every problem
(a missing rank, an unreadable segment, a file that is not what it claims) is collected as a
line for the report, never raised: the rest is analysed.

Memory: a rank is loaded, reduced to its tables and dropped before the next one (the analysis
never holds a whole run, let alone a sweep, as arrays or Python objects).
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from charllm_nemo.analysis.arrow_init import settle_pandas_check
from charllm_nemo.errors import StoreError
from charllm_nemo.telemetry.filecheck import validate_summary
from charllm_nemo.telemetry.layout import SIZE_CAPS, RankFiles, RunFiles, read_bounded, read_json, scan_run
from charllm_nemo.telemetry.reader import nullable, read_manifest, read_segments
from charllm_nemo.telemetry.sampler import SAMPLES_SCHEMA
from charllm_nemo.telemetry.schema import FLOAT_METRICS, INT_METRICS, INT_NULL
from charllm_nemo.telemetry.store import WINDOWS_SCHEMA

settle_pandas_check()  # the analysis builds Arrow tables, never pandas ones: pandas is not imported

MAX_DEPTH = 6
"""How deep below the given path run directories are looked for (a sweep is two levels)."""

MAX_WORLD_SIZE = 1_000_000
"""Largest ``world_size`` a manifest may claim (today's largest jobs run ~10^5 ranks); a larger
one is reported, never allocated for."""

SAMPLE_COLUMNS: tuple[str, ...] = ("t_mono_ns", "device_index", *FLOAT_METRICS, *INT_METRICS)
"""The sample columns the analysis reads (numeric only: ``source`` is the manifest's backend)."""


@dataclass
class Run:
    """One run directory: what it holds, its configuration, and what was wrong with it."""

    path: Path
    key: str
    sweep: str | None
    files: RunFiles
    manifests: dict[int, dict[str, Any]]
    config: dict[str, Any]
    summary: dict[str, Any]
    problems: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        """Ranks with a folder, ascending."""
        return self.files.rank_ids


@dataclass
class RankArrays:
    """One rank's samples as numpy arrays (NaN / INT_NULL for null) and its windows."""

    rank: int
    samples: dict[str, np.ndarray[Any, Any]]
    windows: dict[str, np.ndarray[Any, Any]]


def _is_run_dir(path: Path) -> bool:
    try:
        return any(e.name.startswith("rank=") and e.is_dir(follow_symlinks=False) for e in os.scandir(path))
    except OSError:
        return False


def find_runs(path: str | os.PathLike[str]) -> list[Path]:
    """Run directories at or below ``path`` (depth <= :data:`MAX_DEPTH`), sorted; links are not
    followed below ``path``. Raises StoreError when ``path`` is not a directory or holds no run."""
    root = Path(path)
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise StoreError(f"{root} {what}: give a run directory or a sweep directory")
    if _is_run_dir(root):
        return [root]
    found: list[Path] = []
    base_depth = len(root.parts)
    for dirpath, dirnames, _ in os.walk(root, followlinks=False):
        here = Path(dirpath)
        if len(here.parts) - base_depth >= MAX_DEPTH:
            dirnames[:] = []
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "rank=")))
        runs = [d for d in dirnames if _is_run_dir(here / d)]
        found += [here / d for d in runs]
        # Not below a run: its traces/rank=N/ folders hold profiler traces, not another run.
        dirnames[:] = [d for d in dirnames if d not in runs]
    found = _latest_attempts(found)
    if not found:
        raise StoreError(
            f"{root} holds no charllm run (no folder with rank=N sub-folders within {MAX_DEPTH} levels); "
            "give the directory written by charllm train / charllm telemetry, or a sweep directory"
        )
    return sorted(found)


_ATTEMPT = re.compile(r"^attempt=([0-9]{1,6})$")


def _latest_attempts(paths: list[Path]) -> list[Path]:
    """Of a sweep's ``run=<key>/attempt=<n>`` folders, only each configuration's latest attempt
    (earlier ones were preempted or failed, and are superseded)."""
    best: dict[Path, tuple[int, Path]] = {}
    out = []
    for p in paths:
        m = _ATTEMPT.match(p.name)
        if m is None:
            out.append(p)
        elif p.parent not in best or int(m.group(1)) > best[p.parent][0]:
            best[p.parent] = (int(m.group(1)), p)
    return sorted(out + [p for _, p in best.values()])


def _yaml_config(files: RunFiles, problems: list[str]) -> dict[str, Any]:
    if files.config is None:
        return {}
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:  # PyYAML comes with hydra; the manifests hold the same config as JSON
        return {}
    try:
        data = yaml.safe_load(read_bounded(files.config, SIZE_CAPS["config"]))
    except Exception as exc:  # yaml raises many error types; the run is still analysed
        problems.append(f"{files.config}: unreadable config ({type(exc).__name__}); manifest config used")
        return {}
    if not isinstance(data, dict):
        problems.append(f"{files.config}: not a mapping; manifest config used")
        return {}
    return data


def open_runs(run_dirs: Iterable[Path], root: Path, problems: list[str]) -> Iterator[Run]:
    """Each run directory opened (:func:`open_run`); one that cannot be is skipped with a line
    in ``problems``."""
    for d in run_dirs:
        try:
            yield open_run(d, root)
        except StoreError as exc:
            problems.append(f"{d}: skipped: {exc}")


def open_run(path: Path, root: Path) -> Run:
    """Scan one run directory and read its small files (manifests, config, summary)."""
    files = scan_run(path)
    problems = files.problems()
    manifests = {r: read_manifest(rf, problems) for r, rf in sorted(files.ranks.items())}
    for r, m in manifests.items():
        if m.get("status") in ("running", "killed"):
            problems.append(
                f"{path}: rank {r}'s manifest says {m['status']!r}: the process did not close its store; "
                "data up to its last flush is analysed"
            )
    config = _yaml_config(files, problems)
    if not config:
        for m in manifests.values():
            if isinstance(m.get("config"), dict):
                config = m["config"]
                break
    summary: dict[str, Any] = {}
    if files.summary is not None:
        summary = validate_summary(
            read_json(files.summary, SIZE_CAPS["summary"], problems), files.summary, problems
        )
    job = _job_state(path, problems)
    if job:
        summary = {**summary, "job_state": job}
    rel = path.relative_to(root) if path != root else Path(path.name)
    sweep = next((p.split("=", 1)[1] for p in rel.parts if p.startswith("sweep=")), None)
    key = "/".join(rel.parts) or path.name
    # A folder name that is not UTF-8 reaches Python as surrogates, which no table, page or
    # terminal can encode: its labels show the odd bytes as \xNN (the path keeps them, to read).
    key, sweep = _label(key), None if sweep is None else _label(sweep)
    run = Run(path, key, sweep, files, manifests, config, summary, problems)
    _check_ranks(run)
    return run


def _label(name: str) -> str:
    """``name`` (from a file name) as text any encoder takes: bytes that were not UTF-8 as ``\\xNN``."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


JOB_FILE = "job.json"
"""A sweep attempt's state, written by its rank 0 beside the rank folders (docs/sweeps.md)."""


def _job_state(path: Path, problems: list[str]) -> str | None:
    job = path / JOB_FILE
    if not job.is_file() or job.is_symlink():
        return None
    data = read_json(job, SIZE_CAPS["manifest"], problems)
    state = data.get("state") if isinstance(data, dict) else None
    return state if isinstance(state, str) else None


def _check_ranks(run: Run) -> None:
    """A rank folder missing from the world the manifests declare; mixed sampling rates."""
    worlds = {m["world_size"] for m in run.manifests.values() if isinstance(m.get("world_size"), int)}
    present = set(run.ranks)
    for world in sorted(worlds):
        if not 0 < world <= MAX_WORLD_SIZE:
            run.problems.append(
                f"{run.path}: a manifest's world_size is {world}, not a possible rank count "
                f"(1 to {MAX_WORLD_SIZE}); the ranks present are analysed"
            )
            continue
        missing = world - len([r for r in present if r < world])
        if missing:  # the first few named: a world of 10^5 ranks lists no 10^5 numbers
            first = list(itertools.islice((r for r in range(world) if r not in present), 20))
            more = f" and {missing - len(first)} more" if missing > len(first) else ""
            run.problems.append(
                f"{run.path}: world_size is {world} but rank folder(s) {first}{more} are missing; "
                "the ranks present are analysed"
            )
    hz = [m.get("sampling_hz") for m in run.manifests.values()]
    rates = {float(x) for x in hz if isinstance(x, (int, float))}
    if len(rates) > 1:
        run.problems.append(
            f"{run.path}: ranks sampled at different rates ({sorted(rates)} Hz); figures are time-weighted, "
            "so they stay comparable, but excursion metrics see more detail on the faster ranks"
        )


_NAN = np.array(np.nan)
_INT_NULL = np.array(INT_NULL, np.int64)


def _numpy(table: pa.Table, names: list[str]) -> dict[str, np.ndarray[Any, Any]]:
    """Numeric columns -> numpy with the in-memory null convention (NaN floats, INT_NULL ints);
    a column the table lacks is all-null. Every array is read-only (Arrow's own memory where it
    can be); an all-null one is a single null value broadcast over the rows (no memory: most
    of a backend's metric columns are all null)."""
    n = table.num_rows
    out: dict[str, np.ndarray[Any, Any]] = {}
    for name in names:
        col = table.column(name) if name in table.column_names else None
        floating = name in FLOAT_METRICS if col is None else pa.types.is_floating(col.type)
        if col is None or (n and col.null_count == n):  # absent or all null: no conversion
            out[name] = np.broadcast_to(_NAN if floating else _INT_NULL, (n,))
            continue
        if floating:
            out[name] = col.to_numpy().astype(np.float64, copy=False)
        else:
            col = pc.fill_null(col, INT_NULL) if col.null_count else col
            out[name] = np.asarray(col.to_numpy(), dtype=np.int64)
    return out


def iter_rank_arrays(run: Run) -> Iterator[RankArrays]:
    """Each rank's samples and windows, one rank at a time (unreadable segments are skipped and
    reported in ``run.problems``; a rank without readable samples is reported and skipped)."""
    for r in run.ranks:
        data = load_rank_arrays(run, r, run.problems)
        if data is not None:
            yield data


def load_rank_arrays(run: Run, r: int, problems: list[str]) -> RankArrays | None:
    """Rank ``r``'s samples and windows; None (with a line in ``problems``) when it has no
    readable samples."""
    return rank_arrays(run.files.ranks[r], problems)


def rank_arrays(
    files: RankFiles, problems: list[str], columns: tuple[str, ...] = SAMPLE_COLUMNS
) -> RankArrays | None:
    """One rank's samples (``columns`` of them) and windows from its files alone (what a worker
    process is sent: this rank's paths, never the whole run); None (with a line in
    ``problems``) when it has no readable samples."""
    r = files.rank
    samples = read_segments(files.samples, "samples", SAMPLES_SCHEMA, problems, list(columns))
    windows = read_segments(files.windows, "windows", WINDOWS_SCHEMA, problems)
    if samples is None or samples.num_rows == 0:
        problems.append(f"{files.folder}: no readable samples; rank skipped")
        return None
    if windows is None:
        windows = nullable(WINDOWS_SCHEMA).empty_table()
    w = _numpy(windows, [c for c in WINDOWS_SCHEMA.names if c not in ("kind", "name", "timing")])
    w["kind"] = np.asarray(windows.column("kind").to_pylist(), dtype=object)
    w["name"] = np.asarray(windows.column("name").to_pylist(), dtype=object)
    return RankArrays(r, _numpy(samples, list(columns)), w)
