"""Which runs of an analysis get a timeline figure (paper Fig. 8): the ones worth one.

A sweep of many runs cannot have a timeline each, and the first few by name (what the report
drew before issue #47) missed the run whose sampler stalled. The runs are taken in this order,
up to :data:`MAX_TIMELINES`: runs with alerts (most first), runs with a sampling gap (longest
first), then the extremes of the runs table (the hottest, the highest power peak, the lowest
average SM clock, the slowest and the fastest by tokens/s), then the rest by name. Every chosen
run says why; the others are listed in the report with how to draw one (a report of that run's
directory alone draws its timeline).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from charllm_nemo.analysis.analyze import Analysis
from charllm_nemo.telemetry.filecheck import validate_alert
from charllm_nemo.telemetry.layout import SIZE_CAPS, iter_jsonl_numbered

MAX_TIMELINES = 4
"""Runs that get a timeline figure in one report (the others are listed, with how to draw them)."""

EXTREMES: tuple[tuple[str, str, bool], ...] = (
    ("temp_gpu_peak_c", "hottest GPU peak", True),
    ("power_peak_w", "highest power peak", True),
    ("clock_sm_avg_mhz", "lowest average SM clock", False),
    ("tokens_per_s", "slowest (tokens/s)", False),
    ("tokens_per_s", "fastest (tokens/s)", True),
)
"""(runs-table column, why, the highest: True / the lowest: False), in the order they count."""


@dataclass
class TimelineChoice:
    """The runs given a timeline (run key -> why, in drawing order) and those left out (keys)."""

    chosen: dict[str, list[str]] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)

    def why(self, key: str) -> str:
        """Why ``key`` got a timeline ("" for a run that did not)."""
        return "; ".join(self.chosen.get(key, []))


def _alert_counts(analysis: Analysis) -> dict[str, int]:
    """Each run's valid alert lines (the hardened reader, as the report's Alerts section)."""
    problems: list[str] = []  # the Alerts section reports them; here a bad line only counts less
    out: dict[str, int] = {}
    for run in analysis.runs:
        path = run.files.alerts
        n = 0
        if path is not None:
            for lineno, data in iter_jsonl_numbered(path, SIZE_CAPS["alerts"], problems):
                n += bool(validate_alert(data, f"{path}:{lineno}", problems))
        out[run.key] = n
    return out


def _gaps(analysis: Analysis) -> dict[str, float]:
    sr = analysis.tables.get("sampling_ranks")
    out: dict[str, float] = {}
    for r in sr.to_pylist() if sr is not None else []:
        if r.get("flagged"):
            gap = float(r.get("gap_max_s") or 0.0)
            out[r["run"]] = max(out.get(r["run"], 0.0), gap)
    return out


def choose_timelines(analysis: Analysis, limit: int | None = None) -> TimelineChoice:
    """The runs worth a timeline, in the order of the module's docstring, at most ``limit``
    (None: :data:`MAX_TIMELINES`); runs without measured steps have no timeline to draw and are
    never chosen."""
    limit = MAX_TIMELINES if limit is None else limit
    rows = {r["run"]: r for r in analysis.tables["runs"].to_pylist()}
    keys = [run.key for run in analysis.runs if rows.get(run.key, {}).get("measured_steps")]
    reasons: dict[str, list[str]] = {k: [] for k in keys}
    ranked: list[str] = []
    alerts = _alert_counts(analysis)
    for k in sorted((k for k in keys if alerts.get(k)), key=lambda k: (-alerts[k], k)):
        reasons[k].append(f"{alerts[k]} alert(s)")
        ranked.append(k)
    gaps = _gaps(analysis)
    for k in sorted((k for k in keys if k in gaps), key=lambda k: (-gaps[k], k)):
        reasons[k].append(f"sampling gap up to {gaps[k]:.3g} s")
        ranked.append(k)
    if len(keys) > 1:
        for col, why, highest in EXTREMES:
            values: dict[str, float] = {}
            for k in keys:
                v = rows[k].get(col)
                if isinstance(v, (int, float)) and v == v:
                    values[k] = float(v)
            if len(set(values.values())) > 1:  # an extreme only where the runs differ
                # ties go to the first by name either way
                if highest:
                    pick = max(values, key=lambda k: (values[k], [-ord(c) for c in k]))
                else:
                    pick = min(values, key=lambda k: (values[k], k))
                reasons[pick].append(why)
                ranked.append(pick)
    ranked += sorted(keys)
    order = list(dict.fromkeys(ranked))
    choice = TimelineChoice()
    for k in order[:limit]:
        choice.chosen[k] = reasons[k] or ["first by name"]
    choice.left_out = order[limit:]
    return choice


def timelines_note(choice: TimelineChoice, runs: dict[str, Any]) -> str:
    """One sentence for the report: which runs got a timeline and why, which did not, and how to
    draw one of those (``runs``: run key -> its directory)."""
    if not choice.chosen:
        return "No run with measured steps: no timeline."
    got = "; ".join(f"{k} ({choice.why(k)})" for k in choice.chosen)
    text = f"Timelines (at most {MAX_TIMELINES}, chosen by alerts, sampling gaps, then extremes): {got}."
    if choice.left_out:
        shown = ", ".join(choice.left_out[:20])
        more = f" and {len(choice.left_out) - 20} more" if len(choice.left_out) > 20 else ""
        example = runs.get(choice.left_out[0], choice.left_out[0])
        text += (
            f" Without a timeline: {shown}{more}; draw one with a report of its run directory alone, "
            f"e.g. charllm report {example}"
        )
    return text
