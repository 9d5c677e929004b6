"""The energy counter's figure for a window and the bound on its error (docs/attribution.md,
*Energy bounds*), over one device's timeline (telemetry/timelines.py's conventions: int64 ns,
strictly increasing; INT_NULL / NaN for null).

* :func:`counter_energy_bounded`: the counter's delta between the first and the last tick inside
  a window plus the power timeline over the two edges, and its bound: the ticks' timing (one
  counter read interval at the larger end), 1 mJ of resolution, the edges' trapezoid bound (a
  sampling gap there bounded by the counter's tick interval instead);
* :func:`counter_envelope`: an upper bound on any window's true energy from the counter alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from charllm_nemo.telemetry.timelines import (
    MIN_COUNTER_TICKS,
    MJ_PER_J,
    NS_PER_S,
    FloatArray,
    IndexArray,
    IntArray,
    Searches,
    _as_float64,
    _as_int64,
    _checked_times,
    _clip_index,
    _delta,
    _int_timeline,
    _Series,
    _ticks,
)

__all__ = ["counter_energy_bounded", "counter_envelope", "energy_from_counter"]


def counter_energy_bounded(
    t: IntArray,
    e_mj: IntArray,
    t0: IntArray,
    t1: IntArray,
    min_ticks: int = 2,
    edges: _Series | None = None,
    gap_ns: float = np.inf,
    memo: Searches | None = None,
) -> tuple[FloatArray, FloatArray]:
    """Energy (J) from the counter, and a bound on its error (J). With ``edges`` (a power
    timeline): the counter's exact delta between the first and the last tick inside the window,
    plus the power timeline's integral from the window's begin to the first tick and from the
    last tick to its end; this needs no tick outside the window, so a live figure equals the one
    computed later. Where the edges cannot be integrated (no power timeline): the line through
    the ticks, interpolated at both ends, which needs a tick at or before the begin and one at or
    after the end. NaN where fewer than ``min_ticks`` ticks lie inside or the counter decreases
    (reset) across them.

    The bound (docs/attribution.md, *Energy bounds*): a tick is seen at the first read after the
    counter moved, so the value it shows was published up to one read interval ``g`` before
    (never more than the counter's update period, and the reads are what is known): the delta
    between two ticks misses up to ``g x p`` at its start and counts up to ``g x p`` too much at
    its end, errors of opposite sign, so ``max`` of the two plus 1 mJ of resolution; plus the
    edges' trapezoid bound (:meth:`_Series.trapezoid_bound`, ``gap_ns``: a longer stretch
    without a power sample is unbounded). ``p`` is the highest power sampled at the two reads
    around the tick (the counter's mean over the window where no power is sampled). Without a
    power timeline each edge may hold anything from 0 to its whole tick interval's delta.
    ``memo``: an attribution call's (:func:`.timelines.inside`), which also keeps the ticks for
    :func:`counter_envelope`."""
    tc, ec = _int_timeline(t, e_mj)
    ticks = _tick_points(ec, memo)
    tt, te = tc[ticks], ec[ticks]
    out = np.full(t0.shape, np.nan)
    bound = np.full(t0.shape, np.nan)
    if tt.size < 2:
        return out, bound
    lo = np.searchsorted(tt, t0, side="left")
    hi = np.searchsorted(tt, t1, side="right")  # ticks inside: tt[lo:hi]
    use = (hi - lo) >= max(2, min_ticks)
    if not use.any():
        return out, bound
    first, last = lo[use], hi[use] - 1
    drops = np.concatenate(([0], np.cumsum(np.diff(te) < 0)))
    inner = (te[last] - te[first]).astype(np.float64) / MJ_PER_J  # int64 first, then float
    inner[drops[last] - drops[first] > 0] = np.nan
    # Timing of each tick: the read before it (in the counter's own non-null reads).
    prev_t = tc[ticks - 1]
    g_f = (tt[first] - prev_t[first]).astype(np.float64) / NS_PER_S
    g_l = (tt[last] - prev_t[last]).astype(np.float64) / NS_PER_S
    span_s = (tt[last] - tt[first]).astype(np.float64) / NS_PER_S
    counted_w: FloatArray = np.divide(inner, span_s, out=np.full(inner.shape, np.nan), where=span_s > 0)

    def power_near(k: IndexArray, sel: Any = slice(None)) -> FloatArray:
        return _power_near(edges, tc, k, counted_w[sel])

    head_timing = g_f * power_near(ticks[first])
    timing = np.fmax(head_timing, g_l * power_near(ticks[last]))
    res = np.full(first.shape, np.nan)
    res_bound = np.full(first.shape, np.nan)
    if edges is not None:
        # The two edges (begin -> first tick, last tick -> end) in one call.
        k = first.size
        e0 = np.concatenate((t0[use], tt[last]))
        e1 = np.concatenate((tt[first], t1[use]))
        both = edges.integral(e0, e1)
        res = inner + both[:k] + both[k:]
        eb = edges.trapezoid_bound(e0, e1, gap_ns)
        if np.isposinf(eb).any():
            _cap_unbounded(eb, both, tc, ec, ticks, te, t0[use], first, last, head_timing, power_near)
        res_bound = timing + 1.0 / MJ_PER_J + eb[:k] + eb[k:]
    missing = np.isnan(res) & ~np.isnan(inner)
    if missing.any():
        idx = np.flatnonzero(use)[missing]
        res[missing] = _delta(tt, te, t0[idx], t1[idx]) / MJ_PER_J
        # Each edge lies inside one tick interval; its energy is anywhere in [0, that delta].
        j0 = _clip_index(np.searchsorted(tt, t0[idx], side="right") - 1, tt.size - 2)
        j1 = _clip_index(np.searchsorted(tt, t1[idx], side="left") - 1, tt.size - 2)
        d = np.diff(te).astype(np.float64) / MJ_PER_J
        res_bound[missing] = timing[missing] + 1.0 / MJ_PER_J + np.abs(d[j0]) + np.abs(d[j1])
    res_bound[np.isnan(res)] = np.nan
    res_bound[np.isposinf(res_bound)] = np.nan
    out[use] = res
    bound[use] = res_bound
    return out, bound


def _cap_unbounded(
    eb: FloatArray,
    both: FloatArray,
    tc: IntArray,
    ec: IntArray,
    ticks: IndexArray,
    te: IntArray,
    t0: IntArray,
    first: IntArray,
    last: IntArray,
    head_timing: FloatArray,
    power_near: Callable[[IndexArray, Any], FloatArray],
) -> None:
    """Bound, in place in ``eb`` (head edges then tail edges), the edges the power timeline
    cannot bound (+inf: a sampling gap in it) by the counter: an edge's energy lies in [0, cap],
    so the estimate ``both`` is off by at most max(estimate, cap - estimate). Head: E(t0 -> first
    tick) <= the first tick's value less the read at or before t0 (published no later), plus
    that tick's timing; tail: E(last tick -> t1) <= the next tick's delta plus its timing. Only
    called when some edge is unbounded (a run without sampling gaps has none)."""
    k = first.size
    tt, prev_t = tc[ticks], tc[ticks - 1]
    caps = np.full(2 * k, np.nan)
    ia = np.searchsorted(tc, t0, side="right") - 1
    ok = ia >= 0
    caps[:k][ok] = (te[first][ok] - ec[ia[ok]]).astype(np.float64) / MJ_PER_J + head_timing[ok]
    nxt = last + 1
    ok = nxt < tt.size
    if ok.any():
        n = nxt[ok]
        g_n = (tt[n] - prev_t[n]).astype(np.float64) / NS_PER_S
        caps[k:][ok] = (te[n] - te[last[ok]]).astype(np.float64) / MJ_PER_J + g_n * power_near(ticks[n], ok)
    unbounded = np.isposinf(eb) & ~np.isnan(caps)
    eb[unbounded] = np.fmax(both[unbounded], caps[unbounded] - both[unbounded])


def _power_near(
    edges: _Series | None, tc: IntArray, k: IndexArray, fallback: FloatArray | float
) -> FloatArray:
    """The higher power sampled at the counter's reads ``tc[k - 1]`` and ``tc[k]`` (the reads
    around the ticks ``k``), at least ``fallback`` (the counter's own mean); ``fallback`` alone
    without a power timeline. When the power and the counter share their samples (no nulls in
    either, the usual case) the reads are the power's own samples: no search (four of a rank-hour's
    windows, ~0.3 ms each)."""
    if edges is None or edges.t.size < 2:
        return np.broadcast_to(np.asarray(fallback, dtype=np.float64), k.shape).copy()
    if edges.t is tc:
        pa, pb = edges.value_at_sample(k - 1), edges.value_at_sample(k)
    else:
        pa = edges.value_at(np.clip(tc[k - 1], edges.t[0], edges.t[-1]))
        pb = edges.value_at(np.clip(tc[k], edges.t[0], edges.t[-1]))
    return np.asarray(np.fmax(np.fmax(pa, pb), fallback))


def _tick_points(ec: IntArray, memo: Searches | None) -> IndexArray:
    """:func:`.timelines._ticks`, once per counter timeline with ``memo`` (the counter energy
    and the envelope of one attribution call read the same ticks)."""
    key = ("ticks", id(ec))
    hit = memo.get(key) if memo is not None else None
    if hit is None:
        hit = (ec, _ticks(ec))  # the array held: its id not reused
        if memo is not None:
            memo[key] = hit
    ticks: IndexArray = hit[1]
    return ticks


def counter_envelope(
    t: IntArray,
    e_mj: IntArray,
    t0: IntArray,
    t1: IntArray,
    edges: _Series | None,
    memo: Searches | None = None,
) -> FloatArray:
    """An upper bound (J) on the true energy over each [t0, t1] from the counter alone: the first
    tick after ``t1`` (plus its timing: one read interval at the power sampled around it) less
    the value read at or before ``t0`` (published no later than that read). NaN where there is
    no such read or tick, no power to time the tick with, or the counter goes down between."""
    out = np.full(t0.shape, np.nan)
    tc, ec = _int_timeline(t, e_mj)
    ticks = _tick_points(ec, memo)
    tt, te = tc[ticks], ec[ticks]
    if tt.size == 0 or edges is None:
        return out
    ia = np.searchsorted(tc, t0, side="right") - 1
    jn = np.searchsorted(tt, t1, side="right")
    ok = (ia >= 0) & (jn < tt.size)
    if not ok.any():
        return out
    a, n = ia[ok], jn[ok]
    k = ticks[n]  # the tick's own read
    drops = np.concatenate(([0], np.cumsum(np.diff(ec) < 0)))
    prev = tc[k - 1]
    g = (tt[n] - prev).astype(np.float64) / NS_PER_S
    cap = (te[n] - ec[a]).astype(np.float64) / MJ_PER_J + g * _power_near(edges, tc, k, np.nan)
    cap[drops[k] - drops[a] > 0] = np.nan
    out[ok] = cap
    return out


def energy_from_counter(
    t_ns: Any, energy_mj: Any, t0_ns: Any, t1_ns: Any, power_w: Any = None, min_ticks: int = MIN_COUNTER_TICKS
) -> FloatArray:
    """Energy in J over each window from the hardware energy counter (mJ), NaN where not usable.

    Tick points are the samples where the counter's value changes. A window needs at least
    ``min_ticks`` ticks inside (t0 <= t_tick <= t1) and no decrease (reset, wrap) across them.
    With ``power_w`` (a power timeline on the same samples) the energy is the counter's exact
    delta between the first and last tick inside plus the power's integral over the two edges;
    without it, the straight line through consecutive ticks interpolated at t0 and t1 (which
    needs a tick at-or-before t0 and one at-or-after t1). Elsewhere NaN, and
    :func:`attribute_windows` falls back to the power timeline.
    """
    t = _checked_times(t_ns)
    t0, t1 = np.atleast_1d(_as_int64(t0_ns)), np.atleast_1d(_as_int64(t1_ns))
    edges = None if power_w is None else _Series(t, _as_float64(power_w))
    return counter_energy_bounded(t, _as_int64(energy_mj), t0, t1, min_ticks, edges)[0]
