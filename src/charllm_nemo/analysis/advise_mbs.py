"""Micro batch size advice: over runs that differ only in ``micro_batch_size`` (a sweep), the
highest throughput, and among those within ``tolerance`` of it the one with the fewest power
excursions above the limit and the least throttling; given only when the gain over the slowest
size clears the measured noise, run to run and step to step (docs/advisor.md)."""

from __future__ import annotations

import math
from statistics import median
from typing import Any

import numpy as np

from charllm_nemo.analysis.advise import MBS_TOLERANCE, MIN_GAIN, Advice, NoAdvice
from charllm_nemo.analysis.compare_stats import hierarchical_difference, repeats_needed, segment_spread
from charllm_nemo.telemetry.figures import finite_or_none as _f

MBS_GROUP = ("sweep", "model", "layout", "global_batch_size", "seq_length", "world_size")
"""Runs equal in these (and differing in micro_batch_size) are compared for the micro batch size."""


def mbs_advice(
    rows: dict[str, list[dict[str, Any]]], min_gain: float = MIN_GAIN, tolerance: float = MBS_TOLERANCE
) -> list[Advice | NoAdvice]:
    """Micro batch size advice per group of runs that differ only in it (``runs`` rows with a
    throughput), judged with the ``excursions`` and ``throttle_slowdown`` rows."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows.get("runs", []):
        if _f(r.get("samples_per_s")) and isinstance(r.get("micro_batch_size"), int):
            groups.setdefault(tuple(r.get(k) for k in MBS_GROUP), []).append(r)
    exc = {r["run"]: r for r in rows.get("excursions", [])}
    thr: dict[str, list[float]] = {}
    for r in rows.get("throttle_slowdown", []):
        s = _f(r.get("throttle_any_limiting_share"))
        if s is not None:
            thr.setdefault(r["run"], []).append(s)
    out: list[Advice | NoAdvice] = []
    if not groups:
        return [NoAdvice("micro_batch_size", "-", "no run has a measured throughput and a micro batch size")]
    for key, runs in groups.items():
        label = " ".join(f"{k}={v}" for k, v in zip(MBS_GROUP, key, strict=True) if v is not None)
        sizes = sorted({r["micro_batch_size"] for r in runs})
        if len(sizes) < 2:
            out.append(
                NoAdvice(
                    "micro_batch_size",
                    label,
                    (
                        f"one micro batch size measured ({sizes[0]}): compare sizes with a sweep, e.g. "
                        "charllm train -m batch.micro_batch_size=1,2,4 ... (or +sweep=cpu_microbatch)"
                    ),
                )
            )
            continue
        by_size: dict[int, list[dict[str, Any]]] = {}
        for r in runs:
            by_size.setdefault(r["micro_batch_size"], []).append(r)
        # several runs of one size: the run at their median throughput stands for the size (the
        # fastest of them would pick the run that met a quiet minute)
        best = {
            m: sorted(rs, key=lambda r: r["samples_per_s"])[(len(rs) - 1) // 2] for m, rs in by_size.items()
        }
        top = max(r["samples_per_s"] for r in best.values())

        def risk(r: dict[str, Any]) -> tuple[float, float, float]:
            e = exc.get(r["run"], {})
            return (
                _f(e.get("time_above_limit_share")) or 0.0,
                _f(e.get("peak_to_avg_p95")) or 0.0,
                max(thr.get(r["run"], [0.0])),
            )

        near = [r for r in best.values() if r["samples_per_s"] >= top * (1 - tolerance)]
        pick = min(near, key=lambda r: (*risk(r), -r["samples_per_s"]))
        worst = min(best.values(), key=lambda r: r["samples_per_s"])
        evidence = []
        for mbs in sorted(best):
            r = best[mbs]
            a, p, t = risk(r)
            evidence.append(
                f"micro batch {mbs} ({r['run']}): {r['samples_per_s']:.3g} samples/s "
                f"({(r['samples_per_s'] / top - 1) * 100:+.1f}% vs the best), power at/above the limit "
                f"{a * 100:.1f}% of microbatch time, peak/avg p95 {p:.2f}, "
                f"throttled {t * 100:.0f}% of step time"
            )
        if len(near) > 1:
            evidence.append(
                f"sizes within {tolerance * 100:.0f}% of the best throughput: "
                f"{sorted(r['micro_batch_size'] for r in near)}; the one with the fewest "
                "excursions and least throttling is proposed"
            )
        gain = pick["samples_per_s"] / worst["samples_per_s"] - 1
        noise = _noise(
            rows,
            by_size[worst["micro_batch_size"]],
            by_size[pick["micro_batch_size"]],
            worst["micro_batch_size"],
            pick["micro_batch_size"],
        )
        if gain >= min_gain and noise is not None:
            out.append(NoAdvice("micro_batch_size", label, noise + " | " + " | ".join(evidence)))
            continue
        if gain < min_gain:
            out.append(
                NoAdvice(
                    "micro_batch_size",
                    label,
                    (
                        f"micro batch sizes {sorted(best)} are within {gain * 100:.1f}% in throughput "
                        f"(< {min_gain * 100:.0f}%): any will do. " + " | ".join(evidence)
                    ),
                )
            )
            continue
        out.append(
            Advice(
                kind="micro_batch_size",
                run=pick["run"],
                current=sorted(best),
                proposed=pick["micro_batch_size"],
                expected_gain=gain,
                evidence=[
                    *evidence,
                    f"gain is against micro batch {worst['micro_batch_size']}, past the noise: "
                    + _interval_text(
                        rows, by_size[worst["micro_batch_size"]], by_size[pick["micro_batch_size"]]
                    ),
                ],
                overrides=[f"batch.micro_batch_size={pick['micro_batch_size']}"],
            )
        )
    return out


def _step_rates(rows: dict[str, list[dict[str, Any]]], runs: list[dict[str, Any]]) -> list[np.ndarray]:
    """Each run's samples per second, step by step (its global batch over each measured step's
    time, the ``thermal_steps`` rows); runs without measured steps are left out."""
    wanted = {r["run"]: _f(r.get("global_batch_size")) for r in runs}
    times: dict[str, list[float]] = {}
    for r in rows.get("thermal_steps", []):
        t = _f(r.get("step_time_s"))
        if r.get("run") in wanted and t is not None and t > 0:
            times.setdefault(r["run"], []).append(t)
    return [
        gbs / np.asarray(times[run]) for run, gbs in wanted.items() if gbs and len(times.get(run, ())) >= 2
    ]


def _interval_text(
    rows: dict[str, list[dict[str, Any]]], slow: list[dict[str, Any]], fast: list[dict[str, Any]]
) -> str:
    point, low, high = hierarchical_difference(_step_rates(rows, slow), _step_rates(rows, fast))
    return f"{point * 100:+.1f}% [{low * 100:+.1f}, {high * 100:+.1f}] (95 %, runs then steps resampled)"


def _noise(
    rows: dict[str, list[dict[str, Any]]],
    slow: list[dict[str, Any]],
    fast: list[dict[str, Any]],
    slow_mbs: int,
    fast_mbs: int,
) -> str | None:
    """Why the gain of micro batch ``fast_mbs`` over ``slow_mbs`` cannot be told from the noise
    (None when it can): the hierarchical interval of their per-step throughput (runs, then steps
    within runs, as ``charllm compare``) must lie above 0, from two runs of each size or more
    (one run a size shows step-to-step noise only: 3 of 6 same-configuration pairs got a false
    verdict so; docs/compare-energy.md)."""
    a, b = _step_rates(rows, slow), _step_rates(rows, fast)
    if not a or not b:
        return (
            f"no change: micro batch {fast_mbs} vs {slow_mbs} has no measured steps to judge the noise by "
            "(the analysis's thermal_steps rows)"
        )
    point, low, high = hierarchical_difference(a, b)
    spreads = [sp for run in (*a, *b) if (sp := segment_spread(run)) is not None]
    level = median(float(np.median(r)) for r in (*a, *b))
    n = repeats_needed(median(spreads) / level, point) if spreads and level > 0 else None
    repeats = (
        f"about {n} runs of each size would resolve it" if n else "more runs of each size would resolve it"
    )
    stated = f"{point * 100:+.1f}% [{low * 100:+.1f}, {high * 100:+.1f}]"
    if min(len(a), len(b)) < 2:
        return (
            f"no change yet: one run of micro batch {fast_mbs if len(b) < 2 else slow_mbs} shows only its "
            f"steps' noise, not run-to-run variance (gain {stated}); {repeats} "
            f"(charllm train -m batch.micro_batch_size={slow_mbs},{fast_mbs} data.seed=1,2,3 ...)"
        )
    if not (math.isfinite(low) and low > 0):
        return f"no change: the expected gain is within the noise ({stated}, 95 %); {repeats}"
    return None
