"""The job-power figures (matplotlib; imported only when figures are drawn): one run's
GPU-visible waveform with a zoom on a few iterations, its spectrum with the critical band shaded,
the floor what-if curve; and swing and dominant frequency per configuration of a sweep
(docs/grid.md)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pyarrow as pa
from matplotlib.ticker import FuncFormatter

from charllm_nemo.analysis import grid_metrics as gm
from charllm_nemo.analysis.figures_sweep import save
from charllm_nemo.analysis.grid_power import GridOptions, job_waveform, scope_name, training_span
from charllm_nemo.analysis.load import Run

MAX_WAVE_RUNS = 4
"""Runs drawn with a waveform figure (those of the largest swing, as % of their peak; a run
whose power never swings has none)."""

ZOOM_ITERATIONS = 4
"""Iterations in the zoomed panel (from the middle of the run)."""


def wave_runs(grid_power: pa.Table) -> list[str]:
    """The runs to draw: the job rows with the largest swing share first, at most :data:`MAX_WAVE_RUNS`."""
    rows = [r for r in grid_power.to_pylist() if r["scope"] == "job" and (r["swing_pct_of_peak"] or 0) > 0]
    rows.sort(key=lambda r: -r["swing_pct_of_peak"])
    return [r["run"] for r in rows[:MAX_WAVE_RUNS]]


def wave_figure(run: Run, grid_power: pa.Table, whatif: pa.Table, stem: Path) -> list[Path]:
    """Four panels for ``run``: the whole job waveform with its 1 s average, a zoom on
    :data:`ZOOM_ITERATIONS` iterations, the PSD with the critical band shaded and the dominant
    and iteration frequencies marked, extra energy and remaining swing against the floor."""
    row = next((r for r in grid_power.to_pylist() if r["run"] == run.key and r["scope"] == "job"), None)
    if row is None:
        return []
    options = GridOptions(step_s=row["step_s"], band_hz=(row["band_lo_hz"], row["band_hi_hz"]))
    wf = job_waveform(run, options, [])
    if wf is None:
        return []
    dt, x = wf.step_s, wf.job
    t = np.arange(len(x)) * dt
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    ax = axes[0, 0]
    ax.plot(t, x / 1e3, lw=0.6, color="tab:blue", label=f"job, {dt * 1e3:g} ms grid")
    avg = gm.block_average(x, dt, 1.0)
    ax.step(np.arange(len(avg)) + 0.5, avg / 1e3, where="mid", color="tab:orange", label="1 s average")
    ax.set_xlabel("time since the first covered point (s)")
    ax.set_ylabel("kW")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("job power waveform", fontsize=9)
    ax = axes[0, 1]
    its = wf.iterations
    if its:
        mid = len(its) // 2
        a, b = (
            its[max(0, mid - ZOOM_ITERATIONS // 2)][0],
            its[min(len(its), mid + ZOOM_ITERATIONS // 2) - 1][1],
        )
        for k, (i0, i1) in enumerate(its):
            if a <= i0 < b:
                ax.axvspan(i0 * dt, i1 * dt, color="0.92" if k % 2 else "0.85", lw=0)
    else:
        a, b = 0, min(len(x), round(5 / dt))
    ax.plot(t[a:b], x[a:b] / 1e3, lw=0.9, color="tab:blue")
    ax.set_xlabel("time (s); iterations shaded")
    ax.set_ylabel("kW")
    ax.set_title(f"zoom: {ZOOM_ITERATIONS} iterations", fontsize=9)
    ax = axes[1, 0]
    spec = gm.spectrum(training_span(x, wf), dt, options.band_hz)
    if len(spec.freq_hz) > 1 and (spec.psd[1:] > 0).any():
        ax.loglog(spec.freq_hz[1:], spec.psd[1:], lw=0.7, color="tab:blue")
        for axis in (ax.xaxis, ax.yaxis):  # plain labels: the log formatter writes mathtext, drawn raw here
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.axvspan(*options.band_hz, color="tab:red", alpha=0.12, label="critical band")
        if math.isfinite(spec.dominant_hz):
            ax.axvline(
                spec.dominant_hz,
                color="tab:red",
                lw=0.8,
                ls="--",
                label=f"dominant {spec.dominant_hz:.3g} Hz",
            )
        if row["iteration_hz"]:
            ax.axvline(
                row["iteration_hz"],
                color="k",
                lw=0.8,
                ls=":",
                label=f"iteration {row['iteration_hz']:.3g} Hz",
            )
        ax.legend(fontsize=7)
    ax.set_xlabel("frequency (Hz)")
    ax.set_ylabel("PSD (W²/Hz)")
    share = row["band_share"]
    ax.set_title(
        "spectrum"
        + (f": {100 * share:.0f} % of the swing's energy in the band" if share is not None else ""),
        fontsize=9,
    )
    ax = axes[1, 1]
    rows = sorted((r for r in whatif.to_pylist() if r["run"] == run.key), key=lambda r: r["floor_w"])
    if rows:
        floors = [r["floor_w"] for r in rows]
        ax.plot(
            floors, [r["extra_energy_pct"] for r in rows], "o-", color="tab:green", label="extra energy (%)"
        )
        ax.set_ylabel("extra energy (% of the job's)", color="tab:green")
        ax2 = ax.twinx()
        ax2.plot(floors, [r["swing_remaining_pct"] for r in rows], "s--", color="tab:purple")
        ax2.set_ylabel("swing remaining (% of today's)", color="tab:purple")
    ax.set_xlabel("power floor per GPU (W)")
    ax.set_title("smoothing what-if: a floor every GPU holds", fontsize=9)
    err = wf.alignment_error_s
    align = "unknown" if err is None else f"{err * 1e3:.3g} ms"
    fig.suptitle(
        f"{run.key}: {wf.power_scope}\n{wf.n_gpus} GPUs; swing {row['swing_p50_w'] or float('nan'):.4g} W "
        f"per iteration; hosts' alignment error {align}",
        fontsize=9,
    )
    fig.tight_layout()
    return save(fig, stem)


def _short(run: str) -> str:
    """A run key without its ``sweep=`` and ``attempt=`` parts, at most 40 characters."""
    parts = [p for p in run.split("/") if not p.startswith(("sweep=", "attempt="))]
    return "/".join(parts or [run])[:40]


def sweep_figure(grid_power: pa.Table, runs: pa.Table, stem: Path) -> list[Path]:
    """Swing (% of peak) and dominant frequency per run, labelled with its layout and micro
    batch size, ordered by them (drawn with two or more runs)."""
    info = {r["run"]: r for r in runs.to_pylist()}
    rows = [r for r in grid_power.to_pylist() if r["scope"] == "job"]
    if len(rows) < 2:
        return []

    def key(r: dict[str, Any]) -> tuple[str, int, str]:
        i = info.get(r["run"], {})
        return (str(i.get("layout")), int(i.get("micro_batch_size") or 0), r["run"])

    rows.sort(key=key)
    labels = [f"{key(r)[0]} mb{key(r)[1]}\n{_short(r['run'])}" for r in rows]
    y = np.arange(len(rows))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.8), sharey=True)
    a1.barh(y, [r["swing_pct_of_peak"] or 0.0 for r in rows], color="tab:blue")
    a1.set_xlabel("swing per iteration (% of the job's peak)")
    a1.set_yticks(y)
    a1.set_yticklabels(labels, fontsize=7)
    a2.scatter([r["dominant_hz"] or np.nan for r in rows], y, color="tab:red", label="dominant")
    a2.scatter([r["iteration_hz"] or np.nan for r in rows], y, color="k", marker="x", label="iteration")
    a2.set_xlabel("frequency (Hz)")
    a2.legend(fontsize=7)
    scopes = {r["power_scope"] for r in rows}
    what = (
        next(iter(scopes))
        if len(scopes) == 1
        else "power scopes differ: "
        + ", ".join(sorted(f"{_short(r['run'])} {scope_name(r['power_scope'])}" for r in rows))
    )
    fig.suptitle(f"Which configuration swings least: {what}", fontsize=9)
    fig.tight_layout()
    return save(fig, stem)
