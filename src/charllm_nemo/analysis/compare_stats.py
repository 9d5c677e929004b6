"""The statistics behind ``charllm compare`` and ``charllm advise``: a hierarchical bootstrap
(runs, then blocks of steps within runs), its small-sample widening, a within-run trend test and
how many repeats a difference needs.

Plain numpy over arrays of per-step values, one array per run; nothing here reads a file.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 20250917
"""The bootstrap's fixed seed (the same runs give the same intervals)."""

Z975 = 1.959963984540054
"""The standard normal's 97.5 % quantile."""

_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
"""Student's t 97.5 % quantiles for 1..30 degrees of freedom (no scipy needed)."""


def t975(df: int) -> float:
    """Student's t 97.5 % quantile for ``df`` >= 1 degrees of freedom (the normal's above 30,
    where the two differ by under 4 %)."""
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")
    return _T975[df - 1] if df <= len(_T975) else Z975


def widening(runs_a: int, runs_b: int) -> float:
    """How much the hierarchical bootstrap's interval is widened for few runs (1 when either
    side has a single run: then there is no run level to correct).

    Resampling ``R`` runs with replacement gives a variance of their mean ``(R - 1) / R`` times
    the unbiased one, and a difference estimated from ``R_a + R_b`` runs follows Student's t with
    ``R_a + R_b - 2`` degrees of freedom, not the normal the percentile interval assumes: the
    interval's half-widths are multiplied by ``sqrt(R / (R - 1)) x t(R_a + R_b - 2) / z``, ``R``
    the smaller side (3 runs a side: x1.73; 5: x1.38; 20: x1.08)."""
    r = min(runs_a, runs_b)
    if r < 2:
        return 1.0
    return math.sqrt(r / (r - 1)) * t975(runs_a + runs_b - 2) / Z975


def block_indices(n: int, rng: np.random.Generator, resamples: int) -> Array:
    """``resamples`` rows of ``n`` step indices made of moving blocks of ``ceil(n ** (1/3))``
    consecutive steps (wrapping): consecutive steps are correlated (a hot device stays hot), and
    resampling single steps would understate the spread."""
    block = max(1, math.ceil(n ** (1 / 3)))
    blocks = math.ceil(n / block)
    starts = rng.integers(0, n, size=(resamples, blocks))
    idx = (starts[:, :, None] + np.arange(block)[None, None, :]) % n
    return idx.reshape(resamples, blocks * block)[:, :n]


