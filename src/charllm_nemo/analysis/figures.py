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

MAX_TIMELINES = 4
"""Runs that get a timeline figure (the first ones in path order)."""


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


def _slug(text: str) -> str:
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
    if analysis.windows is not None:
        out += excursions_figure(analysis.windows, t["runs"], out_dir / "excursions")
    for run in analysis.runs[:MAX_TIMELINES]:
        out += timeline_figure(run, out_dir / f"timeline_{_slug(run.key)}")
    kt = analysis.tables.get("kernels")
    if kt is not None and kt.num_rows:
        for run in dict.fromkeys(kt.column("run").to_pylist()):
            out += kernels_figure(kt, run, out_dir / f"kernels_{_slug(run)}")
    return out
