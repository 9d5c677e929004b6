"""One rank's contribution to the tables: its devices' whole-run figures, its windows' figures
and each window's excursion figures. Arrays in, column dicts out; nothing per row in Python."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from charllm_nemo.analysis.grid_wave import WAVE_SAMPLE_COLUMNS, RankWave, rank_wave
from charllm_nemo.analysis.load import SAMPLE_COLUMNS, RankArrays, Run, load_rank_arrays, rank_arrays
from charllm_nemo.analysis.metrics import (
    column,
    counter_increase,
    counter_update_period_s,
    distinct,
    held_share,
    largest_rise,
    time_weighted_mean,
    trapezoid_energy_j,
)
from charllm_nemo.analysis.throttle_counters import throttle_counter_figures
from charllm_nemo.telemetry.attribution import attribute_windows, prepare_samples
from charllm_nemo.telemetry.layout import RankFiles
from charllm_nemo.telemetry.schema import INT_NULL, THROTTLE_REASONS
from charllm_nemo.telemetry.timelines import _held

Columns = dict[str, np.ndarray[Any, Any]]

_SPAN_FIGURES = ("energy_j", "energy_method", "energy_bound_j")
_WHOLE_FIGURES = (*_SPAN_FIGURES, "coverage", "gap_max_s")
"""The attribution's figures over a device's whole sampled span that its ``ranks`` row takes."""

RISE_HORIZON_NS = 100_000_000
"""The excursion metric's horizon: the largest power rise within 100 ms."""

TRAFFIC = ("pcie_tx_bytes", "pcie_rx_bytes", "nvlink_tx_bytes", "nvlink_rx_bytes")
WINDOW_KEYS = (
    "window_id", "parent_id", "kind", "name", "step", "microbatch", "pp_stage", "tp_rank", "dp_rank",
    "t_begin_mono_ns", "t_end_mono_ns",
)  # fmt: skip


@dataclass
class RankTables:
    """A rank's rows of the per-rank table (one per device), the window table and the span
    (measured steps) figures used by the run table."""

    devices: Columns
    windows: Columns
    span: Columns


