"""The report's sections beyond the tables: each run's alerts (``alerts.jsonl``), the advice
(``charllm advise``), the energy report (``charllm energy``), the comparison of runs given with
``--compare`` (``charllm compare``) and, under every figure, the data quality of what it draws.

Each function returns HTML with every string from a run directory escaped; the page itself is
put together in :mod:`.report`."""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from charllm_nemo.analysis.analyze import Analysis
from charllm_nemo.analysis.energy import GridIntensity
from charllm_nemo.analysis.load import Run
from charllm_nemo.telemetry.filecheck import validate_alert
from charllm_nemo.telemetry.layout import SIZE_CAPS, iter_jsonl_numbered

TableHtml = Callable[[pa.Table], str]
"""How the page renders a table (report.table_html)."""

MAX_ALERTS_PER_RUN = 200
"""Alerts listed per run (the rate limit keeps a run's file short; a file grown by hand is cut)."""

ALERT_COLUMNS = ("run", "step", "kind", "severity", "rank", "host", "pp_stage", "message")
"""The alert table's columns: every alert's own fields (docs/alerts.md), the run first."""


@dataclass
class ReportOptions:
    """What ``charllm report`` adds to the analysis: runs to compare (the first is the
    baseline), the grid intensity and PUE of the energy report's carbon figure."""

    compare: list[str] = field(default_factory=list)
    grid: GridIntensity | None = None
    pue: float = 1.0


