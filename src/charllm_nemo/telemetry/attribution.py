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

This module holds the columns, the samples' preparation and :func:`attribute_windows`, which
applies the rules per window; the maths over one metric's timeline (integrals, counter deltas,
counter energy, held time) is in telemetry/timelines.py, whose public helpers are re-exported
here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Final, Literal

import numpy as np

from charllm_nemo.telemetry.counter_energy import (
    counter_energy_bounded,
    counter_envelope,
    energy_from_counter,
)
from charllm_nemo.telemetry.schema import (
    INT_NULL,
    LIMITING_REASONS,
    THROTTLE_BITS,
    THROTTLE_REASONS,
    VIOLATION_COUNTERS,
)
from charllm_nemo.telemetry.timelines import (
    GAP_PERIODS,
    MIN_COUNTER_TICKS,
    MJ_PER_J,
    NS_PER_S,
    IntArray,
    Searches,
    _as_float64,
    _as_int64,
    _coverage,
    _delta,
    _held,
    _int_timeline,
    _Series,
    counter_delta,
    held_time,
    inside,
    integrate_power,
    sample_period_ns,
)

__all__ = [
    "ATTRIBUTION_COLUMNS",
    "ATTRIBUTION_COLUMN_NAMES",
    "ENERGY_METHODS",
    "MIN_COUNTER_TICKS",
    "MJ_PER_J",
    "NS_PER_S",
    "WindowsLike",
    "attribute_windows",
    "check_figures",
    "counter_delta",
    "energy_from_counter",
    "held_time",
    "integrate_power",
    "prepare_samples",
    "sample_columns",
]

WindowsLike = Mapping[str, Any] | Sequence[Any] | np.ndarray[Any, Any]
"""Windows: a mapping with t_begin_mono_ns / t_end_mono_ns arrays, or (t_begin, t_end) pairs."""

EnergyMethod = Literal["counter", "power_trapezoid", "power_avg_trapezoid", "none", "invalid"]
ENERGY_METHODS: tuple[str, ...] = ("counter", "power_trapezoid", "power_avg_trapezoid", "none", "invalid")
_METHOD_DTYPE: Final = "<U19"

_LIMITING_BITS: Final = int(np.bitwise_or.reduce([THROTTLE_BITS[name] for name in LIMITING_REASONS]))

_TRAFFIC_COUNTERS: tuple[str, ...] = ("pcie_tx_bytes", "pcie_rx_bytes", "nvlink_tx_bytes", "nvlink_rx_bytes")

ATTRIBUTION_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("duration_s", "s", "t_end - t_begin; NaN for an invalid (open or reversed) window"),
    ("n_samples", "count", "samples with t_begin <= t_mono_ns < t_end"),
    ("coverage", "fraction", "share of the window's time in stretches between samples <= 2 periods"),
    ("interpolated", "bool", "fewer than 2 samples inside: the figures come from the neighbours"),
    ("gap_max_s", "s", "longest interval inside the window without a sample (edges included)"),
    ("energy_j", "J", "energy over the window, by energy_method"),
    ("energy_method", "-", "counter | power_trapezoid | power_avg_trapezoid | none | invalid"),
    (
        "energy_bound_j",
        "J",
        "bound on |energy_j - true energy| (docs/attribution.md, Energy bounds); NaN: no bound",
    ),
    ("power_avg_w", "W", "energy_j / duration_s (mean power consistent with energy_j)"),
    ("power_timeline_avg_w", "W", "time-weighted mean of the power timeline (instant, else averaged)"),
    ("power_peak_w", "W", "highest instant power sampled inside; NaN when no sample is inside"),
    ("power_swing_w", "W", "highest minus lowest instant power sampled inside; NaN when fewer than 2"),
    ("power_ramp_up_w_s", "W/s", "steepest rise between two consecutive samples inside; NaN: < 2 samples"),
    ("power_ramp_down_w_s", "W/s", "steepest fall between two consecutive samples inside; NaN: < 2"),
    ("temp_gpu_peak_c", "degC", "highest GPU temperature sampled inside; NaN when none"),
    ("temp_hbm_peak_c", "degC", "highest HBM temperature sampled inside; NaN when none"),
    ("temp_hotspot_peak_c", "degC", "highest hotspot temperature sampled inside; NaN when none"),
    ("clock_sm_min_mhz", "MHz", "lowest SM clock sampled inside; NaN when none"),
    ("clock_sm_avg_mhz", "MHz", "time-weighted mean SM clock"),
    *(
        (f"throttle_{name}_s", "s", f"time the '{name}' throttle bit was set (sample-and-hold)")
        for name, _ in THROTTLE_REASONS
    ),
    ("throttle_any_limiting_s", "s", "time any of LIMITING_REASONS was set (sample-and-hold)"),
    *(
        (f"violation_{name}_s", "s", f"delta of violation_{name}_ns (the driver's counter) over the window")
        for name, _ in VIOLATION_COUNTERS
    ),
    *((name, "B", f"delta of the {name} counter over the window") for name in _TRAFFIC_COUNTERS),
)
"""Every output column of :func:`attribute_windows`: (name, unit, meaning), in output order."""

