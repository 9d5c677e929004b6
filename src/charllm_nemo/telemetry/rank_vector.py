"""The rank vector: one rank's figures of one step as the float64 vector the step API gathers to
rank 0, derived from the figure table (telemetry/figures.py ``RANK_FIGURES``), never listed again.

The step API (steps/) packs and unpacks it; the W&B keys (sinks/keys.py) name its entries. Both
read the layout from here, so the step API never reads through a sink's module. Derived when
this module is imported: a figure added to the table before then is in the vector.

Framework-free: plain data, no numpy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from charllm_nemo.telemetry.figures import RANK_FIGURES, combine, figure_names, finite_or_none

STEP_FIGURE_KEYS: tuple[str, ...] = figure_names()
"""Per-rank figures of one step window, in the order they travel in the gather vector
(telemetry/figures.py ``RANK_FIGURES``, which says each one's unit and combine rules)."""
STEP_FIGURE_COLUMNS: dict[str, str] = {f.name: f.source for f in RANK_FIGURES}
"""Figure -> the attribution column it is read from (telemetry/attribution.py)."""
THROTTLE_FIGURES: tuple[str, ...] = tuple(n for n in STEP_FIGURE_KEYS if n.startswith("throttle_"))
TRAFFIC_FIGURES: tuple[str, ...] = tuple(n for n in STEP_FIGURE_KEYS if n.endswith("_bytes"))
_DEVICES = {f.name: f.devices for f in RANK_FIGURES}


def combine_devices(
    rows: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None, names: Sequence[str] = STEP_FIGURE_KEYS
) -> dict[str, float]:
    """One rank's figures from its devices' attribution rows (``TelemetrySession.step_figures``).

    Every key of ``names`` (default :data:`STEP_FIGURE_KEYS`; the training loop's console asks
    for its five, once a step), NaN where no device knows it. ``rows`` None (figures not
    available yet) or empty gives all NaN.
    """
    if rows is None:
        rows = []
    elif isinstance(rows, Mapping):
        rows = [rows]
    columns = STEP_FIGURE_COLUMNS
    if len(rows) == 1:  # one device (one GPU per rank): its own values, as combine leaves them
        row = rows[0]
        return {
            name: math.nan if (v := finite_or_none(row.get(columns[name]))) is None else v for name in names
        }
    out: dict[str, float] = {}
    for name in names:
        v = combine(
            _DEVICES[name], [v for r in rows if (v := finite_or_none(r.get(columns[name]))) is not None]
        )
        out[name] = math.nan if v is None else v
    return out


def pack_step_figures(rows: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None) -> list[float]:
    """The gather vector of one rank: :func:`combine_devices` in :data:`STEP_FIGURE_KEYS` order."""
    figures = combine_devices(rows)
    return [figures[name] for name in STEP_FIGURE_KEYS]


def unpack_step_figures(values: Sequence[float]) -> dict[str, float]:
    """A gather vector back to ``{figure: value}`` (NaN = not known)."""
    if len(values) < len(STEP_FIGURE_KEYS):
        raise ValueError(
            f"a step-figure vector has {len(STEP_FIGURE_KEYS)} values (STEP_FIGURE_KEYS); got {len(values)}"
        )
    return {name: float(v) for name, v in zip(STEP_FIGURE_KEYS, values, strict=False)}


def unpack_gathered(gathered: Sequence[Sequence[float]]) -> list[dict[str, float]]:
    """Rank 0's gathered vectors (index = rank) to one figure dict per rank."""
    return [unpack_step_figures(v) for v in gathered]
