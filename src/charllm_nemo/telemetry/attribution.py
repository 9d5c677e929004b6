"""Attribution: join one device's samples with the training loop's windows into per-window figures.

Everything here is a plain function over numpy arrays (no pandas, no pyarrow). The input is one
device's samples, a mapping column -> 1-D array with ``t_mono_ns`` (int64, CLOCK_MONOTONIC ns) and
any of :data:`~charllm_nemo.telemetry.schema.METRICS` (floats with NaN for null, ints with
:data:`~charllm_nemo.telemetry.schema.INT_NULL` for null), and the windows' begin and end times.
The output is one array per column of :data:`ATTRIBUTION_COLUMNS`, one value per window, in the
windows' order; joining them back to the other window columns is the caller's job.

The rules, in short (docs/attribution.md says them in full):

* Every metric is read on its own timeline: the samples where it is not null. A metric that is
  null throughout gives NaN, never a made-up number, and does not affect the other metrics.
* Figures need the metric's samples to bracket the window (a sample at-or-before the begin and
  one at-or-after the end): there is no extrapolation. Between samples a metric is the straight
  line through its neighbours (a throttle bitmask is held until the next sample instead).
* Energy comes from the hardware energy counter where it ticked inside the window, else from the
  trapezoid over instant power, else over the vendor-averaged power; ``energy_method`` says which.
* Counters (energy, traffic, violation time) are subtracted in int64 before any interpolation,
  and a decrease (reset, wrap) makes the window's delta NaN rather than negative.

Cost: one ``np.searchsorted`` per window edge per metric over prefix sums, so O(log n) per
window for the integrals; peaks and minima cost the number of samples inside each window.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

from charllm_nemo.telemetry.schema import INT_NULL, LIMITING_REASONS, THROTTLE_BITS, THROTTLE_REASONS

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
IndexArray = npt.NDArray[np.intp]
WindowsLike = Mapping[str, Any] | Sequence[Any] | np.ndarray[Any, Any]
"""Windows: a mapping with t_begin_mono_ns / t_end_mono_ns arrays, or (t_begin, t_end) pairs."""

NS_PER_S: Final = 1_000_000_000
MJ_PER_J: Final = 1000

EnergyMethod = Literal["counter", "power_trapezoid", "power_avg_trapezoid", "none", "invalid"]
ENERGY_METHODS: tuple[str, ...] = ("counter", "power_trapezoid", "power_avg_trapezoid", "none", "invalid")
_METHOD_DTYPE: Final = "<U19"

_LIMITING_BITS: Final = int(np.bitwise_or.reduce([THROTTLE_BITS[name] for name in LIMITING_REASONS]))

_TRAFFIC_COUNTERS: tuple[str, ...] = ("pcie_tx_bytes", "pcie_rx_bytes", "nvlink_tx_bytes", "nvlink_rx_bytes")

ATTRIBUTION_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("duration_s", "s", "t_end - t_begin; NaN for an invalid (open or reversed) window"),
    ("n_samples", "count", "samples with t_begin <= t_mono_ns < t_end"),
    ("coverage", "fraction", "(last - first sample inside) / duration; 0 with fewer than 2 inside"),
    ("interpolated", "bool", "fewer than 2 samples inside: the figures come from the neighbours"),
    ("sample_gap_max_s", "s", "largest gap between consecutive samples whose interval meets the window"),
    ("energy_j", "J", "energy over the window, by energy_method"),
    ("energy_method", "-", "counter | power_trapezoid | power_avg_trapezoid | none | invalid"),
    ("power_avg_w", "W", "energy_j / duration_s (mean power consistent with energy_j)"),
    ("power_timeline_avg_w", "W", "time-weighted mean of the power timeline (instant, else averaged)"),
    ("power_peak_w", "W", "max instant power over samples inside (edge values if none inside)"),
    ("temp_gpu_peak_c", "degC", "max GPU temperature over samples inside (edge values if none)"),
    ("temp_hbm_peak_c", "degC", "max HBM temperature over samples inside (edge values if none)"),
    ("temp_hotspot_peak_c", "degC", "max hotspot temperature over samples inside (edge values if none)"),
    ("clock_sm_min_mhz", "MHz", "min SM clock over samples inside (edge values if none)"),
    ("clock_sm_avg_mhz", "MHz", "time-weighted mean SM clock"),
    *(
        (f"throttle_{name}_s", "s", f"time the '{name}' throttle bit was set (sample-and-hold)")
        for name, _ in THROTTLE_REASONS
    ),
    ("throttle_any_limiting_s", "s", "time any of LIMITING_REASONS was set (sample-and-hold)"),
    ("violation_power_s", "s", "delta of violation_power_ns over the window"),
    ("violation_thermal_s", "s", "delta of violation_thermal_ns over the window"),
    *((name, "B", f"delta of the {name} counter over the window") for name in _TRAFFIC_COUNTERS),
)
"""Every output column of :func:`attribute_windows`: (name, unit, meaning), in output order."""

ATTRIBUTION_COLUMN_NAMES: tuple[str, ...] = tuple(c[0] for c in ATTRIBUTION_COLUMNS)

_ENERGY_FIGURES: Final = ("energy_j", "energy_method", "power_avg_w", "power_timeline_avg_w")


def _reads(figure: str) -> tuple[str, ...]:
    """The sample metrics one attribution column is computed from (none: time alone)."""
    if figure in _ENERGY_FIGURES:
        return ("power_instant_w", "power_avg_w", "energy_mj")
    if figure == "power_peak_w":
        return ("power_instant_w",)
    if figure.startswith("temp_"):
        return (figure.removesuffix("_peak_c") + "_c",)
    if figure.startswith("clock_sm_"):
        return ("clock_sm_mhz",)
    if figure.startswith("throttle_"):
        return ("throttle_reasons",)
    if figure.startswith("violation_"):
        return (figure.removesuffix("_s") + "_ns",)
    if figure in _TRAFFIC_COUNTERS:
        return (figure,)
    return ()


_READS: Final = {name: _reads(name) for name in ATTRIBUTION_COLUMN_NAMES}


def check_figures(figures: Collection[str] | None) -> set[str]:
    """The attribution columns named (None: all of them); unknown names raise ValueError."""
    wanted = set(ATTRIBUTION_COLUMN_NAMES) if figures is None else set(figures)
    unknown = wanted - set(ATTRIBUTION_COLUMN_NAMES)
    if unknown:
        raise ValueError(f"unknown attribution figure(s) {sorted(unknown)}; see ATTRIBUTION_COLUMN_NAMES")
    return wanted


def sample_columns(figures: Collection[str] | None = None) -> tuple[str, ...]:
    """The sample columns (``t_mono_ns`` and the metrics) that :func:`attribute_windows` reads for
    ``figures`` (None: every column). A caller holding many metrics can pass only these: a
    metric left out counts as null, which changes none of these figures (a test checks it
    column by column). Unknown names raise ValueError."""
    wanted = check_figures(figures)
    metrics = {m for name in wanted for m in _READS[name]}
    return ("t_mono_ns", *sorted(metrics))


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


def prepare_samples(samples: Mapping[str, Any]) -> tuple[dict[str, np.ndarray[Any, Any]], dict[str, int]]:
    """Sort one device's samples by ``t_mono_ns`` and drop the ones that cannot be placed in time.

    Samples can arrive out of order (a clock stepping back, segments concatenated out of order).
    They are sorted stably by time; of samples with exactly the same ``t_mono_ns`` the first in
    input order is kept (a repeated timestamp is a repeated sample, and a timeline needs strictly
    increasing time); samples whose time is null (INT_NULL) are dropped.

    Returns the reordered columns (every column, not only metrics; unchanged arrays when the input
    was already strictly increasing) and diagnostics, all counts of samples:
    ``n_input``, ``n_output``, ``n_backward_steps`` (places where time went backwards in the
    input), ``n_reordered`` (samples not at their input position after sorting),
    ``n_duplicates_dropped`` and ``n_null_time_dropped``.

    Raises ValueError when ``t_mono_ns`` is missing or a column's length differs from it.
    """
    if "t_mono_ns" not in samples:
        raise ValueError("samples have no 't_mono_ns' column; attribution joins samples to windows by it")
    t = _as_int64(samples["t_mono_ns"])
    if t.ndim != 1:
        raise ValueError(f"samples['t_mono_ns'] must be 1-D, got shape {t.shape}")
    n = int(t.size)
    cols: dict[str, np.ndarray[Any, Any]] = {}
    for name, col in samples.items():
        a = t if name == "t_mono_ns" else np.asarray(col)
        if a.shape != (n,):
            raise ValueError(
                f"samples[{name!r}] has shape {a.shape}; every column must have t_mono_ns's shape ({n},)"
            )
        cols[name] = a
    diag = {
        "n_input": n,
        "n_output": n,
        "n_backward_steps": 0,
        "n_reordered": 0,
        "n_duplicates_dropped": 0,
        "n_null_time_dropped": 0,
    }
    null_t = t == INT_NULL
    steps = np.diff(t)
    if not null_t.any() and bool(np.all(steps > 0)):
        return cols, diag
    diag["n_backward_steps"] = int(np.count_nonzero(steps < 0))
    order = np.argsort(t, kind="stable")
    diag["n_reordered"] = int(np.count_nonzero(order != np.arange(n)))
    ts = t[order]
    keep = ts != INT_NULL
    diag["n_null_time_dropped"] = int(n - np.count_nonzero(keep))
    dup = np.zeros(n, dtype=bool)
    dup[1:] = ts[1:] == ts[:-1]
    dup &= keep
    diag["n_duplicates_dropped"] = int(np.count_nonzero(dup))
    idx = order[keep & ~dup]
    diag["n_output"] = int(idx.size)
    return {name: a[idx] for name, a in cols.items()}, diag


def _window_times(windows: WindowsLike) -> tuple[IntArray, IntArray]:
    if isinstance(windows, Mapping):
        try:
            t0, t1 = _as_int64(windows["t_begin_mono_ns"]), _as_int64(windows["t_end_mono_ns"])
        except KeyError as e:
            raise ValueError(
                f"windows need 't_begin_mono_ns' and 't_end_mono_ns' columns; missing {e}"
            ) from None
    else:
        pairs = list(windows)
        if not pairs:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        arr = np.array([[INT_NULL if v is None else v for v in p] for p in pairs], dtype=object)
        if arr.ndim != 2 or arr.shape[1] != 2:
            raise ValueError("windows given as a sequence must be (t_begin_mono_ns, t_end_mono_ns) pairs")
        t0, t1 = _as_int64(arr[:, 0]), _as_int64(arr[:, 1])
    t0, t1 = t0.ravel(), t1.ravel()
    if t0.shape != t1.shape:
        raise ValueError(f"t_begin_mono_ns has {t0.size} windows but t_end_mono_ns has {t1.size}")
    return t0, t1


# --------------------------------------------------------------------------------------------
# Timelines: one metric's non-null samples
# --------------------------------------------------------------------------------------------


def _segment(t: IntArray, x: IntArray, side: Literal["left", "right"]) -> tuple[IndexArray, FloatArray]:
    """Segment index i (t[i] .. t[i+1]) holding each x, and the fraction of the way along it.

    ``side="right"`` puts an x equal to a sample at the start of that sample's segment (f = 0);
    ``side="left"`` at the end of the previous one (f = 1). Either gives the same value; the choice
    keeps a window's begin and end on the segments that overlap it. Needs t.size >= 2.
    """
    i = np.searchsorted(t, x, side=side).astype(np.intp) - 1
    _clip_index(i, t.size - 2)
    f = (x - t[i]).astype(np.float64) / (t[i + 1] - t[i]).astype(np.float64)
    return i, f


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


class _Series:
    """A float metric's non-null samples: a piecewise-linear curve through (t, v)."""

    def __init__(self, t: IntArray, v: FloatArray) -> None:
        ok = ~np.isnan(v)
        self.t: IntArray = t if ok.all() else t[ok]
        self.v: FloatArray = v if ok.all() else v[ok]
        self._cum: FloatArray | None = None

    def covers(self, t0: IntArray, t1: IntArray) -> BoolArray:
        """Windows the samples bracket: a sample at-or-before t0 and one at-or-after t1."""
        if self.t.size < 2:
            return np.zeros(t0.shape, dtype=bool)
        inside: BoolArray = (t0 >= self.t[0]) & (t1 <= self.t[-1])
        return inside

    def value_at(self, x: IntArray, side: Literal["left", "right"] = "right") -> FloatArray:
        i, f = _segment(self.t, x, side)
        return self.v[i] + (self.v[i + 1] - self.v[i]) * f

    def _antiderivative(self, x: IntArray, side: Literal["left", "right"]) -> FloatArray:
        t, v = self.t, self.v
        if self._cum is None:
            dt_s = np.diff(t).astype(np.float64) / NS_PER_S
            self._cum = np.concatenate(([0.0], np.cumsum(dt_s * (v[:-1] + v[1:]) * 0.5)))
        i, f = _segment(t, x, side)
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
        a, b = t0[ok], t1[ok]
        t, v = self.t, self.v
        self._antiderivative(a[:1], "right")  # builds the prefix sums once
        assert self._cum is not None
        i0, f0 = _segment(t, a, "right")
        i1, f1 = _segment(t, b, "left")
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

    def extreme(self, ufunc: np.ufunc, t0: IntArray, t1: IntArray) -> FloatArray:
        """ufunc (np.maximum / np.minimum) of the curve over [t0, t1]: the samples with
        t0 <= t < t1 and the two interpolated edge values. The curve's mean over the window
        (:meth:`mean`) therefore always lies between its minimum and its maximum: both come from
        the same piecewise-linear curve. NaN where not covered."""
        out = np.full(t0.shape, np.nan)
        ok = self.covers(t0, t1)
        if not ok.any():
            return out
        a, b = t0[ok], t1[ok]
        lo = np.searchsorted(self.t, a, side="left")
        hi = np.searchsorted(self.t, b, side="left")
        res = ufunc(self.value_at(a, "right"), self.value_at(b, "left"))
        inside = hi > lo
        if inside.any():
            res[inside] = ufunc(res[inside], _range_reduce(ufunc, self.v, lo[inside], hi[inside]))
        out[ok] = res
        return out