ATTRIBUTION_COLUMN_NAMES: tuple[str, ...] = tuple(c[0] for c in ATTRIBUTION_COLUMNS)

_ENERGY_FIGURES: Final = (
    "energy_j",
    "energy_method",
    "energy_bound_j",
    "power_avg_w",
    "power_timeline_avg_w",
)


def _reads(figure: str) -> tuple[str, ...]:
    """The sample metrics one attribution column is computed from (none: time alone)."""
    if figure in _ENERGY_FIGURES:
        return ("power_instant_w", "power_avg_w", "energy_mj")
    if figure in ("power_peak_w", "power_swing_w", "power_ramp_up_w_s", "power_ramp_down_w_s"):
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
# The main entry
# --------------------------------------------------------------------------------------------


def attribute_windows(
    samples: Mapping[str, Any],
    windows: WindowsLike,
    *,
    min_counter_ticks: int = MIN_COUNTER_TICKS,
    figures: Collection[str] | None = None,
    sample_period_s: float | None = None,
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
    ``sample_period_s``: the sampling period that ``coverage`` judges gaps by (a stretch longer
    than 2 periods is uncovered); None: the median step of these samples.
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

    memo: Searches = {}  # each search of these windows' edges in the same times, done once
    periods: dict[int, tuple[IntArray, float]] = {}  # the sampling period of each timeline, once

    def period_of(times: IntArray) -> float:
        if id(times) not in periods:
            periods[id(times)] = (times, sample_period_ns(times))  # the array held: its id not reused
        return periods[id(times)][1]

    def floats(name: str) -> _Series:
        return _Series(t, _as_float64(cols[name]) if name in cols else np.full(t.size, np.nan), memo)

    def ints(name: str) -> tuple[IntArray, IntArray]:
        c = _as_int64(cols[name]) if name in cols else np.full(t.size, INT_NULL, dtype=np.int64)
        return _int_timeline(t, c)

    if want("n_samples", "coverage", "interpolated", "gap_max_s"):
        # Coverage, over all samples whatever their metrics hold.
        lo, hi = inside(t, t0, t1, memo)
        n_in = (hi - lo).astype(np.int64)
        period = period_of(t) if sample_period_s is None else sample_period_s * NS_PER_S
        coverage, gap_max = _coverage(t, t0, t1, period, memo)
        bracketed = (t.size >= 2) & (t0 >= (t[0] if t.size else 0)) & (t1 <= (t[-1] if t.size else 0))
        out["n_samples"] = np.where(valid, n_in, 0)
        out["coverage"] = np.where(valid, coverage, np.nan)
        out["interpolated"] = valid & bracketed & (n_in < 2)
        out["gap_max_s"] = np.where(valid, gap_max, np.nan)

    instant = floats("power_instant_w")
    if want(*_ENERGY_FIGURES):
        # Energy: counter, else instant power, else vendor-averaged power. Each fallback is
        # computed only when a window is left without energy by the ones before it.
        averaged = floats("power_avg_w")
        edge_power = instant if instant.t.size >= 2 else (averaged if averaged.t.size >= 2 else None)
        # A stretch of the power timeline longer than GAP_PERIODS of its own periods is a gap:
        # the power there is unknown, so an energy integrated across it has no bound.
        gap_ns = GAP_PERIODS * period_of(edge_power.t) if edge_power is not None else np.inf
        energy, bound = counter_energy_bounded(
            *ints("energy_mj"), t0, t1, min_counter_ticks, edge_power, gap_ns, memo
        )
        if edge_power is not instant:
            bound[:] = np.nan  # edges from a 1 s vendor average: it lags the power, no bound
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
            if name == "power_trapezoid" and use.any():
                # The vendor's 1 s average lags the power by up to its window: no bound for it.
                period = GAP_PERIODS * period_of(instant.t)
                b = instant.trapezoid_bound(t0[use], t1[use], period)
                bound[use] = np.where(np.isposinf(b), np.nan, b)
        if instant.t.size >= 2:
            # Whatever the method, the counter brackets the truth between 0 and its envelope
            # (docs/attribution.md, Energy bounds): the tighter of the two bounds holds.
            env = counter_envelope(*ints("energy_mj"), t0, t1, instant, memo)
            by_env = np.fmax(energy, env - energy)
            bound = np.where(np.isnan(env) | np.isnan(energy), bound, np.fmin(bound, by_env))
        method[~valid] = "invalid"
        out["energy_j"] = energy
        out["energy_method"] = method
        out["energy_bound_j"] = bound
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
    if want("power_peak_w", "power_swing_w"):
        # The highest power a sample showed inside the window, nothing else: an interpolated
        # edge or the counter's mean is not a value the device reported (docs/attribution.md).
        # The mean power (energy / duration) can therefore exceed it: the counter sees power
        # between samples, and the edges of a window are interpolated.
        out["power_peak_w"] = instant.sampled_extreme(np.maximum, t0, t1)
    if want("power_swing_w"):
        # Both ends sampled values; one sample inside swings by nothing it showed: NaN.
        swing = out["power_peak_w"] - instant.sampled_extreme(np.minimum, t0, t1)
        lo, hi = inside(instant.t, t0, t1, memo)
        n_in = hi - lo
        out["power_swing_w"] = np.where(n_in >= 2, swing, np.nan)
    if want("power_ramp_up_w_s", "power_ramp_down_w_s"):
        out["power_ramp_up_w_s"], out["power_ramp_down_w_s"] = instant.sampled_ramps(t0, t1)

    for name in ("temp_gpu", "temp_hbm", "temp_hotspot"):
        if want(f"{name}_peak_c"):
            out[f"{name}_peak_c"] = floats(f"{name}_c").sampled_extreme(np.maximum, t0, t1)
    if want("clock_sm_min_mhz", "clock_sm_avg_mhz"):
        clock = floats("clock_sm_mhz")
        out["clock_sm_min_mhz"] = clock.sampled_extreme(np.minimum, t0, t1)
        out["clock_sm_avg_mhz"] = clock.mean(t0, t1)

    if want(*(f"throttle_{name}_s" for name, _ in THROTTLE_REASONS), "throttle_any_limiting_s"):
        # Every reason wanted, and "any limiting": one 1-D pass per bit some sample set (a
        # (samples x bits) pass measured 4x slower per bit: a broadcast AND and a strided
        # cumulative sum, ~7 ms a rank-hour for two bits against ~3.5 ms one at a time).
        names = [name for name, _ in THROTTLE_REASONS if want(f"throttle_{name}_s")]
        bits = [THROTTLE_BITS[name] for name in names] + [_LIMITING_BITS]
        tm, mask = ints("throttle_reasons")
        # A bit no sample set is held for no time: 0 where the samples bracket the window, NaN
        # where they do not, as _held gives for a flag never set, without its passes (a run
        # sets one or two of the twelve).
        seen = int(np.bitwise_or.reduce(mask)) if mask.size else 0
        bracketed = (t0 >= tm[0]) & (t1 <= tm[-1]) if tm.size >= 2 else np.zeros(m, dtype=bool)
        never = np.where(bracketed, 0.0, np.nan)
        held = [_held(tm, (mask & bit) != 0, t0, t1, memo) if bit & seen else never.copy() for bit in bits]
        for name, column in zip(names, held, strict=False):
            out[f"throttle_{name}_s"] = column
        out["throttle_any_limiting_s"] = held[-1]

    for name, _ in VIOLATION_COUNTERS:
        if want(f"violation_{name}_s"):
            out[f"violation_{name}_s"] = _delta(*ints(f"violation_{name}_ns"), t0, t1, memo) / NS_PER_S
    for name in _TRAFFIC_COUNTERS:
        if want(name):
            out[name] = _delta(*ints(name), t0, t1, memo)

    invalid = ~valid
    if invalid.any():
        for name, a in out.items():
            if a.dtype == np.float64 and name != "duration_s":
                a[invalid] = np.nan
    return {name: out[name] for name in ATTRIBUTION_COLUMN_NAMES if name in wanted}
