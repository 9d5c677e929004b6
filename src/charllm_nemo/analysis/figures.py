"""Every figure of an analysis, written as PNG and PDF (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pyarrow as pa

from charllm_nemo.analysis.analyze import Analysis
from charllm_nemo.analysis.figures_run import excursions_figure, timeline_figure
from charllm_nemo.analysis.figures_sweep import configs_figure, heatmaps_figure, save
from charllm_nemo.analysis.kernels import CATEGORIES
from charllm_nemo.analysis.timeline_choice import choose_timelines

PAPER_FIGURES: dict[str, tuple[str, str]] = {
    "configs": ("Fig. 4", "per configuration: throughput, energy per token, efficiency, GPU power, "
                "temperature and SM clock"),
    "configs_normalised": ("Fig. 4, normalised", "the same, each series over its model's largest median; "
                           "ordered by micro batch size in a microbatch sweep"),
    "heatmaps": ("Figs. 5 and 17", "configurations x GPUs: power, temperature, PCIe and NVLink rates"),
    "timeline": ("Fig. 8", "one run: power, temperature and SM clock against time, steps and microbatches"),
    "throttle_slowdown": ("Fig. 13", "per rank: time throttled against the slowdown it causes"),
    "kernels": ("Fig. 15", "one run: share of traced GPU time per kernel category, per rank"),
    "excursions": ("beyond the paper", "per microbatch: peak / average power and the largest 100 ms rise"),
    "powerwave": ("beyond the paper", "one run's job power (GPU-visible or Grace module): waveform, zoom, "
                  "spectrum with the critical band, power-floor what-if"),
    "gridsweep": ("beyond the paper", "per configuration: swing per iteration and dominant frequency"),
}  # fmt: skip
"""Each figure's file name (``timeline`` and ``kernels`` prefix one per run), the paper's figure
(arXiv 2509.10371) it reproduces, and what it plots: the report's captions and
docs/analysis.md's table (a test keeps them equal)."""


def paper_figure(stem: str) -> tuple[str, str] | None:
    """(paper figure, what it plots) for a figure file's stem, None for one not listed."""
    if stem in PAPER_FIGURES:
        return PAPER_FIGURES[stem]
    prefix = stem.split("_", 1)[0]
    return PAPER_FIGURES.get(prefix) if prefix in ("timeline", "kernels", "powerwave") else None


def kernels_figure(table: pa.Table, run: str, stem: Path) -> list[Path]:
    """GPU time share by kernel category, one horizontal bar per rank (labelled with its
    pipeline stage), for one run."""
    rows = [r for r in table.to_pylist() if r["run"] == run]
    if not rows:
        return []
    ranks = sorted({r["rank"] for r in rows})
    cats = [c for c, _ in CATEGORIES] + ["other"]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(ranks) + 1.8))
    left = np.zeros(len(ranks))
    colors = plt.get_cmap("tab10")
    for j, cat in enumerate(cats):
        share = np.array(
            [sum(r["share"] or 0 for r in rows if r["rank"] == k and r["category"] == cat) for k in ranks]
        )
        if share.any():
            ax.barh(range(len(ranks)), share, left=left, color=colors(j % 10), label=cat)
            left += share
    stage = {r["rank"]: r["pp_stage"] for r in rows}
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {k} (PP {stage[k]})" for k in ranks])
    ax.set_xlabel(f"share of traced time ({rows[0]['source']} events)")
    ax.set_xlim(0, 1)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.5), ncol=4, fontsize=8)
    ax.set_title(f"Kernel breakdown: {run}", fontsize=10)
    fig.tight_layout()
    return save(fig, stem)


MAX_SLOWDOWN_RUNS = 10
"""Runs told apart by colour in the throttle-to-slowdown figure (the rest are grey, "other runs")."""


