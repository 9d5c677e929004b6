"""Whole-run figures of one device's samples: plain numpy over arrays, no row loops.

Every function takes one device's timeline (``t_ns`` int64 CLOCK_MONOTONIC ns, strictly
increasing after :func:`charllm_nemo.telemetry.attribution.prepare_samples`) and one metric
(floats NaN = null, ints negative = null). Nulls are skipped: the curve goes straight from one
non-null sample to the next, as in the window attribution (docs/attribution.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from charllm_nemo.telemetry.timelines import null_broadcast

FloatArray = np.ndarray[Any, np.dtype[np.float64]]
IntArray = np.ndarray[Any, np.dtype[np.int64]]

NS_PER_S = 1e9


def column(s: Mapping[str, np.ndarray[Any, Any]], name: str, null: float, n: int) -> np.ndarray[Any, Any]:
    """``s[name]``, or ``null`` (NaN, or INT_NULL for an int metric) broadcast over the ``n``
    samples when ``s`` lacks it: read-only and no memory (``s.get(name, np.full(...))`` filled a new
    array for every call, present or not: ~1.3 ms a rank-hour)."""
    a = s.get(name)
    if a is not None:
        return a
    value = np.asarray(null, np.float64 if isinstance(null, float) else np.int64)
    return np.broadcast_to(value, (n,))


def distinct(values: IntArray) -> IntArray:
    """``np.unique(values)``, without its hash pass over every row when they all hold one value
    (a rank's samples are usually of one device)."""
    if values.size and values.min() == values.max():
        return values[:1].copy()
    return np.unique(values)


def time_weighted_mean(t_ns: IntArray, x: FloatArray) -> float:
    """Time-weighted mean of a float metric over its own span (trapezoids between consecutive
    non-null samples, divided by the span), in the metric's unit; NaN with fewer than 2
    non-null samples."""
    ok = ~np.isnan(x)
    t, v = (t_ns, x) if ok.all() else (t_ns[ok], x[ok])  # no copy without nulls
    if t.size < 2 or t[-1] == t[0]:
        return float("nan")
    dt = np.diff(t).astype(np.float64)
    return float(np.sum(dt * (v[:-1] + v[1:]) * 0.5) / (t[-1] - t[0]))


def trapezoid_energy_j(t_ns: IntArray, power_w: FloatArray) -> float:
    """Energy in J: the integral of the power curve (W) over its non-null span; NaN with fewer
    than 2 non-null samples."""
    ok = ~np.isnan(power_w)
    t, v = (t_ns, power_w) if ok.all() else (t_ns[ok], power_w[ok])
    if t.size < 2:
        return float("nan")
    dt_s = np.diff(t).astype(np.float64) / NS_PER_S
    return float(np.sum(dt_s * (v[:-1] + v[1:]) * 0.5))


def counter_increase(values: IntArray) -> tuple[float, int]:
    """Total increase of a cumulative 64-bit counter across its non-null samples, and how many
    times it went down (a reset, a driver reload, a wrap).

    Deltas are taken in int64 (exact at any magnitude: near 2**62 float64 cannot tell x from
    x + 1) and only the non-negative ones are summed: across a reset the counter restarts
    from an unknown value, so the interval that holds the reset is left out rather than
    guessed. Returns (increase in the counter's unit as float64, number of decreases); NaN
    increase with fewer than 2 non-null samples."""
    if null_broadcast(values):  # an all-null column as loaded: no pass
        c = values[:0]
    else:
        known = values >= 0
        c = values if known.all() else values[known]
    if c.size < 2:
        return float("nan"), 0
    d = np.diff(c)
    down = d < 0
    return float(d[~down].sum()), int(down.sum())


def counter_update_period_s(t_ns: IntArray, values: IntArray) -> float:
    """How often a cumulative counter moves (s): the median time between the samples at which
    its value changed. NVML's energy counter moves every ~20-100 ms whatever the sampling rate
    (an H200: 100 ms), so an energy over a span is uncertain by up to one period at each end.
    NaN with fewer than two changes."""
    known = values >= 0
    c, t = (values, t_ns) if known.all() else (values[known], t_ns[known])
    if c.size < 3:
        return float("nan")
    changed = t[1:][np.diff(c) != 0]
    if changed.size < 2:
        return float("nan")
    return float(np.median(np.diff(changed))) / NS_PER_S


def held_share(t_ns: IntArray, flags: np.ndarray[Any, Any]) -> FloatArray:
    """Share of the timeline (0..1) each flag was set, sample-and-hold (a sample's flags hold
    until the next sample). ``flags`` is (n,) or (n, k); the last sample's flags hold no time.
    NaN with fewer than 2 samples."""
    k = flags.shape[1:] if flags.ndim > 1 else ()
    if t_ns.size < 2 or t_ns[-1] == t_ns[0]:
        return np.full(k, np.nan)
    # A matrix-vector product: one pass for every flag. float64 is exact here (a run's
    # nanoseconds stay far below 2**53 ns, 104 days).
    dt = np.diff(t_ns).astype(np.float64)
    held = flags[:-1].astype(np.float64).T @ dt
    return np.asarray(held / float(t_ns[-1] - t_ns[0]), dtype=np.float64)


def largest_rise(t_ns: IntArray, p: FloatArray, horizon_ns: int) -> FloatArray:
    """For each sample i: the largest increase ``p[j] - p[i]`` over the later samples j with
    ``t[j] - t[i] <= horizon_ns`` (0 when none is higher or none is that close), in p's unit.
    NaN where p[i] is null; null later samples are skipped. Vectorised over a sliding maximum:
    pass k takes sample i + k where it is within the horizon of sample i, until no sample is
    (t strictly increasing: k is at most the samples one horizon holds, 10 at 100 Hz). No search
    of the horizon's ends: that ``searchsorted`` cost as much as the passes (~7 ms a rank-hour).
    A pass where every sample i + k is within the horizon (all but the last at a steady rate)
    takes the maximum unmasked, and samples without nulls are used as they are (7.8 -> 6.3 ms
    a rank-hour)."""
    n = t_ns.size
    out = np.full(n, np.nan)
    ok = ~np.isnan(p)
    if n < 2 or not ok.any():
        return out
    every = bool(ok.all())
    filled = p if every else np.where(ok, p, -np.inf)
    best = np.full(n, -np.inf)
    for k in range(1, n):
        near = (t_ns[k:] - t_ns[:-k]) <= horizon_ns  # sample i + k within sample i's horizon
        if near.all():
            np.maximum(best[:-k], filled[k:], out=best[:-k])
            continue
        if not near.any():
            break
        np.maximum(best[:-k], filled[k:], out=best[:-k], where=near)
    rise = np.maximum(best - filled, 0.0)
    if every:
        return np.asarray(rise, dtype=np.float64)
    out[ok] = rise[ok]
    return out


def pearson(x: FloatArray, y: FloatArray) -> float:
    """Pearson correlation of the pairs where both are finite; NaN with fewer than 3 pairs or
    when either side is constant."""
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3:
        return float("nan")
    a, b = x[ok] - x[ok].mean(), y[ok] - y[ok].mean()
    den = float(np.sqrt((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / den) if den > 0 else float("nan")
