"""The sweep directory and its manifest (docs/sweeps.md has the schema).

::

    <root>/sweep=<name>/
      sweep.json                        # the manifest: matrix, configurations, their states
      run=<key>/attempt=<n>/            # one attempt of one configuration: a run directory
        job.json                        # written by the attempt's rank 0: state, job id, nodes, times
        config.yaml  steps.jsonl  summary.json  rank=<r>/...

``sweep.json`` has one writer, the process that launches the sweep (the sweeper); each attempt's
``job.json`` has one writer, that attempt's rank 0. A configuration's state is its latest
attempt's, read from ``job.json`` and, where that cannot tell (a job killed before it could
write), from SLURM (:mod:`charllm_nemo.sweep.slurm`). Nothing here imports Hydra or torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.filecheck import printable

MANIFEST = "sweep.json"
EXIT_NOT_DONE = 3
"""``charllm train -m +sweep=...``'s exit code when a configuration is not done after the sweep
(failed, preempted, out of memory, or still queued): run the same command again to resume."""
JOB_FILE = "job.json"
SCHEMA = "charllm-sweep/1"

PENDING, RUNNING, DONE, FAILED, PREEMPTED = "pending", "running", "done", "failed", "preempted"
OUT_OF_MEMORY, OUT_OF_MEMORY_PREDICTED = "out_of_memory", "out_of_memory_predicted"
STATES = (PENDING, RUNNING, DONE, FAILED, PREEMPTED, OUT_OF_MEMORY, OUT_OF_MEMORY_PREDICTED)
FINAL = frozenset({DONE, FAILED, PREEMPTED, OUT_OF_MEMORY, OUT_OF_MEMORY_PREDICTED})
"""States in which nothing more will happen to an attempt."""

# The overrides that place a job in the sweep; they are not part of what a configuration is.
PLACEMENT_KEYS = ("sweep.run_key", "sweep.attempt")


def now_iso() -> str:
    """Wall time for people and manifests: UTC, ISO 8601, seconds."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically (a reader never sees half a file)."""
    from charllm_nemo.telemetry.write import write_text  # no link followed; one temporary per process

    write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n", tmp_tag=str(os.getpid()))


MAX_FILE_BYTES = 16 * 2**20
"""Largest ``sweep.json`` / ``job.json`` read (a sweep of 10,000 configurations is ~10 MiB)."""


def read_json(path: Path, problems: list[str] | None = None, strict: bool = False) -> dict[str, Any] | None:
    """``path``'s JSON object, or None when it is missing or not one (a job killed mid-write
    cannot leave half a file, see :func:`write_json`, but a foreign file might be anything).
    Read through the hardened layer (telemetry/layout.py): no link followed, regular files only
    (a FIFO never blocks, ``/dev/zero`` is never read), at most :data:`MAX_FILE_BYTES`; what is
    wrong is a line in ``problems``, naming the file. ``strict`` (``sweep.json``): bytes that
    are not UTF-8 or a ``runs`` that is not a list raise ConfigError naming the file, the field
    and the fix, since read leniently they would be an empty sweep (and a resumed sweep would
    write that over the configurations' states)."""
    from charllm_nemo.telemetry.filecheck import sweep_json_defect
    from charllm_nemo.telemetry.layout import UnsafeFileError, parse_json, read_bounded

    problems = [] if problems is None else problems
    if not os.path.lexists(path):
        return None
    try:
        raw = read_bounded(path, MAX_FILE_BYTES)
    except UnsafeFileError as exc:
        problems.append(str(exc))
        return None
    if strict and (defect := sweep_json_defect(raw, path)) is not None:
        raise ConfigError(defect)
    data = parse_json(raw, path, problems)
    if data is not None and not isinstance(data, dict):
        problems.append(f"{path}: holds a JSON {type(data).__name__}, not an object; ignored")
        return None
    return data


_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def run_key(overrides: Sequence[str]) -> str:
    """The stable key of a configuration: its swept overrides, sorted, each ``<last key part>-
    <value>``, joined by ``__`` (``batch.micro_batch_size=2 optim=recompute`` ->
    ``micro_batch_size-2__optim-recompute``); a configuration with no overrides is ``default``.
    Keys longer than 80 characters keep 60 and add a hash of the whole, so they stay unique."""
    parts = []
    for item in sorted(o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in PLACEMENT_KEYS):
        name, _, value = item.partition("=")
        name = name.lstrip("+~").split("/")[-1].split(".")[-1]
        parts.append(f"{name}-{value}")
    key = "__".join(_UNSAFE.sub("", p) for p in parts) or "default"
    if len(key) > 80:
        digest = hashlib.sha1("\n".join(sorted(overrides)).encode()).hexdigest()[:10]
        key = f"{key[:60]}-{digest}"
    return key


@dataclass
class Attempt:
    """One submission (or requeue) of a configuration; times in UTC ISO 8601."""

    attempt: int
    state: str = PENDING
    job_id: str | None = None
    scheduler: str | None = None  # slurm | local (submitit_local) | none (Hydra's basic launcher)
    nodes: str | None = None
    start: str | None = None
    end: str | None = None
    exit_reason: str | None = None
    exit_code: int | None = None


