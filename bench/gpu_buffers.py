"""GPU check, driver buffers (``nvmlDeviceGetSamples``): their rate, their cost, and how they
agree with the polled instant power (docs/gpu-check.md, part 2b).

Two measurements:

* :func:`drain_cost`: opens GPU 0 through the NVML backend, lets the buffers fill for
  ``wait_s``, then times ``read_buffered()`` (every buffer drained) ``drains`` times, each after
  ``wait_s``: the cost of one drain (us), the samples it returned, the buffers' capacity;
* :func:`agreement`: over the load test's run directory (driver buffers stored beside the
  polled samples, ``buffered-*.parquet``), per metric: samples, the driver's sample interval
  (median, ms) and rate (Hz), gaps (intervals over 1.5x the median: samples lost between two
  drains, or the driver pausing); per window (idle / load / idle): buffered mean and peak power
  against the polled mean and peak of ``power_instant_w``, and, for every polled sample, the
  buffered sample nearest in time (within one buffer interval): the median and 95th percentile
  of their absolute difference (W) and the median ratio.

Run from gpu_check.py (both modes); figures in stub mode describe the stand-in library.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def drain_cost(drains: int = 20, wait_s: float = 0.5) -> dict[str, Any]:
    """The cost of draining GPU 0's driver buffers, every ``wait_s`` (the store's flush)."""
    import numpy as np

    from charllm_nemo.devices.nvml import open_backend

    backend = open_backend([0])
    try:
        dev = backend.devices[0]
        if dev.buffers is None:
            return {"supported": False, "why": dev.identity.extra.get("driver_buffers", "no buffer answered")}
        cost_us, counts = [], []
        for _ in range(drains):
            time.sleep(wait_s)
            t0 = time.perf_counter_ns()
            batches = dev.read_buffered()
            cost_us.append((time.perf_counter_ns() - t0) / 1e3)
            counts.append(sum(len(ts) for _, ts, _ in batches))
        return {
            "supported": True,
            "metrics": list(dev.buffers.metrics),
            "capacity": dict(dev.buffers.capacity),
            "unsupported": dict(dev.buffers.unsupported),
            "wait_s": wait_s,
            "drain_us_median": float(np.median(cost_us)),
            "drain_us_max": float(np.max(cost_us)),
            "samples_per_drain_median": float(np.median(counts)),
            "us_per_sample": float(np.sum(cost_us) / max(1, np.sum(counts))),
            "health": dev.buffers.health.to_dict(),
        }
    finally:
        backend.close()


def agreement(run_dir: Path) -> dict[str, Any]:
    """Rate, gaps and agreement with the polled instant power, over a stored run."""
    import numpy as np

    from charllm_nemo.telemetry.buffered import load_buffered
    from charllm_nemo.telemetry.reader import load_rank, to_arrays

    table = load_buffered(run_dir, ranks=[0])
    if table.num_rows == 0:
        return {
            "stored": False,
            "why": "no buffered-*.parquet in the run (no driver buffer, or driver_buffers off)",
        }
    metric = np.asarray(table.column("metric").to_pylist(), dtype=object)
    t_all = table.column("t_mono_ns").to_numpy()
    wall_all = table.column("t_wall_ns").to_numpy()
    v_all = table.column("value").to_numpy()
    out: dict[str, Any] = {"stored": True, "metrics": {}}
    for name in sorted(set(metric)):
        sel = metric == name
        dt = np.diff(wall_all[sel])  # the driver's own stamps: no drain-offset jitter
        med = float(np.median(dt)) if dt.size else float("nan")
        out["metrics"][name] = {
            "samples": int(sel.sum()),
            "interval_ms_median": med / 1e6,
            "rate_hz": 1e9 / med if med > 0 else None,
            "interval_ms_max": float(dt.max() / 1e6) if dt.size else None,
            "gaps": int((dt > 1.5 * med).sum()) if dt.size else 0,
            "duplicates": int((dt <= 0).sum()),
        }
    rank = load_rank(run_dir, 0)
    s = to_arrays(rank.samples)
    w = to_arrays(rank.windows)
    p_sel = metric == "power_w"
    tb, pb = t_all[p_sel], v_all[p_sel]
    tp, pp = s["t_mono_ns"], s["power_instant_w"]
    interval_ns = out["metrics"].get("power_w", {}).get("interval_ms_median", float("nan")) * 1e6
    out["windows"] = {}
    for i, name in enumerate(w["name"]):
        t0, t1 = int(w["t_begin_mono_ns"][i]), int(w["t_end_mono_ns"][i])
        b = (tb >= t0) & (tb <= t1)
        p = (tp >= t0) & (tp <= t1) & np.isfinite(pp)
        entry: dict[str, Any] = {
            "buffered_samples": int(b.sum()),
            "polled_samples": int(p.sum()),
            "buffered_mean_w": float(pb[b].mean()) if b.any() else None,
            "polled_mean_w": float(pp[p].mean()) if p.any() else None,
            "buffered_peak_w": float(pb[b].max()) if b.any() else None,
            "polled_peak_w": float(pp[p].max()) if p.any() else None,
        }
        if b.any() and p.any() and tb.size:
            j = np.clip(np.searchsorted(tb, tp[p]), 1, tb.size - 1)
            nearest = np.where(np.abs(tb[j - 1] - tp[p]) <= np.abs(tb[j] - tp[p]), j - 1, j)
            close = np.abs(tb[nearest] - tp[p]) <= interval_ns
            diff = np.abs(pb[nearest][close] - pp[p][close])
            ratio = pb[nearest][close] / pp[p][close]
            entry.update(
                {
                    "pairs": int(close.sum()),
                    "abs_diff_w_median": float(np.median(diff)) if diff.size else None,
                    "abs_diff_w_p95": float(np.percentile(diff, 95)) if diff.size else None,
                    "ratio_median": float(np.median(ratio)) if ratio.size else None,
                }
            )
        out["windows"][str(name)] = entry
    return out


def summary_lines(cost: dict[str, Any], agree: dict[str, Any]) -> list[str]:
    """What gpu_check prints for this part."""
    lines = []
    if not cost.get("supported"):
        lines.append(f"driver buffers: not served by GPU 0 ({cost.get('why')})")
    else:
        lines.append(
            f"driver buffers: {', '.join(cost['metrics'])}; capacity {cost['capacity']}; a drain every "
            f"{cost['wait_s']:g} s costs {cost['drain_us_median']:.0f} us median "
            f"({cost['drain_us_max']:.0f} max) "
            f"for {cost['samples_per_drain_median']:.0f} samples ({cost['us_per_sample']:.2f} us/sample)"
        )
    for name, m in agree.get("metrics", {}).items():
        rate = f"{m['rate_hz']:.1f} Hz" if m["rate_hz"] else "?"
        lines.append(
            f"  {name:<13} {m['samples']:6d} samples, every {m['interval_ms_median']:.2f} ms ({rate}), "
            f"max interval {m['interval_ms_max']} ms, {m['gaps']} gap(s), {m['duplicates']} duplicate(s)"
        )
    for name, e in agree.get("windows", {}).items():
        lines.append(
            f"  {name:<12} buffered mean {_f(e['buffered_mean_w'])} W peak {_f(e['buffered_peak_w'])} W; "
            f"polled mean {_f(e['polled_mean_w'])} W peak {_f(e['polled_peak_w'])} W; nearest pairs "
            f"{e.get('pairs')}: |diff| median {_f(e.get('abs_diff_w_median'))} W, p95 "
            f"{_f(e.get('abs_diff_w_p95'))} W, ratio {_f(e.get('ratio_median'), 3)}"
        )
    if not agree.get("stored", False):
        lines.append(f"  not stored: {agree.get('why')}")
    return lines


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