def resampled_medians(runs: Sequence[Array], rng: np.random.Generator, resamples: int) -> Array:
    """The pooled median of ``resamples`` hierarchical resamples of ``runs`` (one array of
    per-step values each): draw as many runs as there are, with replacement, then within each
    drawn run its steps by moving blocks. With one run only its steps vary."""
    sizes = np.array([r.size for r in runs])
    n_runs, n_max = len(runs), int(sizes.max())
    out = np.empty(resamples)
    chunk = max(1, 4_000_000 // (n_runs * n_max))  # bounds the padded matrix (~32 MB)
    for lo in range(0, resamples, chunk):
        k = min(chunk, resamples - lo)
        picked = rng.integers(0, n_runs, size=(k, n_runs)) if n_runs > 1 else np.zeros((k, 1), int)
        cells = np.full((k, n_runs, n_max), np.nan)
        for slot in range(n_runs):
            for r in np.unique(picked[:, slot]):
                rows = np.nonzero(picked[:, slot] == r)[0]
                cells[rows, slot, : sizes[r]] = runs[r][block_indices(int(sizes[r]), rng, rows.size)]
        flat = cells.reshape(k, -1)
        # Runs of one length leave no padding: the plain median is several times faster.
        out[lo : lo + k] = np.median(flat, axis=1) if (sizes == n_max).all() else np.nanmedian(flat, axis=1)
    return out


def pooled_median(runs: Sequence[Array]) -> float:
    """The median of every run's steps together (NaN when there are none)."""
    values = np.concatenate(list(runs)) if runs else np.empty(0)
    return float(np.median(values)) if values.size else math.nan


def difference(a: float, b: float, relative: bool) -> float:
    """``(b - a) / |a|`` (relative) or ``b - a``; NaN when relative and ``a`` is 0."""
    if relative:
        return (b - a) / abs(a) if a != 0 else math.nan
    return b - a


def hierarchical_difference(
    runs_a: Sequence[Array],
    runs_b: Sequence[Array],
    *,
    relative: bool = True,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = SEED,
    widen: bool = True,
) -> tuple[float, float, float]:
    """The difference of the pooled medians of two groups of runs and its interval ``(point,
    low, high)`` at ``confidence``: the hierarchical bootstrap's percentile interval, its
    half-widths (from the resamples' median) widened by :func:`widening` when ``widen``. NaNs
    when either side has no value (or, relative, the baseline's median is 0)."""
    a_runs = [np.asarray(r, np.float64) for r in runs_a if np.asarray(r).size]
    b_runs = [np.asarray(r, np.float64) for r in runs_b if np.asarray(r).size]
    if not a_runs or not b_runs:
        return math.nan, math.nan, math.nan
    point = difference(pooled_median(a_runs), pooled_median(b_runs), relative)
    if math.isnan(point):
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    ma = resampled_medians(a_runs, rng, resamples)
    mb = resampled_medians(b_runs, rng, resamples)
    with np.errstate(divide="ignore", invalid="ignore"):
        diffs = (mb - ma) / np.abs(ma) if relative else mb - ma
    diffs = diffs[np.isfinite(diffs)]
    if diffs.size == 0:
        return point, math.nan, math.nan
    tail = (1 - confidence) / 2 * 100
    q_low, centre, q_high = np.percentile(diffs, [tail, 50, 100 - tail])
    k = widening(len(a_runs), len(b_runs)) if widen else 1.0
    low = point - k * (centre - q_low)
    high = point + k * (q_high - centre)
    return point, float(min(low, point)), float(max(high, point))


def trend_change(values: Array, elapsed_s: Array, resolution: float) -> float | None:
    """How much a figure moves through one run (least-squares slope over elapsed time x the
    run's span, in the figure's units) when the move is both larger than ``resolution`` and
    more than 3 standard errors of the slope from flat; None when it does not trend (or the
    run has fewer than 4 steps)."""
    ok = np.isfinite(values) & np.isfinite(elapsed_s)
    x, y = elapsed_s[ok], values[ok]
    if x.size < 4 or float(np.ptp(x)) <= 0:
        return None
    xc = x - x.mean()
    sxx = float(np.sum(xc * xc))
    slope = float(np.sum(xc * (y - y.mean())) / sxx)
    resid = y - y.mean() - slope * xc
    se = math.sqrt(float(np.sum(resid * resid)) / (x.size - 2) / sxx)
    change = slope * float(np.ptp(x))
    if abs(change) <= resolution or abs(slope) <= 3 * se:
        return None
    return change


def segment_spread(values: Array, segments: int = 4) -> float | None:
    """The standard deviation of the medians of ``segments`` consecutive parts of one run (the
    run's own slow drift: how much a run-long median can move with the host's minutes); None
    below 2 steps a part."""
    if values.size < 2 * segments:
        return None
    parts = np.array_split(values, segments)
    return float(np.std([np.median(p) for p in parts], ddof=1))


MIN_REPEATS = 3
"""Fewest runs a side ever proposed: with two, resampling runs sees three combinations only."""
MAX_REPEATS = 50


def repeats_needed(spread: float, effect: float, widen: Callable[[int, int], float] = widening) -> int | None:
    """Runs per side that resolve ``effect`` when runs vary by ``spread`` (same units): the
    smallest ``n`` >= :data:`MIN_REPEATS` whose widened interval half-width ``widen(n, n) x z x
    spread x sqrt(2 / n)`` is below ``|effect|``; None above :data:`MAX_REPEATS` (or with no
    effect to resolve)."""
    if not (math.isfinite(spread) and math.isfinite(effect)) or effect == 0:
        return None
    for n in range(MIN_REPEATS, MAX_REPEATS + 1):
        if widen(n, n) * Z975 * spread * math.sqrt(2 / n) < abs(effect):
            return n
    return None
