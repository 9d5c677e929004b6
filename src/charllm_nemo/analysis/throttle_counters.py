"""The driver's per-reason throttle counters beside the sampled reason bits, and how often each
bit turns on: columns of the ``ranks`` table (docs/analysis.md, *Throttle counters*).

* ``violation_<name>_counter_s``: the increase of ``violation_<name>_ns`` (the driver's own
  time counter) over the device's span, in s; a segment over which the counter went down (reset,
  driver reload, wrap) is left out.
* ``violation_<name>_sampled_s``: over the same segments (consecutive counter reads), the time
  any of the counter's reason bits (:data:`~charllm_nemo.telemetry.schema.VIOLATION_COUNTERS`)
  was set in the sampled ``throttle_reasons``, sample-and-hold; null for a counter no bit matches.
* ``violation_<name>_diff_s``: counter minus sampled. The sampled time misses what happens
  between two samples; the counter does not: a large positive difference is throttling shorter
  than the sampling period.
* ``throttle_<reason>_per_min``: 0 -> 1 changes of that bit between consecutive samples per
  minute of the span: a reason that thrashes on and off shows here while its share stays small.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from charllm_nemo.analysis.metrics import column
from charllm_nemo.telemetry.attribution import held_time
from charllm_nemo.telemetry.schema import INT_NULL, THROTTLE_BITS, THROTTLE_REASONS, VIOLATION_COUNTERS
from charllm_nemo.telemetry.timelines import null_broadcast

Array = np.ndarray[Any, Any]
NS_PER_S = 1e9


def transitions_per_min(t: Array, mask: Array) -> dict[str, float]:
    """``throttle_<reason>_per_min`` for every reason, over the non-null samples of ``mask``."""
    known = mask >= 0
    tk, mk = (t, mask) if known.all() else (t[known], mask[known])
    span_min = float(tk[-1] - tk[0]) / NS_PER_S / 60.0 if tk.size >= 2 else 0.0
    out = {}
    turned_on = mk[1:] & ~mk[:-1]  # the bits each sample set that the one before had clear
    turned_on = turned_on[turned_on != 0]  # one pass over the samples, not one per reason
    for name, bit in THROTTLE_REASONS:
        rises = int(np.count_nonzero(turned_on & bit))
        out[f"throttle_{name}_per_min"] = rises / span_min if span_min > 0 else float("nan")
    return out


def counter_vs_sampled(t: Array, mask: Array, counter: Array, bits: int | None) -> tuple[float, float]:
    """(counter time s, sampled-bit time s) over the segments between consecutive non-null
    counter reads on which the counter did not go down; NaN where there is nothing to measure."""
    if null_broadcast(counter):  # an all-null column as loaded: no pass over it
        return float("nan"), float("nan")
    ok = counter >= 0
    tc, c = t[ok], counter[ok]
    if tc.size < 2:
        return float("nan"), float("nan")
    d = np.diff(c)
    keep = d >= 0
    counter_s = float(d[keep].sum()) / NS_PER_S
    known = mask >= 0
    if bits is None or np.count_nonzero(known) < 2 or not keep.any():
        return counter_s, float("nan")
    held = held_time(t[known], (mask[known] & bits) != 0, tc[:-1][keep], tc[1:][keep])
    covered = ~np.isnan(held)
    return counter_s, float(held[covered].sum()) if covered.any() else float("nan")


def throttle_counter_figures(t: Array, s: dict[str, Array]) -> dict[str, float]:
    """Every column this module adds to one device's ``ranks`` row (``t``: the device's sorted
    sample times, ``s``: its sample columns, ints with INT_NULL for null)."""
    mask = column(s, "throttle_reasons", INT_NULL, t.size)
    out = transitions_per_min(t, mask)
    for name, reasons in VIOLATION_COUNTERS:
        counter = column(s, f"violation_{name}_ns", INT_NULL, t.size)
        bits = int(np.bitwise_or.reduce([THROTTLE_BITS[r] for r in reasons])) if reasons else None
        counter_s, sampled_s = counter_vs_sampled(t, mask, counter, bits)
        out[f"violation_{name}_counter_s"] = counter_s
        out[f"violation_{name}_sampled_s"] = sampled_s
        out[f"violation_{name}_diff_s"] = counter_s - sampled_s
    return out
