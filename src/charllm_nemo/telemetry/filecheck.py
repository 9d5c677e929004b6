"""Check what a run directory's JSON files hold against their documented schema (docs/store.md),
and make text from them safe for a terminal.

A file is data from someone else (telemetry/layout.py): a field of the wrong type is dropped
with a line in ``problems`` naming the file and the field, and the rest is kept, so a reader's
``.get("status")`` never meets a number, a list where a string belongs, or a missing key it
indexes. Fields the schema does not name are kept as they are (newer writers add fields).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from charllm_nemo.telemetry.figures import median_fields, step_spec

# JSON value kinds, as the schema tables of docs/store.md name them.
_KINDS: dict[str, Any] = {
    "string": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}

Spec = Mapping[str, tuple[str, ...]]

MANIFEST_SPEC: Spec = {
    "kind": ("string",),
    "store_format": ("int",),
    "status": ("string",),
    "rank": ("int",),
    "local_rank": ("int",),
    "world_size": ("int",),
    "host": ("string",),
    "pid": ("int",),
    "argv": ("list",),
    "backend": ("string",),
    "synthetic": ("bool",),
    "sampling_hz": ("number",),
    "cpu_affinity": ("list",),
    "sampler_mode": ("string",),
    "counter_reads": ("object",),
    "sampler_process_pid": ("int", "null"),
    "sampler_process_error": ("string", "null"),
    "telemetry_process_lost": ("object",),
    "collector_sched": ("object", "null"),
    "devices": ("list",),
    "supported_metrics": ("object",),
    "started_wall_ns": ("int",),
    "started_mono_ns": ("int",),
    "clock": ("object",),
    "ended_wall_ns": ("int",),
    "killed_note": ("string",),
    "versions": ("object",),
    "env": ("object",),
    "config": ("object",),
    "sampler": ("object",),
    "flusher": ("object",),
    "store_process": ("object",),
    "segments": ("object",),
    "rows": ("object",),
    "bytes_written": ("int",),
    "windows_recorded": ("int",),
    "windows_open_at_close": ("int",),
}
"""``manifest.json``'s fields and the JSON kinds each may hold (docs/store.md)."""

DEVICE_SPEC: Spec = {
    "index": ("int",),
    "name": ("string", "null"),
    "vendor": ("string", "null"),
    "backend": ("string", "null"),
    "uuid": ("string", "null"),
    "driver_version": ("string", "null"),
    "extra": ("object", "null"),
}
"""One entry of the manifest's ``devices``."""

CLOCK_SPEC: Spec = {
    "sample_clock": ("string",),
    "wall_minus_monotonic_ns_start": ("int",),
    "wall_minus_monotonic_ns_end": ("int", "null"),
    "measured_mono_ns_start": ("int",),
    "measured_mono_ns_end": ("int", "null"),
    "measure_uncertainty_ns": ("int",),
    "sync": ("object",),
    "sync_end": ("object", "null"),
}
"""The manifest's ``clock`` (telemetry/clock.py)."""

SYNC_SPEC: Spec = {
    "source": ("string",),
    "synchronized": ("bool", "null"),
    "max_error_ns": ("int", "null"),
    "est_error_ns": ("int", "null"),
    "kernel_state": ("int", "null"),
    "ptp_devices": ("list",),
}
"""``clock.sync`` and ``clock.sync_end``."""

_NUMBER_OR_NULL = ("number", "null")

STEP_SPEC: Spec = step_spec()
"""One ``steps.jsonl`` line, and one entry of ``summary.json``'s ``per_step`` (from
charllm_nemo.telemetry.figures ``STEP_FIELDS``)."""

SUMMARY_SPEC: Spec = {
    "status": ("string",),
    "model": ("string",),
    "layout": ("object",),
    "world_size": ("int",),
    "device": ("string",),
    "telemetry": ("bool",),
    "num_parameters": ("int",),
    "num_microbatches": ("int",),
    "wall_s": ("number",),
    "setup_s": ("object",),
    "memory": ("object", "null"),
    "steps": ("int",),
    "steps_in_medians": ("int",),
    "per_step": ("list",),
    "per_step_dropped": ("int",),
    "medians": ("object",),
    **{f"{k}_median": _NUMBER_OR_NULL for k in median_fields()},
}
"""``summary.json``'s fields (docs/store.md)."""