@dataclass
class RunEntry:
    """One configuration of the matrix: its overrides and its attempts, latest last."""

    key: str
    overrides: list[str]
    state: str = PENDING
    attempts: list[Attempt] = field(default_factory=list)
    predicted_peak_gib: float | None = None
    exit_reason: str | None = None

    @property
    def latest(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    def next_attempt(self) -> int:
        """The number a new attempt gets: one past every attempt recorded."""
        return max((a.attempt for a in self.attempts), default=0) + 1


@dataclass
class SweepManifest:
    """``sweep.json``: what the sweep is and where each configuration stands."""

    name: str
    directory: str
    matrix: dict[str, list[str]] = field(default_factory=dict)
    fixed_overrides: list[str] = field(default_factory=list)
    launcher: dict[str, Any] = field(default_factory=dict)
    runs: dict[str, RunEntry] = field(default_factory=dict)
    created: str = field(default_factory=now_iso)
    updated: str = field(default_factory=now_iso)
    schema: str = SCHEMA

    def entry(self, overrides: Sequence[str]) -> RunEntry:
        """The configuration with these swept overrides, added (pending, no attempt) if new."""
        key = run_key(overrides)
        got = self.runs.get(key)
        if got is None:
            got = self.runs[key] = RunEntry(key=key, overrides=list(overrides))
        return got

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["runs"] = [asdict(r) for r in self.runs.values()]
        return d

    def save(self, sweep_dir: Path) -> Path:
        self.updated = now_iso()
        path = sweep_dir / MANIFEST
        write_json(path, self.to_dict())
        return path

    @classmethod
    def from_dict(
        cls, d: dict[str, Any], path: Path | str = MANIFEST, problems: list[str] | None = None
    ) -> SweepManifest:
        """The manifest in ``d`` as read from ``path``: a field of the wrong type, an unknown
        field, a run without a usable ``key`` or an attempt without a number is left out, with a
        line in ``problems`` naming the file and the field (the rest is kept)."""
        from charllm_nemo.train.sweep_manifest_check import checked_fields, checked_runs

        problems = [] if problems is None else problems
        fields = checked_fields(d, path, problems)
        runs = checked_runs(d.get("runs"), path, problems, Attempt)
        fields.setdefault("name", Path(str(path)).parent.name.split("=", 1)[-1] or "?")
        fields.setdefault("directory", str(Path(str(path)).parent))
        return cls(**fields, runs={k: RunEntry(**r) for k, r in runs.items()})


def load_manifest(sweep_dir: Path, problems: list[str] | None = None) -> SweepManifest | None:
    """The manifest of ``sweep_dir``, or None if it has none or it cannot be read (then a line
    in ``problems``); ConfigError when it is not ours, or is ours but no record of the sweep
    (bytes that are not UTF-8, ``runs`` not a list: :func:`read_json`'s ``strict``)."""
    problems = [] if problems is None else problems
    d = read_json(sweep_dir / MANIFEST, problems, strict=True)
    if d is None:
        return None
    if d.get("schema") != SCHEMA:
        raise ConfigError(
            f"{sweep_dir / MANIFEST} has schema {printable(repr(d.get('schema')), 60)}, not {SCHEMA!r}: "
            "give the sweep "
            "another sweep.dir (or sweep.name), or move that directory away"
        )
    return SweepManifest.from_dict(d, sweep_dir / MANIFEST, problems)


def attempt_dir(sweep_dir: Path, key: str, attempt: int) -> Path:
    """Where attempt ``attempt`` of configuration ``key`` writes its run."""
    return sweep_dir / f"run={key}" / f"attempt={attempt}"


def done_runs(sweep_dir: Path) -> dict[str, Path]:
    """Each done configuration's run directory (its latest done attempt), by run key, as
    ``sweep.json`` records it: what an analysis of the sweep reads, leaving out failed and
    preempted attempts. Empty when the sweep has no manifest."""
    manifest = load_manifest(sweep_dir)
    if manifest is None:
        return {}
    out = {}
    for key, entry in manifest.runs.items():
        done = [a for a in entry.attempts if a.state == "done"]
        if done:
            out[key] = attempt_dir(sweep_dir, key, done[-1].attempt)
    return out


def find_sweeps(path: Path) -> list[Path]:
    """``path`` itself when it holds a manifest, else the sweeps one or two levels under it
    (``runs/sweeps/sweep=<name>`` from ``runs/sweeps`` or ``runs``)."""
    if (path / MANIFEST).is_file():
        return [path]
    return sorted({p.parent for pattern in (f"*/{MANIFEST}", f"*/*/{MANIFEST}") for p in path.glob(pattern)})


def format_table(rows: Iterable[Sequence[str]], header: Sequence[str]) -> list[str]:
    """Left-aligned columns, two spaces apart."""
    body = [list(map(str, r)) for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in body]
    return out