def _range_reduce(ufunc: np.ufunc, v: FloatArray, lo: IndexArray, hi: IndexArray) -> FloatArray:
    """ufunc.reduce(v[lo[k]:hi[k]]) for every k, with lo < hi (ranges may overlap)."""
    idx = np.empty(2 * lo.size, dtype=np.intp)
    idx[0::2], idx[1::2] = lo, hi
    padded = np.append(v, v[-1:])  # so that hi == v.size is a valid reduceat index
    return np.asarray(ufunc.reduceat(padded, idx)[0::2], dtype=np.float64)


def _int_timeline(t: IntArray, c: IntArray) -> tuple[IntArray, IntArray]:
    ok = c >= 0  # INT_NULL and any other negative value: every int metric is >= 0
    return (t, c) if ok.all() else (t[ok], c[ok])


def _delta(t: IntArray, c: IntArray, t0: IntArray, t1: IntArray) -> FloatArray:
    """Delta of the piecewise-linear curve through (t, c) over [t0, t1]; NaN where not covered or
    where a segment overlapping the window decreases. t strictly increasing, c non-null int64."""
    out = np.full(t0.shape, np.nan)
    if t.size < 2:
        return out
    ok = (t0 >= t[0]) & (t1 <= t[-1])
    if not ok.any():
        return out
    a, b = t0[ok], t1[ok]
    d = np.diff(c)  # int64: exact whatever the counter's magnitude
    drops = np.concatenate(([0], np.cumsum(d < 0)))
    i0, f0 = _segment(t, a, "right")
    i1, f1 = _segment(t, b, "left")
    whole = (c[i1] - c[i0]).astype(np.float64)  # subtract in int64, then convert the (small) delta
    res = whole + d[i1].astype(np.float64) * f1 - d[i0].astype(np.float64) * f0
    broken = drops[i1 + 1] - drops[i0] > 0
    res[broken] = np.nan
    out[ok] = res
    return out


