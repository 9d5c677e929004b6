"""Check what ``sweep.json`` and ``job.json`` hold against their schema (docs/sweeps.md).

A sweep directory may be another user's, or damaged: every field is checked for its type before
the manifest's dataclasses are built from it. A field of the wrong type, or one the schema does
not know, is left out with one line in ``problems`` naming the file and the field; a run without
a usable ``key`` (it names the run's folder, so only the characters :func:`run_key` writes) and
an attempt without a number are left out the same way. The rest of the sweep is kept.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from charllm_nemo.telemetry.filecheck import json_kind, printable

_STR = ("str",)
_OPT_STR = ("str", "null")
_TEST = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "null": lambda v: v is None,
    "list": lambda v: isinstance(v, list),
    "dict": lambda v: isinstance(v, dict),
}

MANIFEST_FIELDS: dict[str, tuple[str, ...]] = {
    "name": _STR, "directory": _STR, "matrix": ("dict",), "fixed_overrides": ("list",),
    "launcher": ("dict",), "created": _STR, "updated": _STR, "schema": _STR,
}  # fmt: skip
RUN_FIELDS: dict[str, tuple[str, ...]] = {
    "key": _STR, "overrides": ("list",), "state": _STR, "attempts": ("list",),
    "predicted_peak_gib": ("number", "null"), "exit_reason": _OPT_STR,
}  # fmt: skip
ATTEMPT_FIELDS: dict[str, tuple[str, ...]] = {
    "attempt": ("int",), "state": _STR, "job_id": ("str", "int", "null"), "scheduler": _OPT_STR,
    "nodes": _OPT_STR, "start": _OPT_STR, "end": _OPT_STR, "exit_reason": _OPT_STR,
    "exit_code": ("int", "null"),
}  # fmt: skip
JOB_FIELDS: dict[str, tuple[str, ...]] = {**ATTEMPT_FIELDS, "key": _STR}
"""``job.json``: an attempt's fields, and its configuration's key."""

SAFE_KEY = re.compile(r"^[A-Za-z0-9_+-][A-Za-z0-9._+-]{0,199}$")
"""A run key as :func:`charllm_nemo.train.sweep_manifest.run_key` writes it: it names a folder, so a
key with ``/`` or ``..`` (a path outside the sweep) is refused."""


def check(
    d: dict[str, Any], spec: dict[str, tuple[str, ...]], path: Path | str, what: str, problems: list[str]
) -> dict[str, Any]:
    """The fields of ``d`` that ``spec`` names and whose value is of a kind it allows."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        kinds = spec.get(key) if isinstance(key, str) else None
        name = printable(f"{what}{key}", 80)
        if kinds is None:
            problems.append(f"{path}: unknown field {name!r}; ignored")
        elif not any(_TEST[k](value) for k in kinds):
            shown = printable(repr(value), 40)
            problems.append(
                f"{path}: field {name!r} is {json_kind(value)} ({shown}), "
                f"expected {' or '.join(kinds)}; ignored"
            )
        else:
            out[key] = value
    return out


def checked_fields(d: dict[str, Any], path: Path | str, problems: list[str]) -> dict[str, Any]:
    """``sweep.json``'s fields other than ``runs``, checked."""
    fields = check({k: v for k, v in d.items() if k != "runs"}, MANIFEST_FIELDS, path, "", problems)
    if "fixed_overrides" in fields:
        fields["fixed_overrides"] = [str(o) for o in fields["fixed_overrides"] if isinstance(o, str)]
    if "matrix" in fields:
        fields["matrix"] = {
            str(k): [str(x) for x in v] for k, v in fields["matrix"].items() if isinstance(v, list)
        }
    return fields


def checked_runs(
    runs: object, path: Path | str, problems: list[str], attempt: Callable[..., Any]
) -> dict[str, dict[str, Any]]:
    """``sweep.json``'s ``runs`` (a list of objects) as RunEntry arguments by key; each run's
    ``attempts`` made by ``attempt`` (the manifest's Attempt class, passed in: this module sits
    below the manifest's)."""

    if runs is None:
        return {}
    if not isinstance(runs, list):
        problems.append(f"{path}: field 'runs' is {json_kind(runs)}, expected list; no configuration listed")
        return {}
    out: dict[str, dict[str, Any]] = {}
    for i, r in enumerate(runs):
        if not isinstance(r, dict):
            problems.append(f"{path}: runs[{i}] is {json_kind(r)}, not an object; ignored")
            continue
        entry = check(r, RUN_FIELDS, path, f"runs[{i}].", problems)
        key = entry.get("key")
        if not isinstance(key, str) or not SAFE_KEY.match(key):
            shown = printable(repr(key), 60) if "key" in r else "missing"
            problems.append(
                f"{path}: runs[{i}].key is {shown}, not a run key (letters, digits, ._+-); run ignored"
            )
            continue
        entry["overrides"] = [o for o in entry.get("overrides", []) if isinstance(o, str)]
        attempts = []
        for j, a in enumerate(entry.get("attempts") or []):
            where = f"runs[{i}].attempts[{j}]."
            if not isinstance(a, dict):
                problems.append(f"{path}: {where[:-1]} is {json_kind(a)}, not an object; ignored")
                continue
            fields = check(a, ATTEMPT_FIELDS, path, where, problems)
            if "attempt" not in fields or not 0 < fields["attempt"] < 10**6:
                problems.append(f"{path}: {where}attempt is missing or not in 1..999999; attempt ignored")
                continue
            if fields.get("job_id") is not None:
                fields["job_id"] = str(fields["job_id"])
            attempts.append(attempt(**fields))
        entry["attempts"] = sorted(attempts, key=lambda a: a.attempt)
        if key in out:
            problems.append(f"{path}: runs[{i}].key {key!r} listed twice; the later entry kept")
        out[key] = entry
    return out


def checked_job(d: dict[str, Any] | None, path: Path | str, problems: list[str]) -> dict[str, Any] | None:
    """``job.json``'s fields, checked (None stays None: rank 0 never started)."""
    if d is None:
        return None
    job = check(d, JOB_FIELDS, path, "", problems)
    if job.get("job_id") is not None:
        job["job_id"] = str(job["job_id"])
    return job