def throttle_slowdown_figure(table: pa.Table, stem: Path) -> list[Path]:
    """The paper's Figure 13: per (run, rank), the share of its measured step time under a
    limiting throttle reason (x) against its slowdown (y, ``slowdown_vs_fastest``: its compute
    clock against the run's fastest device, else its compute time against its data-parallel
    peers), one colour per run, each point labelled with its rank and pipeline stage."""
    rows = [
        r
        for r in table.to_pylist()
        if r.get("throttle_any_limiting_share") is not None and r.get("slowdown_vs_fastest") is not None
    ]
    if not rows:
        return []
    runs = list(dict.fromkeys(r["run"] for r in rows))
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for j, run in enumerate(runs):
        mine = [r for r in rows if r["run"] == run]
        named = j < MAX_SLOWDOWN_RUNS
        ax.scatter(
            [100 * r["throttle_any_limiting_share"] for r in mine],
            [100 * r["slowdown_vs_fastest"] for r in mine],
            color=colours(j % 10) if named else "lightgrey",
            label=run if named else ("other runs" if j == MAX_SLOWDOWN_RUNS else None),
            s=28,
            zorder=3,
        )
        if len(rows) <= 64:
            for r in mine:
                stage = "" if r.get("pp_stage") is None else f" PP{r['pp_stage']}"
                ax.annotate(
                    f"r{r['rank']}{stage}",
                    (100 * r["throttle_any_limiting_share"], 100 * r["slowdown_vs_fastest"]),
                    fontsize=6,
                    xytext=(3, 3),
                    textcoords="offset points",
                )
    baselines = sorted({str(r.get("slowdown_baseline")) for r in rows})
    ax.set_xlabel("time under a limiting throttle reason (% of measured step time)")
    ax.set_ylabel(f"slowdown vs the run's fastest (%)\nbaseline: {', '.join(baselines)}", fontsize=9)
    ax.set_xlim(-2, 110)  # room for the labels of points at 100 %
    ax.axhline(0, color="black", linewidth=0.6)
    ax.grid(True, linestyle="--", alpha=0.5)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, title="run", title_fontsize=8)
    ax.set_title("Throttle to slowdown, one point per rank", fontsize=10)
    fig.tight_layout()
    return save(fig, stem)


def figure_slug(text: str) -> str:
    """A run key as it appears in a figure's file name (timeline_<slug>, kernels_<slug>)."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)[:80]


def write_figures(analysis: Analysis, out_dir: Path) -> list[Path]:
    """Write every figure the data supports into ``out_dir``; returns the files written (PNG and
    PDF pairs). Text from the run directories (run keys, model and host names) is drawn as it
    is: mathtext is off, so a name like ``$\\undefined{x}$`` is its characters, not an error."""
    import matplotlib

    with matplotlib.rc_context({"text.parse_math": False}):
        return _write_figures(analysis, out_dir)


def _write_figures(analysis: Analysis, out_dir: Path) -> list[Path]:
    t = analysis.tables
    out: list[Path] = []
    out += configs_figure(t["runs"], out_dir / "configs")
    if t["runs"].num_rows > 1:
        out += configs_figure(t["runs"], out_dir / "configs_normalised", normalise=True)
    hosts = {(r.key, k): str(m.get("host") or "?") for r in analysis.runs for k, m in r.manifests.items()}
    out += heatmaps_figure(t["ranks"], t["runs"], hosts, out_dir / "heatmaps")
    if "throttle_slowdown" in t:
        out += throttle_slowdown_figure(t["throttle_slowdown"], out_dir / "throttle_slowdown")
    if analysis.windows is not None:
        out += excursions_figure(analysis.windows, t["runs"], out_dir / "excursions")
    chosen = choose_timelines(analysis).chosen  # by interest, not the first by name (issue #47)
    for run in sorted((r for r in analysis.runs if r.key in chosen), key=lambda r: list(chosen).index(r.key)):
        out += timeline_figure(run, out_dir / f"timeline_{figure_slug(run.key)}")
    kt = analysis.tables.get("kernels")
    if kt is not None and kt.num_rows:
        for run in dict.fromkeys(kt.column("run").to_pylist()):
            out += kernels_figure(kt, run, out_dir / f"kernels_{figure_slug(run)}")
    if "grid_power" in t:
        out += _grid_figures(analysis, out_dir)
    return out


def _grid_figures(analysis: Analysis, out_dir: Path) -> list[Path]:
    from charllm_nemo.analysis.grid_figures import sweep_figure, wave_figure, wave_runs

    t, out = analysis.tables, []
    by_key = {r.key: r for r in analysis.runs}
    for key in wave_runs(t["grid_power"]):
        out += wave_figure(
            by_key[key], t["grid_power"], t["grid_whatif"], out_dir / f"powerwave_{figure_slug(key)}"
        )
    return out + sweep_figure(t["grid_power"], t["runs"], out_dir / "gridsweep")
