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

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from charllm_nemo.errors import StoreError
from charllm_nemo.telemetry.filecheck import validate_summary
from charllm_nemo.telemetry.layout import SIZE_CAPS, RunFiles, read_bounded, read_json, scan_run
from charllm_nemo.telemetry.reader import load_rank, read_manifest, to_arrays
from charllm_nemo.telemetry.schema import FLOAT_METRICS, INT_METRICS

MAX_DEPTH = 6
"""How deep below the given path run directories are looked for (a sweep is two levels)."""

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
        for d in dirnames:
            if _is_run_dir(here / d):
                found.append(here / d)
    if not found:
        raise StoreError(
            f"{root} holds no charllm run (no folder with rank=N sub-folders within {MAX_DEPTH} levels); "
            "give the directory written by charllm train / charllm telemetry, or a sweep directory"
        )
    return sorted(found)


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


def open_run(path: Path, root: Path) -> Run:
    """Scan one run directory and read its small files (manifests, config, summary)."""
    files = scan_run(path)
    problems = files.problems()
    manifests = {r: read_manifest(rf, problems) for r, rf in sorted(files.ranks.items())}
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
    rel = path.relative_to(root) if path != root else Path(path.name)
    sweep = next((p.split("=", 1)[1] for p in rel.parts if p.startswith("sweep=")), None)
    key = "/".join(rel.parts) or path.name
    run = Run(path, key, sweep, files, manifests, config, summary, problems)
    _check_ranks(run)
    return run


def _check_ranks(run: Run) -> None:
    """A rank folder missing from the world the manifests declare; mixed sampling rates."""
    worlds = {int(m["world_size"]) for m in run.manifests.values() if isinstance(m.get("world_size"), int)}
    for world in worlds:
        missing = sorted(set(range(world)) - set(run.ranks))
        if missing:
            run.problems.append(
                f"{run.path}: world_size is {world} but rank folder(s) {missing} are missing; "
                "the ranks present are analysed"
            )
    hz = [m.get("sampling_hz") for m in run.manifests.values()]
    rates = {float(x) for x in hz if isinstance(x, (int, float))}
    if len(rates) > 1:
        run.problems.append(
            f"{run.path}: ranks sampled at different rates ({sorted(rates)} Hz); figures are time-weighted, "
            "so they stay comparable, but excursion metrics see more detail on the faster ranks"
        )


def iter_rank_arrays(run: Run) -> Iterator[RankArrays]:
    """Each rank's samples and windows, one rank at a time (unreadable segments are skipped and
    reported in ``run.problems``)."""
    for r in run.ranks:
        data = load_rank(run.path, r, run.files.ranks[r])
        # load_rank re-reads the manifest: what open_run already reported is not said twice.
        run.problems.extend(p for p in data.problems if p not in run.problems)
        samples = to_arrays(data.samples, [c for c in SAMPLE_COLUMNS if c in data.samples.column_names])
        windows = to_arrays(data.windows.drop_columns(["kind", "name", "timing"]))
        windows["kind"] = np.asarray(data.windows.column("kind").to_numpy(zero_copy_only=False), dtype=object)
        windows["name"] = np.asarray(data.windows.column("name").to_numpy(zero_copy_only=False), dtype=object)
        yield RankArrays(r, samples, windows)