def _ticks(t: IntArray, e: IntArray) -> tuple[IntArray, IntArray]:
    """The energy counter's tick points: the samples whose value differs from the sample before.
    The first sample is not a tick: when its value was set is unknown."""
    if t.size < 2:
        return t[:0], e[:0]
    changed = np.concatenate(([False], e[1:] != e[:-1]))
    return t[changed], e[changed]


MIN_COUNTER_TICKS = 2
"""The counter is used for a window only when at least this many of its ticks lie inside, so
that at least one whole counter interval (20-100 ms on NVML) is measured by the hardware."""


def _counter_energy(
    t: IntArray, e_mj: IntArray, t0: IntArray, t1: IntArray, min_ticks: int = 2, edges: _Series | None = None
) -> FloatArray:
    """Energy (J) from the counter. With ``edges`` (a power timeline): the counter's exact delta
    between the first and the last tick inside the window, plus the power timeline's integral
    from the window's begin to the first tick and from the last tick to its end; this needs no
    tick outside the window, so a live figure equals the one computed later. Where the edges
    cannot be integrated (no power timeline): the line through the ticks, interpolated at both
    ends, which needs a tick at or before the begin and one at or after the end. NaN where
    fewer than ``min_ticks`` ticks lie inside or the counter decreases (reset) across them."""
    tt, te = _ticks(*_int_timeline(t, e_mj))
    out = np.full(t0.shape, np.nan)
    if tt.size < 2:
        return out
    lo = np.searchsorted(tt, t0, side="left")
    hi = np.searchsorted(tt, t1, side="right")  # ticks inside: tt[lo:hi]
    use = (hi - lo) >= max(2, min_ticks)
    if not use.any():
        return out
    first, last = lo[use], hi[use] - 1
    drops = np.concatenate(([0], np.cumsum(np.diff(te) < 0)))
    inner = (te[last] - te[first]).astype(np.float64) / MJ_PER_J  # int64 first, then float
    inner[drops[last] - drops[first] > 0] = np.nan
    res = np.full(first.shape, np.nan)
    if edges is not None:
        # The two edges (begin -> first tick, last tick -> end) in one call.
        k = first.size
        both = edges.integral(np.concatenate((t0[use], tt[last])), np.concatenate((tt[first], t1[use])))
        res = inner + both[:k] + both[k:]
    missing = np.isnan(res) & ~np.isnan(inner)
    if missing.any():
        idx = np.flatnonzero(use)[missing]
        res[missing] = _delta(tt, te, t0[idx], t1[idx]) / MJ_PER_J
    out[use] = res
    return out


