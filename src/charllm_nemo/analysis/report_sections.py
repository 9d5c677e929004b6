"""The report's sections beyond the tables: each run's alerts (``alerts.jsonl``), the comparison
of runs given with ``--compare`` (``charllm compare``) and, under every figure, the data quality
of what it draws (the advice and energy tables: :mod:`.report_tables`).

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
                    "why": f.get("reason"),
                }
            )
    head = (
        f"<p>Baseline: {html.escape(result['baseline'])}; {int(result['confidence'] * 100)} % "
        f"hierarchical bootstrap intervals (runs, then steps within runs; {result['resamples']} "
        "resamples); a verdict only where the interval clears zero and the measurement's resolution, "
        "time-like figures only with two or more runs a side, a figure that trends through a run "
        "compared at equal time; otherwise the reason (docs/compare-energy.md).</p>"
    )
    problems = "".join(f'<div class="problem">{html.escape(p)}</div>' for p in result["problems"])
    return head + table_html(pa.Table.from_pylist(rows)) + problems


def figure_runs(stem: str, analysis: Analysis) -> list[str]:
    """The runs a figure draws: one for a timeline or a kernel breakdown (by its file name),
    every run for the others."""
    from charllm_nemo.analysis.figures import figure_slug

    keys = [r.key for r in analysis.runs]
    for prefix in ("timeline_", "kernels_", "powerwave_"):
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


WAVE_COLUMNS = (
    "run", "layout", "micro_batch_size", "gpus", "power_column", "swing_p50_w", "swing_pct_of_peak",
    "ramp_up_max_w_per_s", "ramp_down_max_w_per_s", "dominant_hz", "dominant_amplitude_w", "iteration_hz",
    "band_share", "swing_1s_avg_w", "alignment_error_s", "fleet_gpus", "fleet_swing_mw",
    "fleet_ramp_up_max_mw_per_s",
)  # fmt: skip
"""The report's comparison of the runs' job power (from ``grid_power``'s job rows and ``runs``)."""


def power_wave_section(analysis: Analysis, table_html: TableHtml) -> str:
    """The runs' job power as the grid sees it, the least swing first: which layout or micro
    batch size swings least (empty when no run has instant power)."""
    gp = analysis.tables.get("grid_power")
    if gp is None:
        return ""
    info = {r["run"]: r for r in analysis.tables["runs"].to_pylist()}
    rows = [{**info.get(r["run"], {}), **r} for r in gp.to_pylist() if r["scope"] == "job"]
    rows.sort(key=lambda r: (r["swing_pct_of_peak"] is None, r["swing_pct_of_peak"] or 0.0))
    head = (
        "<h2>Job power as the grid sees it</h2><p>GPU-visible power only (CPU, NIC, switches and cooling "
        "are not in it), summed over the job's GPUs on one time base; where every GPU reports its Grace "
        "module's power, module power (GPU+CPU+memory of the module) instead: each run's "
        "<code>power_scope</code> says which. The least swing first. A 1 s "
        "average (<code>swing_1s_avg_w</code>) hides most of the swing and of the ramp rate "
        "(docs/grid.md).</p>"
    )
    return head + table_html(pa.Table.from_pylist([{c: r.get(c) for c in WAVE_COLUMNS} for r in rows]))
