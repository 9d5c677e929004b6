"""``charllm report``: one self-contained HTML page (no file or network reference: figures are
inline ``data:`` URIs, styles inline) with the caveats a reader must know before trusting a
number (the sampling rate, a synthetic device, coverage, windows flagged as interpolated, every
problem met while reading), each run's alerts, the advice, the energy report, the comparison of
the runs given, every figure with its paper figure and the data quality behind it, the tables
and each run's manifest."""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from charllm_nemo.analysis.analyze import Analysis
from charllm_nemo.analysis.report_sections import (
    ReportOptions,
    alerts_section,
    compare_section,
    figure_quality,
    figure_runs,
    power_wave_section,
)
from charllm_nemo.analysis.report_tables import advice_tables, energy_tables
from charllm_nemo.analysis.timeline_choice import choose_timelines, timelines_note
from charllm_nemo.telemetry.layout import SIZE_CAPS, open_parquet
from charllm_nemo.telemetry.write import write_text

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1400px; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; margin-top: 2em; }
table { border-collapse: collapse; font-size: 0.8em; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: right; white-space: nowrap; }
th { background: #f3f3f3; position: sticky; top: 0; } td.s { text-align: left; }
.scroll { overflow-x: auto; max-height: 30em; }
.caveat { background: #fff6e0; border-left: 4px solid #e0a000; padding: 0.6em 1em; margin: 0.4em 0; }
.problem { background: #fdecea; border-left: 4px solid #d33; padding: 0.4em 1em; margin: 0.3em 0; font-size: 0.85em; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
pre { background: #f7f7f7; padding: 0.8em; font-size: 0.75em; max-height: 25em; overflow: auto; }
"""  # noqa: E501

MAX_FIGURE_BYTES = 64 * 2**20
"""Largest figure PNG inlined (a 150 dpi figure is well under 1 MiB)."""

MAX_ROWS = 200
"""Rows shown per table (the Parquet and CSV files hold them all)."""


def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return '<td class="s">–</td>'
    if isinstance(v, float):
        return f"<td>{v:.4g}</td>"
    if isinstance(v, (int, bool)):
        return f"<td>{v}</td>"
    return f'<td class="s">{html.escape(str(v))}</td>'


def table_html(table: pa.Table) -> str:
    """An HTML table of the first :data:`MAX_ROWS` rows, every value escaped."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in table.column_names)
    rows = "".join(
        "<tr>" + "".join(_cell(v) for v in r.values()) + "</tr>" for r in table.slice(0, MAX_ROWS).to_pylist()
    )
    more = f"<p>{table.num_rows - MAX_ROWS} more rows in the files.</p>" if table.num_rows > MAX_ROWS else ""
    return f'<div class="scroll"><table><tr>{head}</tr>{rows}</table></div>{more}'


def caveats(analysis: Analysis) -> list[str]:
    """Plain sentences about what limits the figures, derived from the data."""
    out = []
    runs = analysis.tables["runs"].to_pylist()
    rates = sorted({r["sampling_hz"] for r in runs if r.get("sampling_hz")})
    if rates:
        out.append(
            f"Sampling rate: {', '.join(f'{x:g}' for x in rates)} Hz. Windows shorter than a few sampling "
            "periods get figures interpolated between neighbouring samples (flagged below); peaks are "
            "the highest values sampled, a lower bound of the true peak."
        )
    synth = [r["run"] for r in runs if r.get("synthetic")]
    if synth:
        out.append(
            f"SYNTHETIC device in {len(synth)} of {len(runs)} run(s) ({', '.join(synth[:5])}"
            f"{'…' if len(synth) > 5 else ''}): power, temperature and clocks come from a model, "
            "not from hardware. Use them to check the pipeline, never as measurements."
        )
    w = analysis.windows
    if w is not None and w.num_rows:
        n = w.num_rows
        no_energy = int(pc.sum(pc.is_null(w["energy_j"])).as_py() or 0)
        out.append(
            f"Coverage: {n} window figures; {no_energy} without an energy figure (outside the sampled span, "
            "open at the end, or no power reading)."
        )
        if "energy_bound_j" in w.column_names:
            out.append(energy_bound_line(w))
    full = analysis.windows_path
    if full is not None and full.exists():
        with open_parquet(full, SIZE_CAPS["table"]) as pf:
            interp = pf.read(columns=["interpolated", "coverage", "gap_max_s"])
        k = int(pc.sum(interp["interpolated"]).as_py() or 0)
        gapped = pc.less(interp["coverage"], 1.0)
        low = int(pc.sum(gapped).as_py() or 0)
        worst = pc.max(pc.filter(interp["gap_max_s"], gapped)).as_py() if low else None
        out.append(
            f"Flagged windows: {k} interpolated (fewer than 2 samples inside), {low} with a sampling gap "
            f"(coverage below 1: no sample for more than 2 sample periods"
            + (f", longest {worst:.3g} s" if worst is not None else "")
            + "; tables sampling_ranks and sampling_steps)."
        )
    failed = [r["run"] for r in runs if not r.get("measured_steps")]
    if failed:
        out.append(
            f"{len(failed)} run(s) without measured steps (out of memory, failed, or no telemetry): "
            f"{', '.join(failed[:8])}."
        )
    return out


def energy_bound_line(w: Any) -> str:
    """The windows' energy bounds by kind: the median bound as a share of the energy, and how
    many windows with energy have no bound (docs/attribution.md, Energy bounds)."""
    parts = []
    for kind in ("step", "microbatch", "phase"):
        rows = w.filter(pc.equal(w["kind"], kind)).select(["energy_j", "energy_bound_j"]).to_pylist()
        known = [r for r in rows if r["energy_j"] is not None and r["energy_j"] == r["energy_j"]]
        if not known:
            continue
        shares = sorted(
            r["energy_bound_j"] / r["energy_j"]
            for r in known
            if r["energy_bound_j"] is not None
            and r["energy_bound_j"] == r["energy_bound_j"]
            and r["energy_j"] > 0
        )
        unbounded = sum(
            1 for r in known if r["energy_bound_j"] is None or r["energy_bound_j"] != r["energy_bound_j"]
        )
        median = (
            f"median bound {100 * shares[len(shares) // 2]:.2g} % of the energy" if shares else "no bound"
        )
        parts.append(f"{kind} {median}" + (f", {unbounded} unbounded" if unbounded else ""))
    return "Energy bounds per window (docs/attribution.md): " + ("; ".join(parts) or "no window energy") + "."


def _img(path: Path, analysis: Analysis, chosen: dict[str, list[str]] | None = None) -> str:
    from charllm_nemo.analysis.figures import paper_figure
    from charllm_nemo.telemetry.layout import read_bounded

    # Our own figure, but in a folder that may sit inside a run directory: no link followed.
    data = base64.b64encode(read_bounded(path, MAX_FIGURE_BYTES)).decode("ascii")
    name = html.escape(path.stem)
    img = f'<img alt="{name}" src="data:image/png;base64,{data}">'
    paper = paper_figure(path.stem)
    what = paper[1] if paper else ""
    if path.stem.startswith("kernels_") and _kernel_source(analysis, path.stem) == "cpu_op":
        what = what.replace("GPU time", "CPU time (CPU operator events: no GPU kernel was traced)")
    title = html.escape(f"{path.stem}: the paper's {paper[0]}, {what}" if paper else path.stem)
    quality = html.escape(figure_quality(analysis, figure_runs(path.stem, analysis)))
    note = _figure_note(path.stem, analysis, chosen or {})
    extra = f"<br>{html.escape(note)}" if note else ""
    return f"<figure>{img}<figcaption><b>{title}</b><br>{quality}{extra}</figcaption></figure>"


def _kernel_source(analysis: Analysis, stem: str) -> str | None:
    """The kernels figure's event source for its run (``kernel`` / ``cpu_op``; None: unknown)."""
    kt = analysis.tables.get("kernels")
    runs = figure_runs(stem, analysis)
    sources = {r["source"] for r in (kt.to_pylist() if kt is not None else []) if r["run"] in runs}
    return sources.pop() if len(sources) == 1 else None


def _figure_note(stem: str, analysis: Analysis, chosen: dict[str, list[str]]) -> str:
    """What a figure's caption adds beyond its paper figure: how many runs each configuration
    bar holds, why a run got its timeline."""
    from charllm_nemo.analysis.figures_sweep import configs_caption

    if stem in ("configs", "configs_normalised"):
        return "Bars: " + configs_caption(analysis.tables["runs"], stem == "configs_normalised") + "."
    if stem.startswith("timeline_"):
        why = "; ".join(w for k in figure_runs(stem, analysis) for w in chosen.get(k, []))
        return f"Drawn for: {why}." if why else ""
    return ""


def render(analysis: Analysis, pngs: list[Path], path: str = "", options: ReportOptions | None = None) -> str:
    """The page as a string. ``path``: what was analysed (for the advice); ``options``: runs to
    compare and the energy report's carbon inputs."""
    options = options or ReportOptions()
    head = f"<meta charset='utf-8'><title>charllm report</title><style>{STYLE}</style>"
    parts = [f"<!DOCTYPE html><html><head>{head}</head><body>"]
    runs = analysis.tables["runs"]
    parts.append(f"<h1>charllm-nemo report: {runs.num_rows} run(s)</h1>")
    parts.append(
        "<h2>Caveats</h2>" + "".join(f'<div class="caveat">{html.escape(c)}</div>' for c in caveats(analysis))
    )
    if analysis.problems:
        parts.append("<h2>Problems met while reading</h2>")
        parts += [f'<div class="problem">{html.escape(p)}</div>' for p in analysis.problems[:200]]
    parts.append("<h2>Alerts</h2>" + alerts_section(analysis, table_html))
    parts.append("<h2>Advice</h2>" + advice_tables(analysis, path, table_html))
    parts.append("<h2>Energy</h2>" + energy_tables(analysis, options.grid, options.pue, table_html))
    parts.append(power_wave_section(analysis, table_html))
    if options.compare:
        parts.append("<h2>Comparison</h2>" + compare_section(options.compare, table_html))
    choice = choose_timelines(analysis)
    note = timelines_note(choice, {r.key: str(r.path) for r in analysis.runs})
    figures = "".join(_img(p, analysis, choice.chosen) for p in pngs)
    parts.append(f"<h2>Figures</h2><p>{html.escape(note)}</p>{figures}")
    for name, table in analysis.tables.items():
        parts.append(f"<h2>Table: {html.escape(name)}</h2>{table_html(table)}")
    parts.append("<h2>Manifests</h2>")
    for run in analysis.runs:
        for rank, m in sorted(run.manifests.items())[:4]:
            text = json.dumps({k: v for k, v in m.items() if k != "config"}, indent=1, default=str)
            parts.append(f"<h3>{html.escape(run.key)} rank {rank}</h3><pre>{html.escape(text)}</pre>")
        if len(run.manifests) > 4:
            parts.append(f"<p>{len(run.manifests) - 4} more ranks' manifests in the run directory.</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(
    analysis: Analysis, pngs: list[Path], path: Path, analysed: str = "", options: ReportOptions | None = None
) -> Path:
    """Write the page to ``path`` and return it (``analysed``, ``options``: as :func:`render`)."""
    return write_text(
        path, render(analysis, pngs, analysed, options)
    )  # no link followed (telemetry/write.py)
