"""``summary.json``: the medians over a run's steps and the atomic write that survives a full
disk. Used by every training loop that writes one (``charllm train``'s loop, the NeMo callback),
so it lives below them, with the step API."""

from __future__ import annotations

import errno
import json
import math
from pathlib import Path
from typing import Any

from charllm_nemo.errors import DiskFull
from charllm_nemo.telemetry.figures import median_fields
from charllm_nemo.telemetry.write import write_bytes

SUMMARY_FILE = "summary.json"

SUMMARY_FIELDS: tuple[str, ...] = median_fields()
"""The step fields whose medians summary.json holds (charllm_nemo.telemetry.figures)."""


def run_summary(
    summaries: list[dict[str, Any]], skip_first: int = 1, world_size: int | None = None
) -> dict[str, Any]:
    """Medians over steps of each per-step figure (the first ``skip_first`` steps, which carry
    warm-up and allocation, are left out when more steps exist). Keys ``<field>_median``;
    a field no step reported is None. ``world_size``: ``energy_j`` (a sum over ranks) only over
    the steps every rank reported (``ranks_reporting``), not partial sums."""
    rows = summaries[skip_first:] if len(summaries) > skip_first else summaries
    out: dict[str, Any] = {"steps": len(summaries), "steps_in_medians": len(rows)}
    for name in SUMMARY_FIELDS:
        some = rows
        if name == "energy_j" and world_size is not None:
            some = [r for r in rows if r.get("ranks_reporting", world_size) >= world_size]
        values = sorted(v for r in some if (v := r.get(name)) is not None and not math.isnan(v))
        if not values:
            out[f"{name}_median"] = None
            continue
        mid = len(values) // 2
        out[f"{name}_median"] = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    return out


def write_summary(path: Path, data: dict[str, Any]) -> str | None:
    """Write ``summary.json`` atomically (a temporary, then a rename): whole or not at all, and
    no temporary left when the disk is full. When the full summary does not fit, one without
    ``per_step`` (the big part; ``steps.jsonl`` holds those rows) with ``per_step_omitted``
    set. Returns None when written whole, ``"compact"`` when the compact one was written;
    raises the OSError when neither could be written."""
    try:
        write_bytes(path, json.dumps(data, indent=2, default=str).encode())
        return None
    except (OSError, DiskFull) as exc:  # a full disk, a quota, ulimit -f (EFBIG), or any refused write
        if "per_step" not in data:
            raise _as_os_error(exc) from exc
    compact = {k: v for k, v in data.items() if k != "per_step"}
    compact["per_step_omitted"] = "the disk was full; steps.jsonl holds the per-step rows written"
    try:
        write_bytes(path, json.dumps(compact, default=str).encode())
    except DiskFull as exc:
        raise _as_os_error(exc) from exc
    return "compact"


def _as_os_error(exc: BaseException) -> OSError:
    """Callers handle an unwritable summary as an OSError (one line, not a traceback)."""
    return exc if isinstance(exc, OSError) else OSError(errno.ENOSPC, str(exc))
