"""The report's Advice and Energy sections as tables (issue #47: they were console text in a
small monospace box, lines cut, the one line that mattered among "no advice" lines for every run).

Built from the data structures ``charllm advise`` and ``charllm energy`` return (their JSON
schemas, docs/advisor.md and docs/compare-energy.md), never from their text: Advice is one row
per piece of advice, the verdict first, with the runs given none folded into one row per reason;
Energy is one row per run (the figure first, the MLPerf verdict and carbon with it) and one per
rank. Keys are read with ``.get``: a field those modules add or drop shows as a blank cell, not
an error in the report.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from charllm_nemo.analysis.analyze import Analysis

TableHtml = Callable[[pa.Table], str]

FOLDED_NAMES = 6
"""Run keys named in a folded "no advice" row (the count says how many more)."""


def _text(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, (list, tuple)):
        return "; ".join(str(x) for x in v)
    return str(v)


def _table(rows: list[dict[str, Any]], table_html: TableHtml) -> str:
    # Every column typed from its values; a column of text and numbers becomes text.
    cols: dict[str, list[Any]] = {
        k: [r.get(k) for r in rows] for k in dict.fromkeys(k for r in rows for k in r)
    }
    arrays = {}
    for k, vals in cols.items():
        try:
            arrays[k] = pa.array(vals)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            arrays[k] = pa.array([_text(v) for v in vals], pa.string())
    return table_html(pa.table(arrays))


def _value(v: Any) -> str | None:
    """A current / proposed value as the advice states it: a list as ``[3,1]``."""
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(str(x) for x in v) + "]"
    return None if v is None else str(v)


def advice_rows(report: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(one row per piece of advice, the verdict first; one row per (kind, reason) of the runs
    given none, with how many and which) from ``AdviceReport.to_json()``."""
    advice = []
    for a in report.get("advice") or []:
        gain = a.get("expected_gain")
        advice.append(
            {
                "advice": f"{a.get('kind')}: {_value(a.get('current'))} -> {_value(a.get('proposed'))}",
                "expected_gain_pct": None if gain is None else 100.0 * float(gain),
                "run": a.get("run"),
                "measured_step_s": a.get("measured_step_s"),
                "expected_step_s": a.get("expected_step_s"),
                "placement": a.get("placement"),
                "evidence": _text(a.get("evidence")),
                "overrides": " ".join(str(o) for o in a.get("overrides") or []),
                "command": a.get("command"),
            }
        )
    folded: dict[tuple[str, str], list[str]] = {}
    for n in report.get("no_advice") or []:
        folded.setdefault((str(n.get("kind")), str(n.get("reason"))), []).append(str(n.get("run")))
    none = []
    for (kind, reason), runs in folded.items():
        more = f" and {len(runs) - FOLDED_NAMES} more" if len(runs) > FOLDED_NAMES else ""
        none.append(
            {
                "no advice": kind,
                "why": reason,
                "runs": len(runs),
                "which": ", ".join(runs[:FOLDED_NAMES]) + more,
            }
        )
    return advice, none


def advice_tables(analysis: Analysis, path: str, table_html: TableHtml) -> str:
    """The Advice section: ``charllm advise`` on the analysed runs, as tables."""
    from charllm_nemo.analysis.advise_cmd import advise

    report = advise(path, analysis=analysis).to_json()
    advice, none = advice_rows(report)
    parts = [
        f"<p>From charllm advise (docs/advisor.md): {len(advice)} piece(s) of advice; "
        f"{sum(r['runs'] for r in none)} (run, kind) pair(s) without, folded by reason.</p>"
    ]
    if advice:
        parts.append(_table(advice, table_html))
    if none:
        parts.append(_table(none, table_html))
    parts += [
        f'<div class="problem">{html.escape(str(p))}</div>' for p in (report.get("problems") or [])[:50]
    ]
    return "".join(parts)


def energy_rows(reports: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(one row per run, its energy first; one row per rank's device) from ``energy_reports``."""
    runs, ranks = [], []
    for r in reports:
        share = r.get("uncertainty_share")
        m = r.get("mlperf") or {}
        meets = m.get("meets")
        verdict = (
            None
            if meets is None
            else ("meets" if meets else f"does not meet: {_text(m.get('reasons')) or '-'}")
        )
        c = r.get("carbon") or {}
        carbon = None
        if c:
            carbon = (
                f"{c.get('co2e_g')} +- {c.get('co2e_g_bound')} g CO2e ({c.get('facility_kwh')} kWh at PUE "
                f"{c.get('pue')}, {c.get('grid_g_per_kwh')} g/kWh, {c.get('weighting')})"
            )
        runs.append(
            {
                "run": r.get("run"),
                "energy_j": r.get("energy_j"),
                "uncertainty_j": r.get("uncertainty_j"),
                "uncertainty_pct": None if share is None else 100.0 * float(share),
                "ranks_measured": r.get("ranks_measured"),
                "ranks_missing": r.get("ranks_missing"),
                "energy_scaled_to_world_j": r.get("energy_scaled_to_world_j"),
                "energy_per_step_j": r.get("energy_per_step_j"),
                "measured_steps": r.get("measured_steps"),
                "tokens_per_j": r.get("tokens_per_j"),
                "synthetic": r.get("synthetic"),
                f"MLPerf Training power rules ({_text(m.get('checked')) or '-'})": verdict,
                "carbon": carbon,
            }
        )
        for d in r.get("per_device") or []:
            ranks.append(
                {
                    "run": r.get("run"),
                    "rank": d.get("rank"),
                    "device": d.get("device_index"),
                    "energy_j": d.get("energy_j"),
                    "method": d.get("method"),
                    "coverage": d.get("coverage"),
                    "counter_period_s": d.get("counter_update_period_s"),
                    "bound_j": d.get("uncertainty_j"),
                    "bound_basis": d.get("bound_basis"),
                }
            )
    return runs, ranks


def energy_tables(analysis: Analysis, grid: Any, pue: float, table_html: TableHtml) -> str:
    """The Energy section: ``charllm energy`` on the analysed runs, one table per run, one per rank."""
    from charllm_nemo.analysis.energy import EnergyDataError, energy_reports

    try:
        reports = energy_reports(analysis, grid=grid, pue=pue)
    except EnergyDataError as exc:  # the rest of the report stands; this section says why not
        return f"<p>Energy not reported: bad data: {html.escape(str(exc))}</p>"
    runs, ranks = energy_rows(reports)
    if not runs:
        return "<p>No run with an energy report.</p>"
    parts = [
        "<p>From charllm energy (docs/compare-energy.md): energy with its uncertainty per run, "
        "then per rank.</p>"
    ]
    parts.append(_table(runs, table_html))
    if ranks:
        parts.append(_table(ranks, table_html))
    return "".join(parts)
