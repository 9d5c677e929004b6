"""GPU check, the driver's own throttle counters against the sampled reason bits
(docs/gpu-check.md, part 2c).

Over the load test's run directory (every counter read with every sample there), per counter of
``schema.VIOLATION_COUNTERS``: whether the driver serves it and from which NVML source, its
increase over the run (s), the time its reason bits were seen set in the sampled
``throttle_reasons`` over the same segments (sample-and-hold), their difference, and the age of
the counter's value when it was read (the sample's wall clock minus the driver's own timestamp of
the value: median and max, ms). Per reason bit: the share of the run it was set and its 0 -> 1
transitions per minute. Also the device's power-smoothing / workload-profile state as the
manifest recorded it. The same columns as the ``ranks`` table (analysis/throttle_counters.py).
And whether the device serves the module power scope (NVML_POWER_SCOPE_MODULE: a Grace module's
GPU + CPU + memory; an H100 / H200 does not): :func:`module_power`.

Run from gpu_check.py (both modes); figures in stub mode describe the stand-in library, whose
counters do not move.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def counter_check(run_dir: Path) -> dict[str, Any]:
    """The comparison over one rank-0 run directory (device 0)."""
    import numpy as np

    from charllm_nemo.analysis.rank_tables import throttle_shares
    from charllm_nemo.analysis.throttle_counters import throttle_counter_figures
    from charllm_nemo.telemetry.attribution import prepare_samples
    from charllm_nemo.telemetry.reader import load_rank, to_arrays
    from charllm_nemo.telemetry.schema import INT_NULL, THROTTLE_REASONS, VIOLATION_COUNTERS

    rank = load_rank(run_dir, 0)
    s, _ = prepare_samples(to_arrays(rank.samples))
    t = s["t_mono_ns"]
    devices = rank.manifest.get("devices") or [{}]
    extra = devices[0].get("extra", {})
    sources = extra.get("metric_sources", {})
    row = throttle_counter_figures(t, s)
    mask = s.get("throttle_reasons", np.full(t.size, INT_NULL, np.int64))
    known = mask >= 0
    shares = throttle_shares(t[known], mask[known])
    wall_us = s["t_wall_ns"] // 1000 if "t_wall_ns" in s else None
    counters: dict[str, Any] = {}
    for name, reasons in VIOLATION_COUNTERS:
        values = s.get(f"violation_{name}_ns", np.full(t.size, INT_NULL, np.int64))
        stamps = s.get(f"violation_{name}_ts_us", np.full(t.size, INT_NULL, np.int64))
        entry: dict[str, Any] = {
            "supported": bool((values >= 0).any()),
            "source": sources.get(f"violation_{name}_ns"),
            "reasons": list(reasons),
            **{part: row[f"violation_{name}_{part}_s"] for part in ("counter", "sampled", "diff")},
        }
        ok = stamps >= 0
        if wall_us is not None and ok.any():
            age_ms = (wall_us[ok] - stamps[ok]) / 1000.0
            entry["value_age_ms_median"] = float(np.median(age_ms))
            entry["value_age_ms_max"] = float(np.max(age_ms))
        counters[name] = entry
    bits = {
        name: {"share": float(shares[j]), "per_min": row[f"throttle_{name}_per_min"]}
        for j, (name, _) in enumerate(THROTTLE_REASONS)
    }
    return {
        "samples": int(t.size),
        "span_s": float((t[-1] - t[0]) / 1e9) if t.size >= 2 else None,
        "counters": counters,
        "bits": bits,
        "power_state": extra.get("power_state"),
        "module_power": module_power(extra, s),
    }


def module_power(extra: dict[str, Any], s: dict[str, Any]) -> dict[str, Any]:
    """Whether the device serves the module power scope (the manifest's ``power_scopes``, and
    the samples), from which source, and its median beside the GPU's own instant power (W)."""
    import numpy as np

    scopes = extra.get("power_scopes") or {}

    def median(column: str) -> float | None:
        x = np.asarray(s.get(column, []), dtype=np.float64)
        x = x[np.isfinite(x)]
        return float(np.median(x)) if x.size else None

    module_w = median("power_module_w")
    return {
        "supported": scopes.get("power_module_w") == "module" and module_w is not None,
        "source": (extra.get("metric_sources") or {}).get("power_module_w"),
        "power_scopes": scopes,
        "module_w_median": module_w,
        "gpu_w_median": median("power_instant_w"),
    }


def summary_lines(result: dict[str, Any]) -> list[str]:
    """What gpu_check.py prints: one line per counter, the bits that were ever set, the state."""

    def f(x: Any) -> str:
        return "null" if x is None or x != x else f"{x:.4f}"

    lines = [f"throttle counters vs sampled bits over the load run ({result['samples']} samples):"]
    for name, c in result["counters"].items():
        if not c["supported"]:
            lines.append(f"  {name:<18} not served by this driver")
            continue
        age = c.get("value_age_ms_median")
        lines.append(
            f"  {name:<18} counter {f(c['counter'])} s  sampled {f(c['sampled'])} s  diff {f(c['diff'])} s"
            f"  (bits {'+'.join(c['reasons']) or '-'}; value age {f(age)} ms; {c['source']})"
        )
    seen = {n: b for n, b in result["bits"].items() if b["share"] and b["share"] > 0}
    shown = [f"{n} {100 * b['share']:.1f} % ({b['per_min']:.1f}/min)" for n, b in seen.items()]
    lines.append("  bits set: " + (", ".join(shown) or "none"))
    lines.append(f"  power state: {result['power_state']}")
    m = result["module_power"]
    lines.append(
        f"  module power scope (NVML_POWER_SCOPE_MODULE, Grace modules): supported, median "
        f"{f(m['module_w_median'])} W beside the GPU's {f(m['gpu_w_median'])} W ({m['source']})"
        if m["supported"]
        else "  module power scope (NVML_POWER_SCOPE_MODULE, Grace modules): not supported on this device"
    )
    return lines


def main(argv: list[str]) -> int:
    """``python bench/gpu_counters.py RUN_DIR [OUT.json]``: the comparison over a run directory."""
    import json

    result = counter_check(Path(argv[0]))
    for line in summary_lines(result):
        print(line, flush=True)
    if len(argv) > 1:
        Path(argv[1]).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    import sys

    REPO = Path(__file__).resolve().parent.parent
    if str(REPO / "src") not in sys.path:
        sys.path.insert(0, str(REPO / "src"))
    sys.exit(main(sys.argv[1:]))