def _pre(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


def _fits(value: Any) -> Any:
    """``value``, or None for a JSON integer outside int64 (the table's column type)."""
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        return None
    return value


def run_alerts(run: Run, problems: list[str]) -> tuple[list[dict[str, Any]], int]:
    """The first :data:`MAX_ALERTS_PER_RUN` alerts of ``run`` (checked line by line through the
    hardened reader) and how many good lines the file holds."""
    path = run.files.alerts
    if path is None:
        return [], 0
    kept: list[dict[str, Any]] = []
    total = 0
    for lineno, data in iter_jsonl_numbered(path, SIZE_CAPS["alerts"], problems):
        alert = validate_alert(data, f"{path}:{lineno}", problems)
        if not alert:
            continue
        total += 1
        if len(kept) < MAX_ALERTS_PER_RUN:
            kept.append({"run": run.key, **{c: _fits(alert.get(c)) for c in ALERT_COLUMNS[1:]}})
    return kept, total


def alerts_section(analysis: Analysis, table_html: TableHtml) -> str:
    """Every run's alerts as one table (``table_html`` renders it), and how many were cut."""
    problems: list[str] = []
    rows: list[dict[str, Any]] = []
    notes = []
    for run in analysis.runs:
        kept, total = run_alerts(run, problems)
        rows += kept
        if total > len(kept):
            notes.append(f"{run.key}: {total - len(kept)} more alerts in its alerts.jsonl")
    parts = [f"<p>{len(rows)} alert(s) in {len(analysis.runs)} run(s) (docs/alerts.md).</p>"]
    if rows:
        schema = pa.schema(
            [(c, pa.int64() if c in ("step", "rank", "pp_stage") else pa.string()) for c in ALERT_COLUMNS]
        )
        parts.append(table_html(pa.Table.from_pylist(rows, schema=schema)))
    parts += [f'<div class="problem">{html.escape(n)}</div>' for n in notes + problems[:50]]
    return "".join(parts)


def advice_section(analysis: Analysis, path: str) -> str:
    """``charllm advise``'s text for the analysed runs (layout, placement, micro batch size)."""
    from charllm_nemo.analysis.advise_cmd import advise, render

    return _pre(render(advise(path, analysis=analysis)))


def energy_section(analysis: Analysis, options: ReportOptions) -> str:
    """``charllm energy``'s text: energy to train with its uncertainty, carbon when a grid
    intensity is given, MLPerf's power rules."""
    from charllm_nemo.analysis.energy import EnergyDataError, energy_reports, render

    try:
        return _pre(render(energy_reports(analysis, grid=options.grid, pue=options.pue)))
    except EnergyDataError as exc:  # the rest of the report stands; this section says why not
        return _pre(f"energy not reported: bad data: {exc}")


def compare_section(paths: list[str], table_html: TableHtml) -> str:
    """``charllm compare`` of ``paths`` (the first the baseline): one table row per figure and
    compared group, with the difference, its bootstrap interval and the verdict."""
    from charllm_nemo.analysis.compare import compare_groups, load_group
    from charllm_nemo.errors import StoreError

    try:
        result = compare_groups([load_group(p) for p in paths])
    except StoreError as exc:
        return f'<div class="problem">{html.escape(str(exc))}</div>'
    rows = []
    for cmp in result["comparisons"]:
        for f in cmp["figures"]:
            iv = f["interval"]
            rows.append(
                {
                    "compared": cmp["label"],
                    "figure": f["figure"],
                    "unit": f["unit"],
                    "baseline_median": f["baseline_median"],
                    "median": f["median"],
                    "difference": f["difference"],
                    "difference_kind": f["difference_kind"],
                    "interval_low": None if iv is None else iv[0],
                    "interval_high": None if iv is None else iv[1],
                    "verdict": f["verdict"],
                }
            )
    head = (
        f"<p>Baseline: {html.escape(result['baseline'])}; {int(result['confidence'] * 100)} % "
        f"bootstrap intervals over steps ({result['resamples']} resamples); a verdict only where the "
        "interval excludes zero (docs/compare-energy.md).</p>"
    )
    problems = "".join(f'<div class="problem">{html.escape(p)}</div>' for p in result["problems"])
    return head + table_html(pa.Table.from_pylist(rows)) + problems


def figure_runs(stem: str, analysis: Analysis) -> list[str]:
    """The runs a figure draws: one for a timeline or a kernel breakdown (by its file name),
    every run for the others."""
    from charllm_nemo.analysis.figures import figure_slug

    keys = [r.key for r in analysis.runs]
    for prefix in ("timeline_", "kernels_"):
        if stem.startswith(prefix):
            mine = [k for k in keys if figure_slug(k) == stem[len(prefix) :]]
            return mine or keys
    return keys


def figure_quality(analysis: Analysis, runs: list[str]) -> str:
    """One sentence on the data behind a figure drawn from ``runs``: how many runs and measured
    steps, the sampling rate, steps with a sampling gap (lowest coverage, longest gap, which
    ranks), runs without measured steps, a synthetic device."""
    wanted = set(runs)
    info = [r for r in analysis.tables["runs"].to_pylist() if r["run"] in wanted]
    measured = sum(int(r.get("measured_steps") or 0) for r in info)
    rates = sorted({float(r["sampling_hz"]) for r in info if r.get("sampling_hz")})
    parts = [
        f"Data: {len(info)} run(s), {measured} measured step(s)"
        + (f", sampled at {'/'.join(f'{x:g}' for x in rates)} Hz" if rates else "")
    ]
    sr = analysis.tables.get("sampling_ranks")
    flagged = [
        r for r in (sr.to_pylist() if sr is not None else []) if r["run"] in wanted and r.get("flagged")
    ]
    if flagged:
        gapped = sum(int(r.get("steps_with_gaps") or 0) for r in flagged)
        cov = min(float(r["coverage_min"]) for r in flagged if r.get("coverage_min") is not None)
        gap = max(float(r["gap_max_s"]) for r in flagged if r.get("gap_max_s") is not None)
        where = ", ".join(f"{r['run']} rank {r['rank']}" for r in flagged[:6])
        more = f" and {len(flagged) - 6} more" if len(flagged) > 6 else ""
        parts.append(
            f"{gapped} rank-step(s) with a sampling gap (lowest coverage {cov * 100:.0f} %, longest gap "
            f"{gap:.3g} s: {where}{more}); the figure is drawn across them"
        )
    else:
        parts.append("every measured step sampled throughout (no gap over 2 sample periods)")
    idle = [r["run"] for r in info if not r.get("measured_steps")]
    if idle:
        parts.append(f"{len(idle)} run(s) without measured steps (gaps in the figure)")
    synthetic = sum(1 for r in info if r.get("synthetic"))
    if synthetic:
        parts.append(f"SYNTHETIC device in {synthetic} run(s): modelled, not measured")
    return "; ".join(parts) + "."