def _counted_mean_power(
    t: IntArray, e_mj: IntArray, t0: IntArray, t1: IntArray, min_ticks: int
) -> FloatArray:
    """Mean power (W) over the part of each window the energy counter measures (its first to
    its last tick inside), for the windows whose energy the counter gives (at least
    ``min_ticks`` ticks inside, no decrease across them); NaN elsewhere. Over the whole counted
    part, not per counter interval: a tick is stamped up to one sampling period late, so a single
    interval's mean can be off by that period over the interval (10 ms in 100 ms: 10 %), the
    whole part's only once."""
    tt, te = _ticks(*_int_timeline(t, e_mj))
    out = np.full(t0.shape, np.nan)
    if tt.size < 2:
        return out
    lo = np.searchsorted(tt, t0, side="left")
    hi = np.searchsorted(tt, t1, side="right")
    use = (hi - lo) >= max(2, min_ticks)
    if not use.any():
        return out
    first, last = lo[use], hi[use] - 1
    # mJ per ns is 1e6 W; int64 differences first, exact whatever the counter's magnitude.
    mean_w = (te[last] - te[first]).astype(np.float64) / (tt[last] - tt[first]).astype(np.float64) * 1e6
    drops = np.concatenate(([0], np.cumsum(np.diff(te) < 0)))
    mean_w[drops[last] - drops[first] > 0] = np.nan
    out[use] = mean_w
    return out


