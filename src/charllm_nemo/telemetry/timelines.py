"""Timelines: one device metric's samples as a curve, and the maths of attribution over it.

Used by :mod:`charllm_nemo.telemetry.attribution` (which applies these per window and says the
rules in its module doc; docs/attribution.md in full). Every function is over numpy arrays:
times are int64 CLOCK_MONOTONIC ns, strictly increasing; a float metric's null is NaN and an
int metric's null is :data:`~charllm_nemo.telemetry.schema.INT_NULL` (any negative value).

* a float metric (power in W, temperature in °C, clock in MHz) is the straight line between its
  non-null samples (:class:`_Series`: exact integral, time-weighted mean, extremes);
* a cumulative int counter (energy in mJ, bytes, ns) is subtracted in int64 before any
  interpolation, and a decrease (reset, wrap) makes a window's delta NaN (:func:`_delta`);
* the energy counter is used between its tick points (telemetry/counter_energy.py);
* a flag (a throttle bit) is held from a sample to the next (:func:`_held`).

The public helpers (:func:`integrate_power`, :func:`counter_delta`, counter_energy.py's
:func:`energy_from_counter`,
:func:`held_time`) take one metric and many windows; attribution.py re-exports them.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

from charllm_nemo.telemetry.schema import INT_NULL

__all__ = [
    "MIN_COUNTER_TICKS",
    "MJ_PER_J",
    "NS_PER_S",
    "counter_delta",
    "held_time",
    "integrate_power",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
IndexArray = npt.NDArray[np.intp]

NS_PER_S: Final = 1_000_000_000
MJ_PER_J: Final = 1000


# --------------------------------------------------------------------------------------------
# Input normalisation
# --------------------------------------------------------------------------------------------


def _as_int64(x: Any) -> IntArray:
    """int64 array with INT_NULL for null, from int, float (NaN) or object (None) input."""
    a = np.asarray(x)
    if a.dtype == object:
        a = np.array([INT_NULL if v is None else v for v in a.ravel()], dtype=np.float64)
    if a.dtype.kind == "f":
        out = np.full(a.shape, INT_NULL, dtype=np.int64)
        ok = np.isfinite(a)
        out[ok] = np.rint(a[ok]).astype(np.int64)
        return out
    if a.dtype.kind == "b":
        return a.astype(np.int64)
    return a.astype(np.int64, copy=False)


def _as_float64(x: Any) -> FloatArray:
    """float64 array with NaN for null (None in an object array becomes NaN)."""
    return np.asarray(x, dtype=np.float64)


# --------------------------------------------------------------------------------------------
# Timelines: one metric's non-null samples
# --------------------------------------------------------------------------------------------


def _segment(
    t: IntArray, x: IntArray, side: Literal["left", "right"], memo: Searches | None = None
) -> tuple[IndexArray, FloatArray]:
    """Segment index i (t[i] .. t[i+1]) holding each x, and the fraction of the way along it.

    ``side="right"`` puts an x equal to a sample at the start of that sample's segment (f = 0);
    ``side="left"`` at the end of the previous one (f = 1). Either gives the same value; the choice
    keeps a window's begin and end on the segments that overlap it. Needs t.size >= 2. With
    ``memo`` (:func:`inside`'s), the same arrays are searched once; the results are read-only.
    """
    key = ("segment", id(t), id(x), side)
    hit = memo.get(key) if memo is not None else None
    if hit is None:
        i = _search(t, x, side, memo).astype(np.intp) - 1
        _clip_index(i, t.size - 2)
        f = (x - t[i]).astype(np.float64) / (t[i + 1] - t[i]).astype(np.float64)
        hit = (t, x, i, f)  # the arrays held with their ids, so an id is never reused
        if memo is not None:
            memo[key] = hit
    return hit[2], hit[3]


def _clip_index(i: IndexArray, top: int) -> IndexArray:
    """Clip ``i`` to [0, top] in place (two ufuncs: np.clip costs several times more per call on
    the small arrays of a live single-window request)."""
    np.maximum(i, 0, out=i)
    np.minimum(i, top, out=i)
    return i


def _checked_times(t_ns: Any) -> IntArray:
    t = _as_int64(t_ns)
    if t.ndim != 1 or (t.size > 1 and not bool(np.all(np.diff(t) > 0))):
        raise ValueError("t_ns must be 1-D and strictly increasing; pass samples through prepare_samples()")
    return t


Searches = dict[tuple[Any, ...], tuple[Any, ...]]
"""Memo of :func:`inside` and :func:`_segment`: the times and edges searched and their
positions, kept together (the arrays held alive with their ids, so an id is never reused while
the memo lives)."""


def inside(
    t: IntArray, t0: IntArray, t1: IntArray, memo: Searches | None = None
) -> tuple[IndexArray, IndexArray]:
    """(lo, hi): the samples ``t[lo:hi]`` with t0 <= t < t1, per window. With ``memo``, a search
    of the same arrays is done once (one attribution call asks it of the same times and edges
    for several figures: peaks, swings, ramps, coverage). The results are read-only to callers."""
    return _search(t, t0, "left", memo), _search(t, t1, "left", memo)


def _search(t: IntArray, x: IntArray, side: Literal["left", "right"], memo: Searches | None) -> IndexArray:
    """``np.searchsorted(t, x, side)``, done once per (times, edges, side) with ``memo``: one
    attribution call asks it of the same times and edges for coverage, counts, peaks, integrals
    and held times (~0.3 ms a search of a rank-hour's 18,000 windows). Read-only to callers."""
    key = ("search", id(t), id(x), side)
    hit = memo.get(key) if memo is not None else None
    if hit is None:
        hit = (t, x, np.searchsorted(t, x, side=side))  # the arrays held: their ids not reused
        if memo is not None:
            memo[key] = hit
    found: IndexArray = hit[2]
    return found


class _Series:
    """A float metric's non-null samples: a piecewise-linear curve through (t, v); ``memo``:
    shared by the series of one attribution call (:func:`inside`)."""

    def __init__(self, t: IntArray, v: FloatArray, memo: Searches | None = None) -> None:
        if _one_value(v):
            self.t: IntArray = t[:0] if np.isnan(v[0]) else t
            self.v: FloatArray = v[:0] if np.isnan(v[0]) else v
        else:
            ok = ~np.isnan(v)
            self.t = t if ok.all() else t[ok]
            self.v = v if ok.all() else v[ok]
        self._cum: FloatArray | None = None
        self._memo = memo

    def covers(self, t0: IntArray, t1: IntArray) -> BoolArray:
        """Windows the samples bracket: a sample at-or-before t0 and one at-or-after t1."""
        if self.t.size < 2:
            return np.zeros(t0.shape, dtype=bool)
        inside: BoolArray = (t0 >= self.t[0]) & (t1 <= self.t[-1])
        return inside

    def value_at(self, x: IntArray, side: Literal["left", "right"] = "right") -> FloatArray:
        i, f = _segment(self.t, x, side, self._memo)
        return self.v[i] + (self.v[i + 1] - self.v[i]) * f

    def value_at_sample(self, k: IndexArray) -> FloatArray:
        """:meth:`value_at` of the curve's own sample times ``self.t[k]``, without the search
        (the same segment and fraction, so the same value to the bit; ~0.3 ms a search of a
        rank-hour's samples)."""
        t, v = self.t, self.v
        i = _clip_index(k.astype(np.intp), t.size - 2)
        f = (t[k] - t[i]).astype(np.float64) / (t[i + 1] - t[i]).astype(np.float64)
        return v[i] + (v[i + 1] - v[i]) * f

    def _antiderivative(self, x: IntArray, side: Literal["left", "right"]) -> FloatArray:
        t, v = self.t, self.v
        if self._cum is None:
            dt_s = np.diff(t).astype(np.float64) / NS_PER_S
            self._cum = np.concatenate(([0.0], np.cumsum(dt_s * (v[:-1] + v[1:]) * 0.5)))
        i, f = _segment(t, x, side, self._memo)
        vx = v[i] + (v[i + 1] - v[i]) * f
        seg_s = (t[i + 1] - t[i]).astype(np.float64) / NS_PER_S
        return self._cum[i] + f * seg_s * (v[i] + vx) * 0.5

    def integral(self, t0: IntArray, t1: IntArray) -> FloatArray:
        """Exact integral of the curve over [t0, t1], in value x seconds; NaN where not covered.

        The partial segments at the two edges are integrated directly, and only the whole
        segments between come from the prefix sums: a difference of two prefix sums loses
        ~1e-16 of the whole trace's area, which for a window inside one segment (a few ns to
        ms) would be a visible share of its own area (a mean below the curve's minimum)."""
        out = np.full(t0.shape, np.nan)
        ok = self.covers(t0, t1)
        if not ok.any():
            return out
        a, b = (t0, t1) if ok.all() else (t0[ok], t1[ok])  # the same arrays: searched once (memo)
        t, v = self.t, self.v
        self._antiderivative(a[:1], "right")  # builds the prefix sums once
        assert self._cum is not None
        i0, f0 = _segment(t, a, "right", self._memo)
        i1, f1 = _segment(t, b, "left", self._memo)
        va = v[i0] + (v[i0 + 1] - v[i0]) * f0
        vb = v[i1] + (v[i1 + 1] - v[i1]) * f1
        ns = float(NS_PER_S)
        same = i0 == i1
        res = np.empty(a.shape)
        res[same] = (b[same] - a[same]).astype(np.float64) / ns * (va[same] + vb[same]) * 0.5
        d = ~same
        if d.any():
            j0, j1 = i0[d], i1[d]
            head = (t[j0 + 1] - a[d]).astype(np.float64) / ns * (va[d] + v[j0 + 1]) * 0.5
            tail = (b[d] - t[j1]).astype(np.float64) / ns * (v[j1] + vb[d]) * 0.5
            res[d] = head + (self._cum[j1] - self._cum[j0 + 1]) + tail
        out[ok] = res
        return out

    def mean(self, t0: IntArray, t1: IntArray) -> FloatArray:
        """Time-weighted mean over [t0, t1]; the value at t0 for a zero-length window."""
        out = self.integral(t0, t1)
        dur = (t1 - t0).astype(np.float64) / NS_PER_S
        pos = dur > 0
        out[pos] /= dur[pos]
        zero = ~pos & self.covers(t0, t1)
        if zero.any():
            out[zero] = self.value_at(t0[zero])
        return out

    def sampled_extreme(self, ufunc: np.ufunc, t0: IntArray, t1: IntArray) -> FloatArray:
        """ufunc (np.maximum / np.minimum) of the values actually sampled with t0 <= t < t1; NaN
        where no sample lies inside. Never an interpolated edge: a peak is a value a sensor
        reported (an edge between a 100 W and a 300 W sample is a guess the device never
        showed), and a window that holds no sample has no peak. A window reaching outside the
        sampled span has none either (part of it was not observed at all)."""
        out = np.full(t0.shape, np.nan)
        if self.t.size == 0:
            return out
        lo, hi = inside(self.t, t0, t1, self._memo)
        some = (hi > lo) & self.covers(t0, t1)
        if some.any():
            out[some] = _range_reduce(ufunc, self.v, lo[some], hi[some])
        return out

    def sampled_ramps(self, t0: IntArray, t1: IntArray) -> tuple[FloatArray, FloatArray]:
        """The steepest rise and the steepest fall (both >= 0, value per s) between two
        consecutive samples both with t0 <= t < t1; 0 where the samples only fall (only rise),
        NaN where fewer than two samples lie inside or the samples do not bracket the window.
        At the sampling period's resolution: a change faster than one period shows as the change
        over that period."""
        up, down = np.full(t0.shape, np.nan), np.full(t0.shape, np.nan)
        if self.t.size < 2:
            return up, down
        lo, hi = inside(self.t, t0, t1, self._memo)
        ok = (hi - lo >= 2) & self.covers(t0, t1)
        if ok.any():
            slope = np.diff(self.v) / (np.diff(self.t).astype(np.float64) / NS_PER_S)
            a, b = lo[ok], hi[ok] - 1  # the pairs (i, i + 1) with lo <= i < hi - 1
            up[ok] = np.maximum(_range_reduce(np.maximum, slope, a, b), 0.0)
            down[ok] = np.maximum(-_range_reduce(np.minimum, slope, a, b), 0.0)
        return up, down

    def trapezoid_bound(self, t0: IntArray, t1: IntArray, gap_ns: float) -> FloatArray:
        """A bound on |true integral - :meth:`integral`| over each [t0, t1] (value x s).

        Assumes the true curve stays between the values of the two samples around it (no
        excursion shorter than a sample period: a step or a ramp between two samples). Then over
        a whole segment the trapezoid errs by at most ``|dv| x dt / 2`` (the truth lies in
        [min, max] x dt, the trapezoid in the middle), over a part of one by at most
        ``|dv| x part``. A segment longer than ``gap_ns`` (a sampling gap: the curve there is
        unknown) makes the bound +inf. NaN where the samples do not bracket the window."""
        out = np.full(t0.shape, np.nan)
        ok = self.covers(t0, t1)
        if not ok.any():
            return out
        a, b = (t0, t1) if ok.all() else (t0[ok], t1[ok])
        t, v = self.t, self.v
        dt = np.diff(t).astype(np.float64)
        dv = np.abs(np.diff(v))
        gap = dt > gap_ns
        some_gap = bool(gap.any())  # the usual timeline has none: no pass for them
        whole = dv * dt / NS_PER_S * 0.5
        if some_gap:
            whole = np.where(gap, 0.0, whole)
        cum = np.concatenate(([0.0], np.cumsum(whole)))
        i0, f0 = _segment(t, a, "right", self._memo)
        i1, f1 = _segment(t, b, "left", self._memo)
        ns = float(NS_PER_S)

        def part(i: IndexArray, length: npt.NDArray[np.int64], full: BoolArray) -> FloatArray:
            return np.asarray(dv[i] * length.astype(np.float64) / ns * np.where(full, 0.5, 1.0))

        same = i0 == i1
        res = np.empty(a.shape)
        res[same] = part(i0[same], b[same] - a[same], (f0[same] == 0) & (f1[same] == 1))
        d = ~same
        if d.any():
            j0, j1 = i0[d], i1[d]
            head = part(j0, t[j0 + 1] - a[d], f0[d] == 0)
            tail = part(j1, b[d] - t[j1], f1[d] == 1)
            res[d] = head + (cum[j1] - cum[j0 + 1]) + tail
        if some_gap:
            gaps = np.concatenate(([0], np.cumsum(gap)))
            res[gaps[i1 + 1] - gaps[i0] > 0] = np.inf
        res[b == a] = 0.0
        out[ok] = res
        return out


def _range_reduce(ufunc: np.ufunc, v: FloatArray, lo: IndexArray, hi: IndexArray) -> FloatArray:
    """ufunc.reduce(v[lo[k]:hi[k]]) for every k, with lo < hi (ranges may overlap)."""
    idx = np.empty(2 * lo.size, dtype=np.intp)
    idx[0::2], idx[1::2] = lo, hi
    padded = np.append(v, v[-1:])  # so that hi == v.size is a valid reduceat index
    return np.asarray(ufunc.reduceat(padded, idx)[0::2], dtype=np.float64)


def _one_value(a: npt.NDArray[Any]) -> bool:
    """Whether ``a`` is one value broadcast over the samples (a column the loader found all
    null, analysis/load.py): then a null test of its first element stands for every element,
    with no pass over the rows (~0.2 ms a rank-hour per column, ~25 such columns a rank)."""
    return a.ndim == 1 and a.size > 0 and a.strides[0] == 0


def null_broadcast(a: npt.NDArray[Any]) -> bool:
    """Whether ``a`` is one null (NaN, or a negative int: INT_NULL) broadcast over the samples: a
    column the loader found all null (analysis/load.py), known so without a pass over the rows."""
    return _one_value(a) and bool(np.isnan(a[0]) if a.dtype.kind == "f" else a[0] < 0)


def _int_timeline(t: IntArray, c: IntArray) -> tuple[IntArray, IntArray]:
    if _one_value(c):
        return (t, c) if c[0] >= 0 else (t[:0], c[:0])
    ok = c >= 0  # INT_NULL and any other negative value: every int metric is >= 0
    return (t, c) if ok.all() else (t[ok], c[ok])


def _delta(t: IntArray, c: IntArray, t0: IntArray, t1: IntArray, memo: Searches | None = None) -> FloatArray:
    """Delta of the piecewise-linear curve through (t, c) over [t0, t1]; NaN where not covered or
    where a segment overlapping the window decreases. t strictly increasing, c non-null int64;
    ``memo``: :func:`_segment`'s."""
    out = np.full(t0.shape, np.nan)
    if t.size < 2:
        return out
    ok = (t0 >= t[0]) & (t1 <= t[-1])
    if not ok.any():
        return out
    a, b = (t0, t1) if ok.all() else (t0[ok], t1[ok])
    d = np.diff(c)  # int64: exact whatever the counter's magnitude
    drops = np.concatenate(([0], np.cumsum(d < 0)))
    i0, f0 = _segment(t, a, "right", memo)
    i1, f1 = _segment(t, b, "left", memo)
    whole = (c[i1] - c[i0]).astype(np.float64)  # subtract in int64, then convert the (small) delta
    res = whole + d[i1].astype(np.float64) * f1 - d[i0].astype(np.float64) * f0
    broken = drops[i1 + 1] - drops[i0] > 0
    res[broken] = np.nan
    out[ok] = res
    return out


def _ticks(e: IntArray) -> IndexArray:
    """The energy counter's tick points: the indices of the samples whose value differs from the
    sample before. The first sample is not a tick (when its value was set is unknown), so each
    tick ``k`` has a read before it, ``k - 1``."""
    if e.size < 2:
        return np.empty(0, dtype=np.intp)
    return np.flatnonzero(e[1:] != e[:-1]) + 1


MIN_COUNTER_TICKS = 2
"""The counter is used for a window only when at least this many of its ticks lie inside, so
that at least one whole counter interval (20-100 ms on NVML) is measured by the hardware."""


def _held(
    t: IntArray, flags: BoolArray, t0: IntArray, t1: IntArray, memo: Searches | None = None
) -> FloatArray:
    """Seconds of [t0, t1] during which each flag was set, each sample's flag held until the next
    sample; exact in int64 ns. ``flags``: one flag per sample (shape (n,)) or several (shape
    (n, k)), giving an (m,) or (m, k) result for m windows. NaN where the samples do not bracket
    the window."""
    shape = t0.shape + flags.shape[1:]
    out = np.full(shape, np.nan)
    if t.size < 2:
        return out
    ok = (t0 >= t[0]) & (t1 <= t[-1])
    if not ok.any():
        return out
    dt = np.diff(t)
    if flags.ndim > 1:
        dt = dt[:, None]
    held_ns = np.zeros(flags.shape, dtype=np.int64)
    np.cumsum(np.where(flags[:-1], dt, 0), axis=0, out=held_ns[1:])

    def upto(x: IntArray) -> IntArray:
        i = _clip_index(_search(t, x, "right", memo) - 1, t.size - 2)
        into = x - t[i]
        if flags.ndim > 1:
            into = into[:, None]
        return held_ns[i] + np.where(flags[i], into, 0)

    a, b = (t0, t1) if ok.all() else (t0[ok], t1[ok])  # the same arrays: searched once (memo)
    out[ok] = (upto(b) - upto(a)).astype(np.float64) / NS_PER_S
    return out


# --------------------------------------------------------------------------------------------
# Public helpers (one metric, many windows)
# --------------------------------------------------------------------------------------------


def integrate_power(t_ns: Any, power_w: Any, t0_ns: Any, t1_ns: Any) -> FloatArray:
    """Energy in J over each window [t0_ns, t1_ns] from a power timeline.

    ``t_ns`` (int64 ns, strictly increasing) and ``power_w`` (W, NaN = null, skipped) are one
    device's samples; the curve is the straight line between consecutive non-null samples and is
    integrated exactly over the window, partial segments at both edges included. ``t0_ns`` and
    ``t1_ns`` are scalars or arrays of window edges (ns). NaN where the non-null samples do not
    bracket the window (no extrapolation). Returns a 1-D float64 array, one value per window.
    """
    t = _checked_times(t_ns)
    t0, t1 = np.atleast_1d(_as_int64(t0_ns)), np.atleast_1d(_as_int64(t1_ns))
    return _Series(t, _as_float64(power_w)).integral(t0, t1)


def counter_delta(t_ns: Any, values: Any, t0_ns: Any, t1_ns: Any) -> FloatArray:
    """Increase of a cumulative int counter (bytes, ns, mJ) over each window [t0_ns, t1_ns].

    The counter is the straight line between consecutive non-null samples (INT_NULL / negative =
    null, skipped). The whole-sample part of the delta is subtracted in int64, so a 64-bit counter
    near 2**63 gives an exact integer delta when both edges fall on samples; only the partial
    segments at the edges are interpolated, in float64, from int64 segment deltas. NaN where the
    samples do not bracket the window or where the counter decreases (reset or wrap) on a segment
    that overlaps it. Returns a 1-D float64 array in the counter's unit, exact below 2**53.
    """
    t = _checked_times(t_ns)
    t0, t1 = np.atleast_1d(_as_int64(t0_ns)), np.atleast_1d(_as_int64(t1_ns))
    tc, c = _int_timeline(t, _as_int64(values))
    return _delta(tc, c, t0, t1)


def held_time(t_ns: Any, flags: Any, t0_ns: Any, t1_ns: Any) -> FloatArray:
    """Seconds of each window [t0_ns, t1_ns] during which a per-sample flag was set.

    Sample-and-hold: a sample's flag holds from its time until the next sample's. Exact in int64
    ns before the conversion to seconds. NaN where the samples do not bracket the window.
    """
    t = _checked_times(t_ns)
    t0, t1 = np.atleast_1d(_as_int64(t0_ns)), np.atleast_1d(_as_int64(t1_ns))
    return _held(t, np.asarray(flags, dtype=bool), t0, t1)


GAP_PERIODS: Final = 2
"""A stretch between consecutive samples longer than this many sample periods is a sampling gap."""


def sample_period_ns(t: IntArray) -> float:
    """The sampling period of one device's sorted sample times: the median step (NaN with fewer
    than 2 samples). The median, not the mean: a stalled sampler's few long steps would inflate
    a mean and hide the very gaps it measures."""
    if t.size < 2:
        return float("nan")
    return float(np.median(np.diff(t)))


def _coverage(
    t: IntArray, t0: IntArray, t1: IntArray, period_ns: float, memo: Searches | None = None
) -> tuple[FloatArray, FloatArray]:
    """Per window [t0, t1): the share of its time covered by samples and its longest stretch
    without a sample (s), docs/attribution.md *Coverage*.

    A stretch is the time between two consecutive samples; one longer than GAP_PERIODS periods is
    uncovered. Before the first and after the last sample the stretch runs to the window's edge.
    With fewer than 2 samples (no period) nothing is covered."""
    m = t0.size
    dur = (t1 - t0).astype(np.float64)
    n = t.size
    gap_max = dur.copy()
    if n == 0 or not np.isfinite(period_ns):
        cov = np.zeros(m)
        if n:
            i0 = np.searchsorted(t, t0, side="right")
            i1 = np.searchsorted(t, t1, side="left")
            inside = i1 > i0
            gap_max[inside] = np.maximum(t[i0[inside]] - t0[inside], t1[inside] - t[i1[inside] - 1])
        return cov, gap_max / NS_PER_S
    limit = GAP_PERIODS * period_ns
    g = np.diff(t).astype(np.float64)
    ok = g <= limit
    csum = np.concatenate(([0.0], np.cumsum(g if ok.all() else np.where(ok, g, 0.0))))
    i0 = _search(t, t0, "right", memo)  # first sample after t0
    i1 = _search(t, t1, "left", memo)  # first sample at-or-after t1
    inside = i1 > i0
    covered = np.zeros(m)

    def stretch_ok(k: IndexArray, open_len: FloatArray) -> BoolArray:
        """Is the stretch that begins at sample k-1 and ends at sample k short enough (k == 0 or
        k == n: open, measured by open_len)?"""
        inner = (k > 0) & (k < n)
        res = open_len <= limit
        res[inner] = ok[k[inner] - 1]
        return res

    a, b = i0[inside], i1[inside] - 1  # first and last sample inside
    left = (t[a] - t0[inside]).astype(np.float64)
    right = (t1[inside] - t[b]).astype(np.float64)
    covered[inside] = (
        (csum[b] - csum[a])
        + np.where(stretch_ok(a, left), left, 0.0)
        + np.where(stretch_ok(b + 1, right), right, 0.0)
    )
    if inside.any():
        gaps_inner = np.zeros(a.size)
        many = b > a
        if many.any():
            gaps_inner[many] = _range_reduce(np.maximum, g, a[many], b[many])
        gap_max[inside] = np.maximum(np.maximum(left, right), gaps_inner)
    # No sample inside: the window lies in one stretch, from the sample before t0 (if any) to the
    # sample at-or-after t1 (if any); an open stretch is measured to the window's far edge.
    k = i0[~inside]
    s0, s1 = t0[~inside], t1[~inside]
    before = np.where(k > 0, s1 - t[np.maximum(k - 1, 0)], np.inf)
    after = np.where(k < n, t[np.minimum(k, n - 1)] - s0, np.inf)
    open_len = np.minimum(before, after).astype(np.float64)
    cov = np.zeros(m)
    cov[~inside] = stretch_ok(k, open_len)  # all or nothing (a zero-length window too)
    cov[inside] = np.clip(covered[inside] / dur[inside], 0.0, 1.0)  # dur > 0: a sample is inside
    return cov, gap_max / NS_PER_S