def measured_steps(steps: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The step numbers that count for run figures: every step but the first (the warm-up step:
    compilation, allocator growth, NCCL set-up) when there is more than one, as summary.json's
    medians do. ``steps`` may hold INT_NULL."""
    s = np.unique(steps[steps != INT_NULL])
    return s[1:] if s.size > 1 else s


def throttle_shares(t: np.ndarray[Any, Any], mask: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Share of the span each reason of THROTTLE_REASONS was set (sample-and-hold), in the
    reasons' order. A run holds few distinct masks, so time is summed per distinct mask value
    (one bincount over the samples) and split into bits afterwards; the general
    :func:`held_share` (one column per bit) is the fallback for masks with unknown high bits."""
    bits = np.array([bit for _, bit in THROTTLE_REASONS], dtype=np.int64)
    if t.size < 2 or t[-1] == t[0]:
        return np.full(bits.size, np.nan)
    if mask.max() >= 1 << 12:
        return held_share(t, (mask[:, None] & bits[None, :]) != 0)
    per_value = np.bincount(mask[:-1], weights=np.diff(t).astype(np.float64))
    values = np.arange(per_value.size)
    held = np.array([per_value[(values & b) != 0].sum() for b in bits])  # 11 bits x <= 4096 values
    return np.asarray(held / float(t[-1] - t[0]), dtype=np.float64)


def _device_row(
    t: np.ndarray[Any, Any], s: dict[str, np.ndarray[Any, Any]], whole: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One device's ``ranks`` row; ``whole``: the attribution's figures (:data:`_WHOLE_FIGURES`)
    over the device's whole sampled span [first sample, last sample] when the caller has them
    (computed here otherwise)."""
    row: dict[str, Any] = {}
    p = column(s, "power_instant_w", np.nan, t.size)
    row["duration_s"] = float((t[-1] - t[0]) / 1e9) if t.size >= 2 else float("nan")
    row["n_samples"] = float(t.size)
    # Over the device's own span: the share of it sampled without a gap and its longest gap
    # (docs/attribution.md, Coverage), so a stalled sampler shows in the per-rank table: the
    # attribution's figures for the window [first sample, last sample] (set below).
    row["coverage"], row["gap_max_s"] = float("nan"), float("nan")
    row["power_avg_w"] = time_weighted_mean(t, p)
    row["power_peak_w"] = float(np.nanmax(p)) if np.isfinite(p).any() else float("nan")
    for name in ("temp_gpu_c", "temp_hbm_c"):
        x = column(s, name, np.nan, t.size)
        base = name[: -len("_c")]
        row[f"{base}_avg_c"] = time_weighted_mean(t, x)
        row[f"{base}_peak_c"] = float(np.nanmax(x)) if np.isfinite(x).any() else float("nan")
    row["clock_sm_avg_mhz"] = time_weighted_mean(t, column(s, "clock_sm_mhz", np.nan, t.size))
    energy_mj = column(s, "energy_mj", INT_NULL, t.size)
    counter, resets = counter_increase(energy_mj)
    row["energy_counter_j"] = counter / 1e3
    row["energy_counter_period_s"] = counter_update_period_s(t, energy_mj)
    row["energy_counter_resets"] = float(resets)
    row["energy_trapezoid_j"] = trapezoid_energy_j(t, p)
    den = row["energy_trapezoid_j"]
    row["energy_disagreement"] = (
        (row["energy_counter_j"] - den) / den if den and np.isfinite(den) else float("nan")
    )
    # The device's energy over its whole sampled span by the attribution's rules, with its bound
    # (docs/attribution.md, Energy bounds): what `charllm energy` reports per device.
    if t.size >= 2:
        if whole is None:
            one = attribute_windows(s, [(int(t[0]), int(t[-1]))], figures=_WHOLE_FIGURES)
            whole = {k: v[0] for k, v in one.items()}
        row["coverage"], row["gap_max_s"] = float(whole["coverage"]), float(whole["gap_max_s"])
        row["energy_j"] = float(whole["energy_j"])
        row["energy_bound_j"] = float(whole["energy_bound_j"])
        row["energy_method"] = str(whole["energy_method"])
    else:
        row["energy_j"], row["energy_bound_j"] = float("nan"), float("nan")
        row["energy_method"] = "none"
    for name in TRAFFIC:
        total, _ = counter_increase(column(s, name, INT_NULL, t.size))
        row[name] = total
    mask = column(s, "throttle_reasons", INT_NULL, t.size)
    known = mask >= 0
    shares = throttle_shares(t, mask) if known.all() else throttle_shares(t[known], mask[known])
    for j, (name, _) in enumerate(THROTTLE_REASONS):
        row[f"throttle_{name}_share"] = float(shares[j])
    row.update(throttle_counter_figures(t, s))  # per-reason counters vs sampled bits, transitions
    limit = column(s, "power_limit_w", np.nan, t.size)
    row["power_limit_w"] = _median_limit(limit)
    return row


def _median_limit(limit: np.ndarray[Any, Any]) -> float:
    """The median power limit (NaN: never sampled). A limit held the whole run (the usual case)
    is its own median: no sort of every sample (np.nanmedian: ~3 ms a rank-hour)."""
    if limit.size and np.isfinite(limit[0]) and bool((limit == limit[0]).all()):
        return float(limit[0])
    return float(np.nanmedian(limit)) if np.isfinite(limit).any() else float("nan")


def rank_tables(data: RankArrays) -> RankTables:
    """Every table's rows for one rank (all its devices)."""
    s_all, w = data.samples, data.windows
    dev_ids = distinct(s_all["device_index"]) if s_all["t_mono_ns"].size else np.array([], np.int64)
    dev_rows: dict[str, list[Any]] = {}
    win_parts: list[Columns] = []
    span_parts: list[Columns] = []
    steps = measured_steps(w["step"][w["kind"] == "step"]) if w["kind"].size else np.array([], np.int64)
    is_step = (w["kind"] == "step") & np.isin(w["step"], steps)
    ends = w["t_end_mono_ns"][is_step]
    ends = ends[ends != INT_NULL]
    span = (int(w["t_begin_mono_ns"][is_step].min()), int(ends.max())) if ends.size else None
    for dev in dev_ids:
        if dev_ids.size == 1:  # the usual rank: one device, no copy of its columns
            s, _ = prepare_samples(s_all)
        else:
            sel = s_all["device_index"] == dev
            s, _ = prepare_samples({k: v[sel] for k, v in s_all.items()})
        t = s["t_mono_ns"]
        # One attribution per device (issue #45: three calls cost a quarter of the analysis):
        # the windows, then the device's whole sampled span, then the measured steps' span, as
        # extra windows of the same call (each window's figures depend on it alone).
        m = w["window_id"].size
        extra = [(int(t[0]), int(t[-1]))] if t.size >= 2 else []
        extra += [span] if span is not None else []
        edges = {
            "t_begin_mono_ns": np.concatenate((w["t_begin_mono_ns"], [e[0] for e in extra])).astype(np.int64),
            "t_end_mono_ns": np.concatenate((w["t_end_mono_ns"], [e[1] for e in extra])).astype(np.int64),
        }
        every = attribute_windows(s, edges)
        fig = {k: v[:m] for k, v in every.items()}
        whole = {k: every[k][m] for k in _WHOLE_FIGURES} if t.size >= 2 else None
        row = _device_row(t, s, whole)
        row["device_index"] = float(dev)
        for k, v in row.items():
            dev_rows.setdefault(k, []).append(v)
        fig.update(_excursions(s, w))
        fig.update({k: w[k] for k in WINDOW_KEYS})
        fig["measured"] = np.isin(w["step"], steps)
        fig["device_index"] = np.full(m, dev, np.int64)
        win_parts.append(fig)
        if span is not None:
            one = {k: every[k][-1:] for k in ("duration_s", *_SPAN_FIGURES)}
            span_parts.append(
                {
                    "device_index": np.array([dev]),
                    "span_s": one["duration_s"],
                    "span_energy_j": one["energy_j"],
                    "span_energy_method": one["energy_method"],
                    "span_energy_bound_j": one["energy_bound_j"],
                    "measured_steps": np.array([steps.size]),
                }
            )
    devices = {k: np.asarray(v) for k, v in dev_rows.items()}
    if "device_index" in devices:
        devices["device_index"] = devices["device_index"].astype(np.int64)
    return RankTables(devices, _concat(win_parts), _concat(span_parts))


def _excursions(s: dict[str, np.ndarray[Any, Any]], w: dict[str, np.ndarray[Any, Any]]) -> Columns:
    """Per window: seconds the instant power was above the power limit (sample-and-hold), and the
    largest power rise within 100 ms that starts inside the window (W)."""
    t = s["t_mono_ns"]
    m = w["window_id"].size
    above = np.full(m, np.nan)
    rise_w = np.full(m, np.nan)
    p = s.get("power_instant_w")
    if p is None or t.size < 2 or m == 0:
        return {"time_above_limit_s": above, "largest_rise_100ms_w": rise_w}
    t0, t1 = w["t_begin_mono_ns"], w["t_end_mono_ns"]
    valid = (t0 != INT_NULL) & (t1 != INT_NULL) & (t1 >= t0)
    limit = column(s, "power_limit_w", np.nan, t.size)
    if np.isfinite(limit).any():
        # At the limit counts: power capping holds the power there (sw_power_cap).
        flags = np.nan_to_num(p, nan=-np.inf) >= np.nan_to_num(limit, nan=np.inf)
        above[valid] = _held(t, flags, t0[valid], t1[valid])  # held_time less its check of t
    rise = largest_rise(t, p, RISE_HORIZON_NS)
    lo = np.searchsorted(t, t0[valid], side="left")
    hi = np.searchsorted(t, t1[valid], side="left")
    inside = hi > lo
    vals = np.full(lo.size, np.nan)
    if inside.any():
        r = np.where(np.isnan(rise), -np.inf, rise)
        idx = np.empty(2 * int(inside.sum()), dtype=np.intp)
        idx[0::2], idx[1::2] = lo[inside], hi[inside]
        red = np.maximum.reduceat(np.append(r, -np.inf), idx)[0::2]
        vals[inside] = np.where(np.isfinite(red), red, np.nan)
    rise_w[valid] = vals
    return {"time_above_limit_s": above, "largest_rise_100ms_w": rise_w}


def _concat(parts: list[Columns]) -> Columns:
    if not parts:
        return {}
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def reduce_rank(run: Run, rank: int) -> tuple[int, RankTables | None, list[str]]:
    """Load and reduce one rank: what a worker process of :func:`analysis.analyze.analyze` runs
    (its arguments and result are small enough to pass between processes: paths in, the rank's
    rows out). Returns (rank, its tables or None when it has no samples, problems met)."""
    problems: list[str] = []
    data = load_rank_arrays(run, rank, problems)
    return rank, (rank_tables(data) if data is not None else None), problems


def reduce_files(files: RankFiles) -> tuple[int, RankTables | None, list[str]]:
    """Load and reduce one rank from its files: (rank, its tables or None when it has no
    samples, problems met). A worker process's task: here rather than in analyze.py, so a
    worker imports what a rank's reduction needs and not DuckDB."""
    problems: list[str] = []
    data = rank_arrays(files, problems)
    return files.rank, (rank_tables(data) if data is not None else None), problems


@dataclass(frozen=True)
class RankTask:
    """What a worker process of :func:`analysis.analyze.analyze` is sent for one rank: its
    files, its manifest (the waveform's clock and host) and the job power waveform's grid step
    (s; None: no waveform part)."""

    files: RankFiles
    manifest: Mapping[str, Any]
    wave_step_s: float | None


_WAVE_ONLY = tuple(c for c in WAVE_SAMPLE_COLUMNS if c not in SAMPLE_COLUMNS)
"""Sample columns the waveform reads and the tables do not (``t_wall_ns``)."""


def reduce_task(task: RankTask) -> tuple[int, RankTables | None, RankWave | None, list[str]]:
    """:func:`reduce_files` and, from the same arrays (the samples read once), the rank's part of
    the job power waveform (:func:`.grid_wave.rank_wave`): (rank, its tables or None when it
    has no samples, its waveform part or None, problems met)."""
    problems: list[str] = []
    rank = task.files.rank
    if task.wave_step_s is None:
        data = rank_arrays(task.files, problems)
        return rank, (rank_tables(data) if data is not None else None), None, problems
    data = rank_arrays(task.files, problems, SAMPLE_COLUMNS + _WAVE_ONLY)
    if data is None:
        return rank, None, None, problems
    wave = rank_wave(task.manifest, data.samples, data.windows, task.wave_step_s)
    for c in _WAVE_ONLY:
        del data.samples[c]
    return rank, rank_tables(data), wave, problems