ALERT_SPEC: Spec = {
    "kind": ("string",),
    "severity": ("string",),
    "step": ("int", "null"),
    "rank": ("int", "null"),
    "host": ("string", "null"),
    "local_rank": ("int", "null"),
    "gpu_index": ("int", "null"),
    "gpu_uuid": ("string", "null"),
    "pp_stage": ("int", "null"),
    "message": ("string",),
    "wall_ns": ("int", "null"),
}
"""The fields every ``alerts.jsonl`` line has (docs/alerts.md, "The alerts"); a kind's own
fields are kept as they are."""

_MEMORY_LISTS = ("peak_bytes", "plan_bytes", "activation_bytes", "pp_stage")


def printable(text: object, limit: int = 200) -> str:
    """``text`` as a string safe to print: control and format characters (escape sequences,
    carriage returns, bidirectional overrides) written as ``\\xNN`` / ``\\uNNNN``, and cut to
    ``limit`` characters (``...`` marks the cut) so that one field cannot flood a terminal."""
    s = text if isinstance(text, str) else str(text)
    if len(s) > limit:
        s = s[: max(limit - 3, 0)] + "..."
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in s)


def json_kind(value: object) -> str:
    """The JSON kind of a parsed value, as the schema names it (``int`` for a whole number)."""
    for name, test in _KINDS.items():
        if test(value):
            return name
    return type(value).__name__


def _matches(value: object, kinds: tuple[str, ...]) -> bool:
    return any(_KINDS[k](value) for k in kinds)


def validate_object(
    data: object, path: Path | str, spec: Spec, problems: list[str], what: str = "", whole: str = "file"
) -> dict[str, Any]:
    """``data`` with every field that ``spec`` names and that holds a value of another kind
    removed; each removal, and a ``data`` that is not an object at all (then ``{}``), is a line
    in ``problems``: ``<path>: field 'status' is int (5), expected string; ignored``.
    ``what`` prefixes the field name (``per_step[3].``); ``whole`` names what ``data`` is when
    it has no ``what`` (``file``, ``line``)."""
    if not isinstance(data, dict):
        if data is not None:
            problems.append(
                f"{path}: {what.rstrip('.') or whole} holds a JSON {json_kind(data)}, not an object; ignored"
            )
        return {}
    out: dict[str, Any] = {}
    for key, value in data.items():
        kinds = spec.get(key)
        if kinds is None or _matches(value, kinds):
            out[key] = value
            continue
        shown = printable(repr(value), 40)
        problems.append(
            f"{path}: field {printable(what + key)!r} is {json_kind(value)} ({shown}), "
            f"expected {' or '.join(kinds)}; ignored"
        )
    return out


def validate_manifest(data: object, path: Path | str, problems: list[str]) -> dict[str, Any]:
    """A ``manifest.json`` checked against :data:`MANIFEST_SPEC` (devices one by one)."""
    m = validate_object(data, path, MANIFEST_SPEC, problems)
    if "devices" in m:
        devices = []
        for i, d in enumerate(m["devices"]):
            checked = validate_object(d, path, DEVICE_SPEC, problems, f"devices[{i}].")
            if checked:
                devices.append(checked)
        m["devices"] = devices
    if "clock" in m:
        clock = m["clock"] = validate_object(m["clock"], path, CLOCK_SPEC, problems, "clock.")
        for key in ("sync", "sync_end"):
            if isinstance(clock.get(key), dict):
                clock[key] = validate_object(clock[key], path, SYNC_SPEC, problems, f"clock.{key}.")
    return m


def validate_step(data: object, path: Path | str, problems: list[str], what: str = "") -> dict[str, Any]:
    """One step's figures (a ``steps.jsonl`` line, ``path`` then ending in ``:<line>``, or a
    ``per_step`` entry) checked against :data:`STEP_SPEC`."""
    return validate_object(data, path, STEP_SPEC, problems, what, whole="line")


