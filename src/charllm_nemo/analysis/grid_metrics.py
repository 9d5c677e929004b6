"""What the power grid cares about in a power waveform, with numpy alone: resampling onto a common
time grid, swing per iteration, ramp rates, the spectrum (Welch), and the smoothing what-if.

Every function takes a waveform on a uniform grid (``x``: W per grid point, NaN where not
covered; ``dt``: the grid step in s) and returns plain numbers; :mod:`.grid_power` puts runs on
the grid and makes the tables (docs/grid.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]


def resample_linear(t_s: Array, p_w: Array, grid_s: Array, max_gap_s: float) -> Array:
    """Instant-power samples ``(t_s, p_w)`` (s, W; any order, NaN power skipped) at the grid times
    ``grid_s`` by linear interpolation between the two samples around each grid time; NaN outside
    the samples and inside a gap longer than ``max_gap_s``. Linear, not sample-and-hold: the
    readings are point values of a continuous signal, so the line between two is the unbiased
    guess, its integral is the trapezoid energy the rest of the analysis uses, and it neither
    delays the waveform by half a sample period nor turns every change into a one-grid-step jump
    (which would read the ramp rate as ``ΔP / grid step``, whatever the true slope)."""
    ok = np.isfinite(p_w) & np.isfinite(t_s)
    t, p = (t_s, p_w) if ok.all() else (t_s[ok], p_w[ok])
    if not bool(np.all(t[1:] >= t[:-1])):  # in order already (the usual case): the sort keeps it
        order = np.argsort(t, kind="stable")
        t, p = t[order], p[order]
    out = np.full(len(grid_s), np.nan)
    if len(t) < 2:
        return out
    out[:] = np.interp(grid_s, t, p)
    inside = (grid_s >= t[0]) & (grid_s <= t[-1])
    if not bool((np.diff(t) > max_gap_s).any()):  # no gap: no grid time to find in one (the
        out[~inside] = np.nan  # search below is ~7 ms a rank-hour at a 10 ms grid)
        return out
    j = np.searchsorted(t, grid_s, side="left")
    jj = np.clip(j, 1, len(t) - 1)
    gap = (t[jj] - t[jj - 1]) > max_gap_s
    out[~inside | (gap & (grid_s != t[jj]))] = np.nan
    return out


def iteration_bounds(n: int, dt: float, begins_s: Array, ends_s: Array) -> list[tuple[int, int]]:
    """Grid index ranges ``[a, b)`` of the iterations: from each step's begin to the next one's
    (the time between two steps belongs to the iteration's period), the last to its own end;
    steps outside the grid are dropped."""
    order = np.argsort(begins_s)
    b, e = begins_s[order], ends_s[order]
    out = []
    for k in range(len(b)):
        stop = b[k + 1] if k + 1 < len(b) else e[k]
        a, z = math.ceil(b[k] / dt - 1e-9), math.floor(stop / dt + 1e-9)
        if a >= 0 and z <= n and z - a >= 2:
            out.append((a, z))
    return out


def period_bounds(n: int, dt: float, period_s: float) -> list[tuple[int, int]]:
    """Consecutive chunks of one period each (used when a run has no step windows)."""
    k = max(2, round(period_s / dt))
    return [(a, a + k) for a in range(0, n - k + 1, k)]


@dataclass
class Swing:
    """Peak-to-trough per iteration (W), over the iterations fully covered by the waveform."""

    iterations: int
    p50_w: float
    max_w: float


def _covered_ranges(x: Array, lo: Array, hi: Array) -> tuple[Array, Array]:
    """Of the ranges ``x[lo[k]:hi[k]]`` (each non-empty, within ``x``), those without NaN, in order."""
    bad = np.concatenate(([0], np.cumsum(~np.isfinite(x))))
    keep = bad[hi] == bad[lo]
    return lo[keep], hi[keep]


def _range_max_min(x: Array, lo: Array, hi: Array) -> tuple[Array, Array]:
    """max and min of each ``x[lo[k]:hi[k]]`` (non-empty, possibly overlapping), in one pass each."""
    idx = np.empty(2 * lo.size, dtype=np.intp)
    idx[0::2], idx[1::2] = lo, hi
    padded = np.append(x, x[-1:])  # so that hi == len(x) is a valid reduceat index
    return np.maximum.reduceat(padded, idx)[0::2], np.minimum.reduceat(padded, idx)[0::2]


def _bounds_arrays(bounds: list[tuple[int, int]]) -> tuple[Array, Array]:
    b = np.asarray(bounds, dtype=np.intp).reshape(-1, 2)
    return b[:, 0], b[:, 1]


def swing(x: Array, bounds: list[tuple[int, int]]) -> Swing:
    """Peak-to-trough of ``x`` inside each iteration; an iteration with an uncovered point is left out."""
    lo, hi = _bounds_arrays(bounds)
    hi = np.minimum(hi, len(x))
    lo, hi = _covered_ranges(x, lo[hi > lo], hi[hi > lo])
    if not lo.size:
        return Swing(0, math.nan, math.nan)
    mx, mn = _range_max_min(x, lo, hi)
    vals = mx - mn
    return Swing(len(vals), float(np.median(vals)), float(np.max(vals)))


@dataclass
class Ramps:
    """Steepest rise and fall per iteration (W/s, both positive): their p50, p99 and max."""

    up: tuple[float, float, float]
    down: tuple[float, float, float]


def _stats(v: list[float]) -> tuple[float, float, float]:
    if not v:
        return (math.nan, math.nan, math.nan)
    a = np.asarray(v)
    return (float(np.percentile(a, 50)), float(np.percentile(a, 99)), float(np.max(a)))


def ramps(x: Array, dt: float, bounds: list[tuple[int, int]], window_s: float) -> Ramps:
    """Rate of change over ``window_s`` (rounded to whole grid steps, at least one):
    ``(x[i + k] - x[i]) / (k dt)``; per iteration its largest rise and largest fall; their
    percentiles over the iterations. A per-iteration figure, not a percentile over every grid
    point: most points of a square-ish waveform are flat, so a percentile over them says 0."""
    k = max(1, round(window_s / dt))
    if len(x) <= k:
        return Ramps((math.nan, math.nan, math.nan), (math.nan, math.nan, math.nan))
    r = (x[k:] - x[:-k]) / (k * dt)
    lo, hi = _bounds_arrays(bounds)
    hi = np.maximum(lo, np.minimum(hi, len(r)))  # each iteration's rates that lie inside r
    lo, hi = _covered_ranges(r, lo[hi > lo], hi[hi > lo])
    if not lo.size:
        return Ramps(_stats([]), _stats([]))
    mx, mn = _range_max_min(r, lo, hi)
    return Ramps(_stats(list(np.where(mx > 0.0, mx, 0.0))), _stats(list(np.where(-mn > 0.0, -mn, 0.0))))


@dataclass
class Spectrum:
    """One-sided power spectral density (W²/Hz) and what it says."""

    freq_hz: Array
    psd: Array
    dominant_hz: float
    dominant_amplitude_w: float  # amplitude of the sinusoid at the dominant frequency
    band_share: float  # share of the variance (the swing's energy) inside the band


def longest_covered(x: Array) -> Array:
    """The longest stretch of ``x`` without NaN."""
    ok = np.concatenate(([False], np.isfinite(x), [False]))
    edges = np.flatnonzero(np.diff(ok.astype(np.int8)))
    if len(edges) == 0:
        return x[:0]
    starts, stops = edges[::2], edges[1::2]
    i = int(np.argmax(stops - starts))
    return x[starts[i] : stops[i]]


def spectrum(x: Array, dt: float, band_hz: tuple[float, float], segment_s: float = 20.0) -> Spectrum:
    """Welch's PSD of the longest covered stretch of ``x``: Hann-windowed segments of
    ``segment_s`` (the whole stretch when shorter), half overlapping, each less its mean, padded
    to 4x for a finer frequency grid. The dominant frequency is the highest peak above the
    lowest resolved frequency, refined by a parabola through the log PSD of its three bins; its
    amplitude is ``sqrt(2 x`` the power inside the window's main lobe around it). ``band_share``:
    the PSD integrated over ``band_hz`` over the PSD integrated over all frequencies above 0."""
    y = longest_covered(x)
    n = len(y)
    nan = Spectrum(np.zeros(0), np.zeros(0), math.nan, math.nan, math.nan)
    if n < 16:
        return nan
    fs = 1.0 / dt
    seg = min(n, max(16, round(segment_s * fs)))
    hop = max(1, seg // 2)
    nfft = 1 << math.ceil(math.log2(4 * seg))
    w = np.hanning(seg)
    scale = 1.0 / (fs * float(np.sum(w * w)))
    acc = np.zeros(nfft // 2 + 1)
    count = 0
    for a in range(0, n - seg + 1, hop):
        s = y[a : a + seg]
        spec = np.fft.rfft((s - s.mean()) * w, nfft)
        acc += np.abs(spec) ** 2
        count += 1
    psd = acc / count * scale
    psd[1:-1] *= 2  # one-sided
    f = np.fft.rfftfreq(nfft, dt)
    df = f[1]
    total = float(np.sum(psd[1:]) * df)
    lo_i = math.ceil(2 * nfft / seg)  # above the lowest resolved frequency (DC's main lobe)
    if total <= 0 or lo_i >= len(psd) - 1:
        return Spectrum(f, psd, math.nan, math.nan, math.nan)
    i = lo_i + int(np.argmax(psd[lo_i:-1]))
    peak = f[i]
    a, b, c = np.log(np.maximum(psd[i - 1 : i + 2], 1e-300))
    den = a - 2 * b + c
    if den < 0:
        peak += 0.5 * (a - c) / den * df
    lobe = math.ceil(2 * nfft / seg)  # a Hann window's main lobe: +-2 bins of the segment
    p_peak = float(np.sum(psd[max(1, i - lobe) : i + lobe + 1]) * df)
    inband = (f >= band_hz[0]) & (f <= band_hz[1])
    inband[0] = False
    share = float(np.sum(psd[inband]) * df) / total
    return Spectrum(f, psd, float(peak), math.sqrt(2 * p_peak), share)


def block_average(x: Array, dt: float, seconds: float) -> Array:
    """``x`` averaged over consecutive blocks of ``seconds`` (what a 1 s power average shows)."""
    k = max(1, round(seconds / dt))
    m = len(x) // k
    return x[: m * k].reshape(m, k).mean(axis=1) if m else x[:0]


@dataclass
class WhatIf:
    """A power floor held by every GPU (``floor_w`` each): what it costs and what swing remains."""

    floor_w: float
    extra_energy_j: float
    energy_j: float
    swing_p50_w: float


def floor_what_if(
    job_w: Array, n_gpus: int, dt: float, floor_w: float, bounds: list[tuple[int, int]]
) -> WhatIf:
    """Every GPU held at or above ``floor_w``, applied to the job's mean GPU power
    ``job_w / n_gpus``: ``extra = sum(max(0, floor - mean) x n_gpus x dt)`` over the iterations.
    Exact when the GPUs move together (synchronous training); when they do not, the real floor
    costs more (the mean of ``max(p_g, floor)`` is at least ``max(mean, floor)``): a lower bound."""
    if not bounds:
        return WhatIf(floor_w, math.nan, math.nan, math.nan)
    a, b = bounds[0][0], bounds[-1][1]
    x = job_w[a:b]
    ok = np.isfinite(x)
    deficit = np.maximum(0.0, floor_w * n_gpus - x[ok])
    smoothed = np.maximum(job_w, floor_w * n_gpus)
    return WhatIf(
        floor_w,
        float(np.sum(deficit) * dt),
        float(np.sum(x[ok]) * dt),
        swing(smoothed, bounds).p50_w,
    )
