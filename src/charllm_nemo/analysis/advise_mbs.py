"""Micro batch size advice: over runs that differ only in ``micro_batch_size`` (a sweep), the
highest throughput, and among those within ``tolerance`` of it the one with the fewest power
excursions above the limit and the least throttling (docs/advisor.md)."""

from __future__ import annotations

from typing import Any

from charllm_nemo.analysis.advise import MBS_TOLERANCE, MIN_GAIN, Advice, NoAdvice
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
        best: dict[int, dict[str, Any]] = {}
        for r in runs:  # several runs of one size: the faster
            if (
                r["micro_batch_size"] not in best
                or r["samples_per_s"] > best[r["micro_batch_size"]]["samples_per_s"]
            ):
                best[r["micro_batch_size"]] = r
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
                evidence=[*evidence, f"gain is against micro batch {worst['micro_batch_size']}"],
                overrides=[f"batch.micro_batch_size={pick['micro_batch_size']}"],
            )
        )
    return out
