"""The job as the power grid sees it: every rank's instant power on one wall-clock time base,
resampled to a common grid and summed per node, per job and per named group (a rack), and what
the grid cares about in it (:mod:`.grid_metrics`): swing per iteration, ramp rates, spectrum,
and what a power floor would cost. Tables ``grid_power`` and ``grid_whatif``
(docs/grid.md).

The waveform itself (the time base, the resampling, the sums) is :mod:`.grid_wave`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from charllm_nemo.analysis import grid_metrics as gm
from charllm_nemo.analysis.grid_wave import (
    MAX_GAP_S,
    MAX_GRID_POINTS,
    MODULE_POWER_SCOPE,
    POWER_SCOPE,
    GridOptions,
    JobWaveform,
    WaveBuilder,
    job_waveform,
)
from charllm_nemo.analysis.load import Run
from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.figures import finite_or_none
from charllm_nemo.telemetry.filecheck import printable
from charllm_nemo.telemetry.layout import UnsafeFileError, read_bounded

__all__ = [
    "GRID_POWER_COLUMNS",
    "MAX_GAP_S",
    "MAX_GRID_POINTS",
    "MODULE_POWER_SCOPE",
    "POWER_SCOPE",
    "WHATIF_COLUMNS",
    "GridOptions",
    "JobWaveform",
    "grid_tables",
    "job_waveform",
    "read_group_map",
    "scope_name",
]

Array = np.ndarray[Any, Any]


def scope_name(power_scope: str) -> str:
    """The short name of a ``power_scope`` label: ``module`` or ``GPU-visible``."""
    return "module" if power_scope == MODULE_POWER_SCOPE else "GPU-visible"


RACK_MAP_CAP = 16 * 2**20
"""Largest host -> group map file read."""


def read_group_map(path: Path) -> dict[str, str]:
    """A host -> group (rack) map: one ``host group`` or ``host,group`` pair per line; blank
    lines and ``#`` comments skipped. Read through the hardened reader; ConfigError naming the
    file and line on anything else."""
    try:
        text = read_bounded(path, RACK_MAP_CAP).decode("utf-8")
    except (OSError, UnicodeDecodeError, UnsafeFileError) as exc:
        raise ConfigError(f"--rack-map {printable(path)}: unreadable ({printable(exc)})") from exc
    out: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = [p.strip() for p in line.replace(",", " ").split()]
        if len(parts) != 2:
            raise ConfigError(
                f"--rack-map {printable(path)}:{lineno}: expected 'host rack', got {printable(line)}"
            )
        out[parts[0]] = parts[1]
    return out


GRID_POWER_COLUMNS: tuple[str, ...] = (
    "run", "scope", "name", "gpus", "power_scope", "power_column", "time_base", "alignment_error_s", "step_s",
    "resample", "duration_s", "peak_w", "trough_w", "mean_w", "iterations", "iteration_period_s",
    "iteration_hz", "swing_p50_w", "swing_max_w", "swing_pct_of_peak", "ramp_window_s",
    "ramp_up_p50_w_per_s", "ramp_up_p99_w_per_s", "ramp_up_max_w_per_s",
    "ramp_down_p50_w_per_s", "ramp_down_p99_w_per_s", "ramp_down_max_w_per_s",
    "dominant_hz", "dominant_amplitude_w", "band_lo_hz", "band_hi_hz", "band_share",
    "swing_1s_avg_w", "ramp_1s_avg_max_w_per_s", "fleet_gpus", "fleet_swing_mw",
    "fleet_ramp_up_max_mw_per_s", "fleet_ramp_down_max_mw_per_s", "fleet_dominant_amplitude_mw",
)  # fmt: skip
"""``grid_power``'s columns (docs/analysis.md)."""

