"""The alerts about a node and a rank's hardware rather than its time against its peers:
thermal imbalance between the GPUs of a host, power over a device's limit, and the sampler's
own health (docs/alerts.md). Functions of the :class:`~charllm_nemo.alerts.detect.AlertDetector`
that calls them (its config, rank facts and rate limit); no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from charllm_nemo.alerts.config import AlertsConfig
from charllm_nemo.alerts.evidence import finite as _f


class Detector(Protocol):
    """What these checks use of the detector (charllm_nemo.alerts.detect.AlertDetector)."""

    @property
    def cfg(self) -> AlertsConfig: ...
    @property
    def infos(self) -> Sequence[Mapping[str, Any]]: ...

    def who(self, rank: int) -> dict[str, Any]: ...
    def where(self, rank: int) -> str: ...
    def allow(self, kind: str, key: Any, step: int) -> bool: ...


def thermal_alerts(det: Detector, step: int, figs: list[dict[str, float]]) -> list[dict[str, Any]]:
    """Per host, the spread of its ranks' peak GPU temperatures, when it reaches ``thermal_imbalance_c``."""
    nodes: dict[Any, list[tuple[float, int]]] = {}
    for rank, f in enumerate(figs):
        t = _f(f.get("temp_gpu_peak_c"))
        if t is not None:
            nodes.setdefault(det.who(rank)["host"], []).append((t, rank))
    out = []
    for host, temps in nodes.items():
        if len(temps) < 2:
            continue
        (cold, cold_rank), (hot, hot_rank) = min(temps), max(temps)
        spread = hot - cold
        if spread >= det.cfg.thermal_imbalance_c and det.allow("thermal_imbalance", host, step):
            hot_who = det.who(hot_rank)
            out.append(
                {
                    "kind": "thermal_imbalance",
                    "severity": "warning",
                    "step": step,
                    "host": host,
                    "rank": hot_rank,
                    "hottest_rank": hot_rank,
                    "hottest_c": hot,
                    "coolest_rank": cold_rank,
                    "coolest_c": cold,
                    "spread_c": spread,
                    "ranks": len(temps),
                    "gpu_index": hot_who["gpu_index"],
                    "gpu_uuid": hot_who["gpu_uuid"],
                    "message": (
                        f"thermal imbalance on {host or 'host ?'} at step {step}: {spread:.0f} C between "
                        f"{det.where(hot_rank)} at {hot:.0f} C and rank {cold_rank} at {cold:.0f} C"
                    ),
                }
            )
    return out


def power_alerts(det: Detector, step: int, figs: list[dict[str, float]]) -> list[dict[str, Any]]:
    """A rank whose average power over the step exceeds its limit by ``power_over_limit``."""
    out = []
    for rank, f in enumerate(figs):
        info = det.infos[rank] if rank < len(det.infos) else {}
        limit, power = _f(info.get("power_limit_w")), _f(f.get("power_avg_w"))
        if limit is None or power is None or limit <= 0:
            continue
        if power > limit * (1 + det.cfg.power_over_limit) and det.allow("power_over_limit", rank, step):
            out.append(
                {
                    "kind": "power_over_limit",
                    "severity": "warning",
                    "step": step,
                    **det.who(rank),
                    "power_avg_w": power,
                    "power_peak_w": _f(f.get("power_peak_w")),
                    "power_limit_w": limit,
                    "over": power / limit - 1,
                    "message": (
                        f"{det.where(rank)} drew {power:.0f} W on average at step {step}, "
                        f"{100 * (power / limit - 1):.0f}% over its {limit:.0f} W limit"
                    ),
                }
            )
    return out


def sampler_alerts(
    det: Detector, step: int, health: list[dict[str, float]], seen: dict[int, tuple[float, float, float]]
) -> list[dict[str, Any]]:
    """A rank's sampler stopped (a device lost, an error), missed ``sampler_missed`` or more
    deadlines since the last report, or read nulls of metrics its device supported. ``seen``: the
    rank's counts at the last report (updated here)."""
    out = []
    keys = ("sampler_deadlines_missed", "sampler_nulls", "sampler_stopped")
    for rank, h in enumerate(health):
        missed, nulls, stopped = (_f(h.get(k)) for k in keys)
        if missed is None or nulls is None or stopped is None:
            continue
        before = seen.get(rank, (0.0, 0.0, 0.0))
        seen[rank] = (missed, nulls, stopped)
        problems = []
        if stopped and not before[2]:
            problems.append(("stopped", "error", "its sampler stopped (a device lost, or an error)"))
        new_missed, new_nulls = missed - before[0], nulls - before[1]
        if new_missed >= det.cfg.sampler_missed:
            problems.append(("deadlines_missed", "warning", f"its sampler missed {new_missed:.0f} deadlines"))
        if new_nulls > 0:
            problems.append(("nulls", "warning", f"{new_nulls:.0f} readings of supported metrics were null"))
        for problem, severity, text in problems:
            if problem != "stopped" and not det.allow(f"sampler_{problem}", rank, step):
                continue
            out.append(
                {
                    "kind": "sampler_health",
                    "severity": severity,
                    "step": step,
                    **det.who(rank),
                    "problem": problem,
                    "deadlines_missed": missed,
                    "deadlines_missed_new": new_missed,
                    "nulls": nulls,
                    "nulls_new": new_nulls,
                    "stopped": bool(stopped),
                    "message": f"{det.where(rank)} at step {step}: {text}",
                }
            )
    return out