def _held(t: IntArray, flags: BoolArray, t0: IntArray, t1: IntArray) -> FloatArray:
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
        i = _clip_index(np.searchsorted(t, x, side="right") - 1, t.size - 2)
        into = x - t[i]
        if flags.ndim > 1:
            into = into[:, None]
        return held_ns[i] + np.where(flags[i], into, 0)

    k = int(np.count_nonzero(ok))
    held = upto(np.concatenate((t1[ok], t0[ok])))  # both edges in one pass
    out[ok] = (held[:k] - held[k:]).astype(np.float64) / NS_PER_S
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
    return _counter_energy(t, _as_int64(energy_mj), t0, t1, min_ticks, edges)


def held_time(t_ns: Any, flags: Any, t0_ns: Any, t1_ns: Any) -> FloatArray:
    """Seconds of each window [t0_ns, t1_ns] during which a per-sample flag was set.

    Sample-and-hold: a sample's flag holds from its time until the next sample's. Exact in int64
    ns before the conversion to seconds. NaN where the samples do not bracket the window.
    """
    t = _checked_times(t_ns)
    t0, t1 = np.atleast_1d(_as_int64(t0_ns)), np.atleast_1d(_as_int64(t1_ns))
    return _held(t, np.asarray(flags, dtype=bool), t0, t1)