def validate_alert(data: object, path: Path | str, problems: list[str]) -> dict[str, Any]:
    """One ``alerts.jsonl`` line checked against :data:`ALERT_SPEC`; ``{}`` (and a problem) when
    it lacks its ``kind`` or ``message``."""
    a = validate_object(data, path, ALERT_SPEC, problems, whole="line")
    if a and not ("kind" in a and "message" in a):
        problems.append(f"{path}: an alert without a kind or a message; ignored")
        return {}
    return a


def validate_summary(data: object, path: Path | str, problems: list[str]) -> dict[str, Any]:
    """A ``summary.json`` checked against :data:`SUMMARY_SPEC`; ``per_step`` entry by entry,
    and ``memory``'s per-rank lists for equal lengths and whole numbers."""
    s = validate_object(data, path, SUMMARY_SPEC, problems)
    if "per_step" in s:
        s["per_step"] = [
            checked
            for i, entry in enumerate(s["per_step"])
            if (checked := validate_step(entry, path, problems, f"per_step[{i}]."))
        ]
    memory = s.get("memory")
    if isinstance(memory, dict) and not _memory_ok(memory):
        problems.append(
            f"{path}: field 'memory' does not hold equal-length lists of whole numbers "
            f"({', '.join(_MEMORY_LISTS)}) and a 'measure' string; ignored"
        )
        s["memory"] = None
    return s


def _memory_ok(memory: Mapping[str, Any]) -> bool:
    peak = memory.get("peak_bytes")
    if not isinstance(peak, list) or not isinstance(memory.get("measure"), str):
        return False
    for name in _MEMORY_LISTS:
        values = memory.get(name, [None] * len(peak) if name == "activation_bytes" else None)
        if not isinstance(values, list) or len(values) != len(peak):
            return False
        if not all(v is None or _KINDS["int"](v) for v in values):
            return False
    return True


_SWEEP_JSON_FIX = (
    "charllm's sweeper writes sweep.json as UTF-8 JSON with 'runs' a list of configurations "
    "(docs/sweeps.md), so something else changed it: restore the file or write that field back "
    "as the sweeper writes it, or move the sweep folder away to start the sweep anew (resuming "
    "or analysing it as it is would drop each configuration's state)"
)


def sweep_json_defect(raw: bytes, path: Path | str) -> str | None:
    """What makes the bytes of a sweep's ``sweep.json`` no record of the sweep though a lenient
    reader would take them (as an empty sweep): bytes that are not UTF-8 (the field they sit
    in named where it parses), or a ``runs`` field that is not a list. A message naming the
    file, the field and the fix; None when neither (a file that does not parse is the
    reader's to report)."""
    import json

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        try:
            where = _replaced_field(json.loads(raw.decode("utf-8", errors="replace")), "")
        except (ValueError, RecursionError):
            where = None
        field = f", in field {printable(where, 80)!r}" if where else ""
        return f"{path}: bytes that are not UTF-8 (first at byte {exc.start}{field}); {_SWEEP_JSON_FIX}"
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    runs = data.get("runs") if isinstance(data, dict) else None
    if runs is not None and not isinstance(runs, list):
        return (
            f"{path}: field 'runs' is {json_kind(runs)}, not a list of configurations "
            f'([{{"key": ..., "state": ..., "attempts": [...]}}, ...]); {_SWEEP_JSON_FIX}'
        )
    return None


def _replaced_field(value: object, at: str) -> str | None:
    """The path (``name``, ``runs[0].key``) of the first key or string in ``value`` holding
    U+FFFD, the replacement a lenient decoder left for bytes that are not UTF-8."""
    if isinstance(value, str):
        return (at or "(the whole file)") if "\ufffd" in value else None
    if isinstance(value, dict):
        for k, v in value.items():
            here = f"{at}.{k}" if at else str(k)
            if "\ufffd" in str(k):
                return here
            found = _replaced_field(v, here)
            if found:
                return found
    if isinstance(value, list):
        for i, v in enumerate(value):
            found = _replaced_field(v, f"{at}[{i}]")
            if found:
                return found
    return None