WHATIF_COLUMNS: tuple[str, ...] = (
    "run", "floor_w", "floor_source", "gpus", "iterations", "energy_j", "extra_energy_j", "extra_energy_pct",
    "extra_energy_per_step_j", "extra_energy_per_token_j", "swing_p50_w", "swing_remaining_p50_w",
    "swing_remaining_pct", "fleet_gpus", "fleet_extra_power_mw",
)  # fmt: skip
"""``grid_whatif``'s columns (docs/analysis.md)."""


def training_span(x: Array, wf: JobWaveform) -> Array:
    """``x`` from the first iteration's start to the last one's end (the whole of ``x`` without
    iterations): the spectrum and the 1 s averages read training, not the warm-up or the idle
    time before and after it."""
    return x[wf.iterations[0][0] : wf.iterations[-1][1]] if wf.iterations else x


def scope_row(x: Array, gpus: int, wf: JobWaveform, options: GridOptions) -> dict[str, Any]:
    """One ``grid_power`` row's figures for the series ``x`` of ``gpus`` GPUs."""
    dt = wf.step_s
    peak = float(np.nanmax(x)) if np.isfinite(x).any() else math.nan
    sw = gm.swing(x, wf.iterations)
    window = options.ramp_window_s or dt
    rp = gm.ramps(x, dt, wf.iterations, window)
    steady = training_span(x, wf)
    spec = gm.spectrum(steady, dt, options.band_hz, options.segment_s)
    coarse = gm.block_average(gm.longest_covered(steady), dt, 1.0)
    row: dict[str, Any] = {
        "gpus": gpus, "power_scope": wf.power_scope, "power_column": wf.power_column,
        "time_base": wf.time_base, "alignment_error_s": wf.alignment_error_s, "step_s": dt,
        "resample": "linear", "duration_s": len(x) * dt, "peak_w": peak,
        "trough_w": float(np.nanmin(x)) if np.isfinite(x).any() else math.nan,
        "mean_w": float(np.nanmean(x)) if np.isfinite(x).any() else math.nan,
        "iterations": sw.iterations, "iteration_period_s": wf.iteration_period_s,
        "iteration_hz": 1.0 / wf.iteration_period_s if wf.iteration_period_s > 0 else math.nan,
        "swing_p50_w": sw.p50_w, "swing_max_w": sw.max_w,
        "swing_pct_of_peak": 100 * sw.p50_w / peak if peak > 0 else math.nan,
        "ramp_window_s": max(1, round(window / dt)) * dt,
        "ramp_up_p50_w_per_s": rp.up[0], "ramp_up_p99_w_per_s": rp.up[1], "ramp_up_max_w_per_s": rp.up[2],
        "ramp_down_p50_w_per_s": rp.down[0], "ramp_down_p99_w_per_s": rp.down[1],
        "ramp_down_max_w_per_s": rp.down[2],
        "dominant_hz": spec.dominant_hz, "dominant_amplitude_w": spec.dominant_amplitude_w,
        "band_lo_hz": options.band_hz[0], "band_hi_hz": options.band_hz[1], "band_share": spec.band_share,
        "swing_1s_avg_w": float(np.ptp(coarse)) if len(coarse) > 1 else math.nan,
        "ramp_1s_avg_max_w_per_s": float(np.max(np.abs(np.diff(coarse)))) if len(coarse) > 1 else math.nan,
    }  # fmt: skip
    n = options.fleet_gpus
    scale = n / gpus / 1e6 if n else math.nan
    row.update(
        fleet_gpus=n,
        fleet_swing_mw=sw.p50_w * scale,
        fleet_ramp_up_max_mw_per_s=rp.up[2] * scale,
        fleet_ramp_down_max_mw_per_s=rp.down[2] * scale,
        fleet_dominant_amplitude_mw=spec.dominant_amplitude_w * scale,
    )
    return {k: (finite_or_none(v) if isinstance(v, float) else v) for k, v in row.items()}


