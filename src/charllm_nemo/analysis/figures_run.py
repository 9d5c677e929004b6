"""Figures inside one run: a per-rank timeline of power, temperature and SM clock with the step
and microbatch windows shaded, and the per-microbatch excursion plot."""

from __future__ import annotations

from itertools import islice
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from charllm_nemo.analysis.figures_sweep import save
from charllm_nemo.analysis.load import Run, iter_rank_arrays
from charllm_nemo.telemetry.schema import INT_NULL
from charllm_nemo.telemetry.timelines import GAP_PERIODS, sample_period_ns

MAX_TIMELINE_RANKS = 8
"""Ranks drawn in one timeline (one row each); the rest are in the tables."""
MAX_TIMELINE_STEPS = 6
"""Steps shown: the first measured ones, so that windows stay visible."""

POWER_COLOUR, TEMP_COLOUR, CLOCK_COLOUR = "tab:red", "tab:orange", "tab:blue"
STEP_ALPHA = (0.25, 0.12)
MICROBATCH_COLOURS = ("tab:green", "tab:purple")


def timeline_legend() -> list[Any]:
    """One legend entry for every encoding of the timeline: its three lines (each on its own
    axis), the alternating step shading and the alternating microbatch bands."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    return [
        Line2D([], [], color=POWER_COLOUR, label="power (W, left axis)"),
        Line2D([], [], color=TEMP_COLOUR, label="GPU temperature (°C, right axis)"),
        Line2D([], [], color=CLOCK_COLOUR, label="SM clock (MHz, outer right axis)"),
        Patch(color="grey", alpha=STEP_ALPHA[0], label="training step (alternating shades)"),
        Patch(color=MICROBATCH_COLOURS[0], alpha=0.8, label="a microbatch (band at the bottom)"),
        Patch(color=MICROBATCH_COLOURS[1], alpha=0.8, label="the next microbatch (alternating)"),
    ]


def timeline_figure(run: Run, stem: Path) -> list[Path]:
    """The paper's Figure 8 for one run: power (W), GPU temperature (°C) and SM clock (MHz), each
    on its own axis with one range for all ranks, against time for up to
    :data:`MAX_TIMELINE_RANKS` ranks, over the first :data:`MAX_TIMELINE_STEPS` steps after the
    first; steps shaded in alternating grey, microbatches as thin bands along the bottom, every
    encoding in the legend."""
    # islice: only the ranks drawn are ever loaded (a 32-rank hour would not fit at once).
    ranks = list(
        islice((ra for ra in iter_rank_arrays(run) if ra.samples["t_mono_ns"].size), MAX_TIMELINE_RANKS)
    )
    if not ranks:
        return []
    fig, axes = plt.subplots(len(ranks), 1, figsize=(11, 2.3 * len(ranks) + 0.6), sharex=True, squeeze=False)
    temp_axes, clock_axes = [], []
    origin = None
    for ax, ra in zip(axes[:, 0], ranks, strict=True):
        s, w = ra.samples, ra.windows
        is_step = (w["kind"] == "step") & (w["t_end_mono_ns"] != INT_NULL)
        steps = np.unique(w["step"][is_step])
        show = steps[1 : 1 + MAX_TIMELINE_STEPS] if steps.size > 1 else steps
        sel_w = np.isin(w["step"], show) & (w["t_end_mono_ns"] != INT_NULL)
        if not sel_w.any():
            t_lo, t_hi = s["t_mono_ns"].min(), s["t_mono_ns"].max()
        else:
            t_lo, t_hi = w["t_begin_mono_ns"][sel_w].min(), w["t_end_mono_ns"][sel_w].max()
        if origin is None:
            origin = t_lo
        pad = (t_hi - t_lo) // 20
        keep = (
            (s["t_mono_ns"] >= t_lo - pad)
            & (s["t_mono_ns"] <= t_hi + pad)
            & (s["device_index"] == s["device_index"][0])
        )
        t, (power, temp, clock) = broken_at_gaps(
            s["t_mono_ns"][keep] - origin,
            s["power_instant_w"][keep],
            s["temp_gpu_c"][keep],
            s["clock_sm_mhz"][keep],
        )
        t = t / 1e9
        ax.plot(t, power, color=POWER_COLOUR, linewidth=1)
        ax.set_ylabel(f"rank {ra.rank}\npower (W)", color=POWER_COLOUR)
        temp_ax = ax.twinx()
        temp_axes.append(temp_ax)
        temp_ax.plot(t, temp, color=TEMP_COLOUR, linewidth=1)
        temp_ax.set_ylabel("GPU temp (°C)", color=TEMP_COLOUR, fontsize=8)
        clock_ax = ax.twinx()  # the clock on its own axis, offset to the right of the temperature's
        clock_axes.append(clock_ax)
        clock_ax.spines["right"].set_position(("axes", 1.09))
        clock_ax.plot(t, clock, color=CLOCK_COLOUR, linewidth=1)
        clock_ax.set_ylabel("SM clock (MHz)", color=CLOCK_COLOUR, fontsize=8)
        for k, i in enumerate(np.flatnonzero(is_step & sel_w)):
            b, e = (w["t_begin_mono_ns"][i] - origin) / 1e9, (w["t_end_mono_ns"][i] - origin) / 1e9
            ax.axvspan(b, e, color="grey", alpha=STEP_ALPHA[k % 2], linewidth=0)
        mb = (w["kind"] == "microbatch") & sel_w
        for k, i in enumerate(np.flatnonzero(mb)):
            b, e = (w["t_begin_mono_ns"][i] - origin) / 1e9, (w["t_end_mono_ns"][i] - origin) / 1e9
            ax.axvspan(b, e, ymin=0, ymax=0.05, color=MICROBATCH_COLOURS[k % 2], alpha=0.8, linewidth=0)
    for group in (list(axes[:, 0]), temp_axes, clock_axes):
        _same_range(group)  # a throttled rank's lower clock and higher temperature read as such
    legend = fig.legend(
        handles=timeline_legend(), loc="lower center", ncol=3, bbox_to_anchor=(0.5, 1.0), fontsize=8
    )
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    # The title above the legend, placed from the legend's drawn extent (it sat at a fixed
    # height that the legend, taller with more entries, covered: issue #47).
    fig.canvas.draw()
    top = legend.get_window_extent().transformed(fig.transFigure.inverted()).y1
    fig.suptitle(run.key, y=top + 0.005, va="bottom", fontsize=10)
    return save(fig, stem)


def _same_range(group: list[Any]) -> None:
    """One y range for every rank's axis of a quantity (the union of their own)."""
    lims = [ax.get_ylim() for ax in group]
    low, high = min(lo for lo, _ in lims), max(hi for _, hi in lims)
    for ax in group:
        ax.set_ylim(low, high)


