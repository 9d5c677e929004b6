"""``summary.json``: the medians over a run's steps (in bounded memory: :class:`RunSummary`)
and the atomic write that survives a full disk. Used by every training loop that writes one
(``charllm train``'s loop, the NeMo callback), so it lives below them, with the step API."""

from __future__ import annotations

import copy
import errno
import json
import math
from collections import deque
from pathlib import Path
from typing import Any

from charllm_nemo.errors import DiskFull
from charllm_nemo.steps.quantiles import EXACT_VALUES, RELATIVE_ERROR, MedianSketch
from charllm_nemo.telemetry.figures import median_fields
from charllm_nemo.telemetry.write import write_bytes

SUMMARY_FILE = "summary.json"

SUMMARY_FIELDS: tuple[str, ...] = median_fields()
"""The step fields whose medians summary.json holds (charllm_nemo.telemetry.figures)."""


PER_STEP_KEPT = 1000
"""``summary.json``'s ``per_step`` holds the last this many steps (``steps.jsonl`` has them all):
~1.5 MiB of rank 0's memory at most, whatever the run's length."""


class RunSummary:
    """What ``summary.json`` says of a run's steps, kept in bounded memory as the steps come
    (an observer: ``on_step(report)``; or ``add_row(dict)``): the medians of
    :data:`SUMMARY_FIELDS` (charllm_nemo.steps.quantiles: exact up to 1,024 steps, then within
    0.5 %), and the last ``keep`` reports for ``per_step``. The first ``skip_first`` steps
    (warm-up, allocation) are left out of the medians when more steps exist. ``world_size``:
    ``energy_j`` (a sum over ranks) only over the steps every rank reported
    (``ranks_reporting``), not partial sums. Memory does not grow with the run (issue 48)."""

    def __init__(
        self, world_size: int | None = None, *, skip_first: int = 1, keep: int = PER_STEP_KEPT
    ) -> None:
        self.world_size = world_size
        self.skip_first = skip_first
        self.steps = 0
        self._rows: deque[Any] = deque(maxlen=max(0, keep))
        self._held: list[tuple[float | None, ...]] = []  # the first steps' values, used only alone
        self._sketches = {name: MedianSketch() for name in SUMMARY_FIELDS}

    # -- observer ---------------------------------------------------------------------------
    def on_step(self, report: Any) -> None:
        """A reported step (a StepReport): its median fields now, the report itself (without
        every rank's vectors) kept for ``per_step`` until ``keep`` newer ones replace it."""
        kept = copy.copy(report)
        kept.rank_vectors = None
        self._add(lambda name: getattr(report, name, None), kept)

    def close(self, status: str) -> None:
        """Nothing: the caller writes the summary when it knows the run's status."""

    def add_row(self, row: dict[str, Any]) -> None:
        """A step as a ``per_step`` dict (``StepReport.to_dict()``)."""
        self._add(row.get, row)

    def _add(self, get: Any, kept: Any) -> None:
        self.steps += 1
        self._rows.append(kept)
        values = tuple(self._value(name, get) for name in SUMMARY_FIELDS)
        if self.steps <= self.skip_first:
            self._held.append(values)
            return
        for sketch, v in zip(self._sketches.values(), values, strict=True):
            if v is not None:
                sketch.add(v)

    def _value(self, name: str, get: Any) -> float | None:
        if name == "energy_j" and self.world_size is not None:
            reporting = get("ranks_reporting")
            if reporting is not None and reporting < self.world_size:
                return None
        v = get(name)
        if v is None or isinstance(v, bool):
            return None
        try:
            f = float(v)
        except (TypeError, ValueError):
            return None
        return f if math.isfinite(f) else None

    # -- results ------------------------------------------------------------------------------
    @property
    def per_step(self) -> list[dict[str, Any]]:
        """The last ``keep`` steps as ``per_step`` dicts, oldest first."""
        return [r if isinstance(r, dict) else r.to_dict() for r in self._rows]

    def medians(self) -> dict[str, Any]:
        """``steps``, ``steps_in_medians``, ``<field>_median`` (None: no step had the field) and
        ``medians``: how they were computed (docs/store.md): ``method`` ``exact`` (every value
        sorted) or ``sketch`` with its ``relative_error`` and, only where the bound is lost,
        ``unbounded`` (the fields whose median has no stated error)."""
        sketches = self._sketches
        in_medians = self.steps - len(self._held)
        if in_medians == 0:  # no step past the warm-up: the medians are the held steps'
            sketches = {name: MedianSketch() for name in SUMMARY_FIELDS}
            for values in self._held:
                for sketch, v in zip(sketches.values(), values, strict=True):
                    if v is not None:
                        sketch.add(v)
            in_medians = len(self._held)
        out: dict[str, Any] = {"steps": self.steps, "steps_in_medians": in_medians}
        unbounded = []
        for name, sketch in sketches.items():
            m = sketch.median()
            out[f"{name}_median"] = None if m is None else m.value
            if m is not None and not m.bounded:
                unbounded.append(name)
        how: dict[str, Any] = {"method": "exact", "relative_error": 0.0}
        if not all(s.exact for s in sketches.values()):
            how = {"method": "sketch", "relative_error": RELATIVE_ERROR, "exact_up_to": EXACT_VALUES}
            if unbounded:
                how["unbounded"] = unbounded
        out["medians"] = how
        return out

    def summary(self) -> dict[str, Any]:
        """:meth:`medians`, ``per_step`` and ``per_step_dropped`` (earlier steps not in it)."""
        rows = self.per_step
        return {**self.medians(), "per_step": rows, "per_step_dropped": self.steps - len(rows)}


def run_summary(
    summaries: list[dict[str, Any]], skip_first: int = 1, world_size: int | None = None
) -> dict[str, Any]:
    """The medians of ``summaries`` (``per_step`` dicts) as :meth:`RunSummary.medians` gives
    them: keys ``steps``, ``steps_in_medians``, ``<field>_median``, ``medians``."""
    acc = RunSummary(world_size, skip_first=skip_first, keep=0)
    for row in summaries:
        acc.add_row(row)
    return acc.medians()


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