def default_floors(wf: JobWaveform) -> tuple[float, ...]:
    """Six floors (W per GPU) from the job's mean GPU trough to its peak."""
    mean_gpu = wf.job / wf.n_gpus
    if not np.isfinite(mean_gpu).any():
        return ()
    lo, hi = float(np.nanmin(mean_gpu)), float(np.nanmax(mean_gpu))
    return tuple(float(round(v, 1)) for v in np.linspace(lo, hi, 6))


def whatif_rows(
    run: str, wf: JobWaveform, options: GridOptions, tokens_per_step: float | None
) -> list[dict[str, Any]]:
    """One ``grid_whatif`` row per floor."""
    floors, source = (options.floors_w, "given") if options.floors_w else (default_floors(wf), "auto")
    base = gm.swing(wf.job, wf.iterations).p50_w
    iters = len(wf.iterations)
    out = []
    for f in floors:
        w = gm.floor_what_if(wf.job, wf.n_gpus, wf.step_s, f, wf.iterations)
        per_step = w.extra_energy_j / iters if iters else math.nan
        span = (wf.iterations[-1][1] - wf.iterations[0][0]) * wf.step_s if iters else math.nan
        row = {
            "run": run, "floor_w": f, "floor_source": source, "gpus": wf.n_gpus, "iterations": iters,
            "energy_j": w.energy_j, "extra_energy_j": w.extra_energy_j,
            "extra_energy_pct": 100 * w.extra_energy_j / w.energy_j if w.energy_j > 0 else math.nan,
            "extra_energy_per_step_j": per_step,
            "extra_energy_per_token_j": per_step / tokens_per_step if tokens_per_step else math.nan,
            "swing_p50_w": base, "swing_remaining_p50_w": w.swing_p50_w,
            "swing_remaining_pct": 100 * w.swing_p50_w / base if base > 0 else math.nan,
            "fleet_gpus": options.fleet_gpus,
            "fleet_extra_power_mw": w.extra_energy_j / span / wf.n_gpus * options.fleet_gpus / 1e6
            if options.fleet_gpus and span > 0 else math.nan,
        }  # fmt: skip
        out.append({k: (finite_or_none(v) if isinstance(v, float) else v) for k, v in row.items()})
    return out


def grid_tables(
    runs: list[Run],
    runs_table: pa.Table,
    options: GridOptions,
    problems: list[str],
    built: Mapping[str, WaveBuilder] | None = None,
) -> dict[str, pa.Table]:
    """``grid_power`` (one row per run x scope: the job, each node, each group) and
    ``grid_whatif`` (one row per run x floor); empty dict when no run has instant power.
    ``built``: run key -> its waveform built while the analysis read it (the run is not read
    again); a run without one is read here (:func:`.grid_wave.job_waveform`)."""
    info = {r["run"]: r for r in runs_table.to_pylist()}
    power, whatif = [], []
    for run in runs:
        builder = (built or {}).get(run.key)
        if builder is None:
            wf = job_waveform(run, options, problems)
        else:
            wf = builder.finish()
            problems.extend(builder.problems)
        if wf is None:
            continue
        scopes = [("job", "job", wf.job, wf.n_gpus)]
        scopes += [("node", h, x, g) for h, (x, g) in wf.nodes.items()]
        scopes += [("group", k, x, g) for k, (x, g) in wf.groups.items()]
        for scope, name, x, gpus in scopes:
            power.append({"run": run.key, "scope": scope, "name": name, **scope_row(x, gpus, wf, options)})
        row = info.get(run.key, {})
        gbs, seq = row.get("global_batch_size"), row.get("seq_length")
        whatif += whatif_rows(run.key, wf, options, gbs * seq if gbs and seq else None)
    if not power:
        return {}
    return {
        "grid_power": pa.Table.from_pylist([{c: r.get(c) for c in GRID_POWER_COLUMNS} for r in power]),
        "grid_whatif": pa.Table.from_pylist([{c: r.get(c) for c in WHATIF_COLUMNS} for r in whatif]),
    }