def broken_at_gaps(
    t_ns: np.ndarray[Any, Any], *ys: np.ndarray[Any, Any]
) -> tuple[np.ndarray[Any, Any], list[np.ndarray[Any, Any]]]:
    """Sorted sample times and values with a NaN point inserted inside every sampling gap (a step
    longer than GAP_PERIODS median steps, docs/attribution.md *Coverage*), so that a line plot
    breaks there instead of drawing a straight line across time nobody sampled. Times come back
    as float64 ns (the NaN point sits mid-gap), values as float64."""
    order = np.argsort(t_ns, kind="stable")
    t = np.asarray(t_ns, dtype=np.int64)[order]
    values = [np.asarray(y, dtype=np.float64)[order] for y in ys]
    period = sample_period_ns(t)
    if not np.isfinite(period) or period <= 0:
        return t.astype(np.float64), values
    at = np.flatnonzero(np.diff(t) > GAP_PERIODS * period) + 1
    mid = (t[at - 1] + t[at]) / 2.0
    return np.insert(t.astype(np.float64), at, mid), [np.insert(v, at, np.nan) for v in values]


def excursions_figure(windows: pa.Table, runs: pa.Table, stem: Path) -> list[Path]:
    """Per measured microbatch: peak-to-average power ratio and the largest rise within 100 ms,
    as box plots per micro batch size (one box per size over every run that used it)."""
    mb = windows.filter(pc.and_(pc.equal(windows["kind"], "microbatch"), windows["measured"]))
    if mb.num_rows == 0:
        return []
    size_of = {r["run"]: r.get("micro_batch_size") for r in runs.to_pylist()}
    run_col = mb.column("run").to_pylist()
    sizes = np.array([size_of.get(r) or 0 for r in run_col])
    ratio = _np(mb, "power_peak_w") / _np(mb, "power_avg_w")
    rise = _np(mb, "largest_rise_100ms_w")
    labels = sorted(set(sizes.tolist()))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, values, title in (
        (axes[0], ratio, "peak / average power"),
        (axes[1], rise, "largest rise within 100 ms (W)"),
    ):
        data = [values[(sizes == s) & np.isfinite(values)] for s in labels]
        ax.boxplot(data, tick_labels=[str(s) for s in labels], showfliers=True)
        ax.set_xlabel("micro batch size")
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", linestyle="--", alpha=0.5)
    fig.suptitle("Power excursions per microbatch", fontsize=11)
    fig.tight_layout()
    return save(fig, stem)


def _np(t: pa.Table, col: str) -> np.ndarray[Any, Any]:
    return np.asarray(t.column(col).to_numpy(zero_copy_only=False), dtype=np.float64)