# --------------------------------------------------------------------------------------------
# The main entry
# --------------------------------------------------------------------------------------------


def attribute_windows(
    samples: Mapping[str, Any],
    windows: WindowsLike,
    *,
    min_counter_ticks: int = MIN_COUNTER_TICKS,
    figures: Collection[str] | None = None,
) -> dict[str, np.ndarray[Any, Any]]:
    """Per-window figures for one device: every column of :data:`ATTRIBUTION_COLUMNS`, or only
    those named in ``figures`` (the groups nobody asked for are not computed: a training loop
    that wants five figures per step pays for five; unknown names raise ValueError).

    ``samples``: column -> 1-D array, ``t_mono_ns`` (int64 ns) and any schema metrics (floats NaN
    = null, ints INT_NULL = null); missing metrics are all-null. They need not be sorted: they go
    through :func:`prepare_samples` (call it yourself for its diagnostics). ``windows``: a mapping
    with ``t_begin_mono_ns`` and ``t_end_mono_ns`` (int64 ns; INT_NULL or None = open), or a
    sequence of ``(t_begin, t_end)`` pairs. Returns one array per column, one value per window in
    the windows' order: float64 (NaN = not measurable), int64 ``n_samples``, bool
    ``interpolated``, str ``energy_method``. An open or reversed window (t_end < t_begin) has NaN
    figures and ``energy_method == "invalid"``. ``min_counter_ticks``: energy comes from the
    hardware counter only for windows holding at least that many counter ticks (see
    :data:`MIN_COUNTER_TICKS`); shorter ones use the instant-power timeline.
    """
    wanted = check_figures(figures)

    def want(*names: str) -> bool:
        return not wanted.isdisjoint(names)

    cols, _ = prepare_samples(samples)
    t: IntArray = cols["t_mono_ns"]
    w0, w1 = _window_times(windows)
    m = w0.size
    valid = (w0 != INT_NULL) & (w1 != INT_NULL) & (w1 >= w0)
    # Invalid windows are computed as empty windows at 0 and masked at the end.
    t0 = np.where(valid, w0, 0)
    t1 = np.where(valid, w1, 0)
    dur_s = (t1 - t0).astype(np.float64) / NS_PER_S
    out: dict[str, np.ndarray[Any, Any]] = {"duration_s": np.where(valid, dur_s, np.nan)}

    def floats(name: str) -> _Series:
        return _Series(t, _as_float64(cols[name]) if name in cols else np.full(t.size, np.nan))

    def ints(name: str) -> tuple[IntArray, IntArray]:
        c = _as_int64(cols[name]) if name in cols else np.full(t.size, INT_NULL, dtype=np.int64)
        return _int_timeline(t, c)

    if want("n_samples", "coverage", "interpolated", "sample_gap_max_s"):
        # Coverage, over all samples whatever their metrics hold.
        lo = np.searchsorted(t, t0, side="left")
        hi = np.searchsorted(t, t1, side="left")
        n_in = (hi - lo).astype(np.int64)
        coverage = np.zeros(m)
        many = n_in >= 2
        if many.any():
            spanned = (t[hi[many] - 1] - t[lo[many]]).astype(np.float64) / NS_PER_S
            coverage[many] = spanned / dur_s[many]
        gap_max = np.full(m, np.nan)
        if t.size >= 2:
            glo = np.maximum(np.searchsorted(t, t0, side="right") - 1, 0)
            ghi = np.minimum(hi, t.size - 1)
            touch = ghi > glo
            if touch.any():
                gaps = np.diff(t).astype(np.float64) / NS_PER_S
                gap_max[touch] = _range_reduce(np.maximum, gaps, glo[touch], ghi[touch])
        bracketed = (t.size >= 2) & (t0 >= (t[0] if t.size else 0)) & (t1 <= (t[-1] if t.size else 0))
        out["n_samples"] = np.where(valid, n_in, 0)
        out["coverage"] = np.where(valid, coverage, np.nan)
        out["interpolated"] = valid & bracketed & (n_in < 2)
        out["sample_gap_max_s"] = np.where(valid, gap_max, np.nan)

    instant = floats("power_instant_w")
    if want(*_ENERGY_FIGURES):
        # Energy: counter, else instant power, else vendor-averaged power. Each fallback is
        # computed only when a window is left without energy by the ones before it.
        averaged = floats("power_avg_w")
        edge_power = instant if instant.t.size >= 2 else (averaged if averaged.t.size >= 2 else None)
        energy = _counter_energy(*ints("energy_mj"), t0, t1, min_counter_ticks, edge_power)
        method = np.full(m, "none", dtype=_METHOD_DTYPE)
        method[~np.isnan(energy)] = "counter"
        for series, name in ((instant, "power_trapezoid"), (averaged, "power_avg_trapezoid")):
            left = np.isnan(energy)
            if not left.any():
                break
            fallback = series.integral(t0, t1)
            use = left & ~np.isnan(fallback)
            energy[use] = fallback[use]
            method[use] = name
        method[~valid] = "invalid"
        out["energy_j"] = energy
        out["energy_method"] = method
        timeline = instant if instant.t.size >= 2 else averaged
        power_avg = np.full(m, np.nan)
        pos = dur_s > 0
        power_avg[pos] = energy[pos] / dur_s[pos]
        zero = ~pos & ~np.isnan(energy)  # zero-length window: the power at that instant
        if want("power_timeline_avg_w") or zero.any():
            timeline_avg = timeline.mean(t0, t1)
            power_avg[zero] = timeline_avg[zero]
            out["power_timeline_avg_w"] = timeline_avg
        out["power_avg_w"] = power_avg
    if want("power_peak_w"):
        # The peak is taken over the same evidence as the mean power: the instant-power curve
        # (edges included) and, where the counter measures part of the window, the counter's
        # mean power over that part (the true power reached that mean at some instant). The
        # window's mean is a time-weighted mix of the two, so power_avg_w <= power_peak_w
        # whichever energy method applied.
        peak = instant.extreme(np.maximum, t0, t1)
        counted = _counted_mean_power(*ints("energy_mj"), t0, t1, min_counter_ticks)
        has = ~np.isnan(peak) & ~np.isnan(counted)
        peak[has] = np.maximum(peak[has], counted[has])
        out["power_peak_w"] = peak

    for name in ("temp_gpu", "temp_hbm", "temp_hotspot"):
        if want(f"{name}_peak_c"):
            out[f"{name}_peak_c"] = floats(f"{name}_c").extreme(np.maximum, t0, t1)
    if want("clock_sm_min_mhz", "clock_sm_avg_mhz"):
        clock = floats("clock_sm_mhz")
        out["clock_sm_min_mhz"] = clock.extreme(np.minimum, t0, t1)
        out["clock_sm_avg_mhz"] = clock.mean(t0, t1)

    if want(*(f"throttle_{name}_s" for name, _ in THROTTLE_REASONS), "throttle_any_limiting_s"):
        # Every reason wanted, and "any limiting", in one pass: one column per bit set.
        names = [name for name, _ in THROTTLE_REASONS if want(f"throttle_{name}_s")]
        bits = np.array([THROTTLE_BITS[name] for name in names] + [_LIMITING_BITS], dtype=np.int64)
        tm, mask = ints("throttle_reasons")
        held = _held(tm, (mask[:, None] & bits[None, :]) != 0, t0, t1)
        for j, name in enumerate(names):
            out[f"throttle_{name}_s"] = held[:, j]
        out["throttle_any_limiting_s"] = held[:, -1]

    if want("violation_power_s"):
        out["violation_power_s"] = _delta(*ints("violation_power_ns"), t0, t1) / NS_PER_S
    if want("violation_thermal_s"):
        out["violation_thermal_s"] = _delta(*ints("violation_thermal_ns"), t0, t1) / NS_PER_S
    for name in _TRAFFIC_COUNTERS:
        if want(name):
            out[name] = _delta(*ints(name), t0, t1)

    invalid = ~valid
    if invalid.any():
        for name, a in out.items():
            if a.dtype == np.float64 and name != "duration_s":
                a[invalid] = np.nan
    return {name: out[name] for name in ATTRIBUTION_COLUMN_NAMES if name in wanted}
