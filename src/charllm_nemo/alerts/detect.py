"""What rank 0 watches for in each step's report: plain logic over numbers (docs/alerts.md).

:class:`AlertDetector` takes each :class:`~charllm_nemo.steps.report.StepReport` (every rank's
figures and its own timing of the step) and the ranks' static facts (host, GPU index and UUID,
power limit; exchanged once), and returns the step's alerts as flat dicts: throttle onset and
end, stragglers, thermal imbalance on a node, power over the limit. Rate-limited here, so every
way an alert is delivered sees the same ones. No I/O, no torch, no W&B.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from charllm_nemo.alerts.config import AlertsConfig

ALERT_KINDS: tuple[str, ...] = (
    "throttle_onset",
    "throttle_end",
    "straggler",
    "thermal_imbalance",
    "power_over_limit",
    "sampler_health",
)
"""Every ``kind`` an alert may have (docs/alerts.md)."""

STRAGGLER_METRICS: tuple[str, ...] = ("step_time_s", "compute_s", "forward_s", "backward_s", "optimizer_s")
"""The times a straggler is judged on: its step, its compute (forward + backward + optimizer)
and each of those phases. Pipeline and gradient-sync waits are not: a long wait marks a rank
that waits for a straggler, not the straggler."""


def _f(v: Any) -> float | None:
    """``v`` when it is a finite number, else None. The figures arrive as floats (NaN for
    unknown): ``v - v == 0`` holds for exactly the finite ones, the fast path."""
    if type(v) is float:
        return v if v - v == 0 else None
    if v is None or isinstance(v, bool):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _median_without(ordered: list[float], v: float) -> float | None:
    """The median of ``ordered`` (sorted) with one occurrence of ``v`` (one of its items) left
    out: the rank's peers' median in O(log n) (bisect), not a new list per rank."""
    m = len(ordered) - 1
    if m <= 0:
        return None
    i = bisect.bisect_left(ordered, v)

    def at(k: int) -> float:  # position k of the list without position i
        return ordered[k] if k < i else ordered[k + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def _compute_s(t: Mapping[str, float]) -> float | None:
    parts = [v for k in ("forward_s", "backward_s", "optimizer_s") if (v := _f(t.get(k))) is not None]
    return math.fsum(parts) if parts else None


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.0f}%"


@dataclass
class _Episode:
    """A rank's throttle episode in progress."""

    start_step: int
    announced: bool
    steps: int = 0
    throttled_s: float = 0.0
    below: int = 0
    reasons: set[str] = field(default_factory=set)


class AlertDetector:
    """Turns step reports into alerts (module doc); one per run, on rank 0.

    ``check(report)`` returns the step's alerts (dicts: docs/alerts.md has every field);
    ``set_rank_info(infos)`` gives the ranks' static facts (index = rank). ``suppressed``
    counts the alerts the rate limit held back."""

    def __init__(self, cfg: AlertsConfig) -> None:
        self.cfg = cfg
        self.infos: list[Mapping[str, Any]] = []
        self._episodes: dict[int, _Episode] = {}
        self._baseline: dict[int, deque[tuple[float, float | None]]] = {}
        self._straggling: dict[int, int] = {}
        self._last: dict[tuple[str, Any], int] = {}
        self.suppressed = 0
        self.raised = 0
        self._health_seen: dict[int, tuple[float, float, float]] = {}
        self._reason_keys = [(r, f"throttle_{r}_s") for r in cfg.throttle_reasons]

    def set_rank_info(self, infos: Sequence[Mapping[str, Any]]) -> None:
        self.infos = list(infos)

    # -- per step --------------------------------------------------------------------------
    def check(self, report: Any) -> list[dict[str, Any]]:
        figs: list[dict[str, float]] = report.per_rank
        timing: list[dict[str, float]] = report.per_rank_timing
        if not figs:
            return []
        step = int(report.step)
        compute: list[float | None] = [_compute_s(t) for t in timing] if timing else [None] * len(figs)
        alerts: list[dict[str, Any]] = []
        alerts += self._throttle(step, figs, timing, compute)
        alerts += self._stragglers(step, figs, timing, compute)
        alerts += self._thermal(step, figs)
        alerts += self._power(step, figs)
        alerts += self._sampler(step, getattr(report, "per_rank_health", []))
        if len(alerts) > self.cfg.max_per_step:
            self.suppressed += len(alerts) - self.cfg.max_per_step
            alerts = alerts[: self.cfg.max_per_step]
        self.raised += len(alerts)
        return alerts

    def _allow(self, kind: str, key: Any, step: int) -> bool:
        last = self._last.get((kind, key))
        if last is not None and step - last < self.cfg.repeat_after_steps:
            self.suppressed += 1
            return False
        self._last[(kind, key)] = step
        return True

    def _who(self, rank: int) -> dict[str, Any]:
        info = self.infos[rank] if rank < len(self.infos) else {}
        return {
            "rank": rank,
            "host": info.get("host"),
            "local_rank": info.get("local_rank"),
            "gpu_index": info.get("gpu_index"),
            "gpu_uuid": info.get("gpu_uuid"),
        }

    def _where(self, rank: int) -> str:
        w = self._who(rank)
        gpu = "GPU ?" if w["gpu_index"] is None else f"GPU {w['gpu_index']}"
        if w["gpu_uuid"]:
            gpu += f" {w['gpu_uuid']}"
        return f"rank {rank} ({w['host'] or 'host ?'}, {gpu})"

    def _telemetry(self, f: Mapping[str, float]) -> dict[str, Any]:
        return {
            "power_avg_w": _f(f.get("power_avg_w")),
            "temp_gpu_peak_c": _f(f.get("temp_gpu_peak_c")),
            "clock_sm_avg_mhz": _f(f.get("clock_sm_avg_mhz")),
            "clock_sm_min_mhz": _f(f.get("clock_sm_min_mhz")),
        }

    def _shares(self, f: Mapping[str, float], duration: float | None) -> dict[str, float]:
        """Share of the step under each alerting reason that was on at all."""
        if not duration or duration <= 0:
            return {}
        out = {}
        for r, key in self._reason_keys:
            s = f.get(key)
            if s is not None and s > 0:  # NaN compares False
                out[r] = min(1.0, s / duration)
        return out

    # -- throttle --------------------------------------------------------------------------
    def _throttle(
        self,
        step: int,
        figs: list[dict[str, float]],
        timing: list[dict[str, float]],
        compute: list[float | None],
    ) -> list[dict[str, Any]]:
        cfg = self.cfg
        out: list[dict[str, Any]] = []
        known = sorted((c, r) for r, c in enumerate(compute) if c is not None)
        for rank, f in enumerate(figs):
            fastest = next((k for k in known if k[1] != rank), None)  # the fastest other rank
            t = timing[rank] if timing else {}
            step_s = _f(t.get("step_time_s")) or _f(f.get("duration_s"))
            shares = self._shares(f, _f(f.get("duration_s")) or step_s)
            share = max(shares.values(), default=0.0)
            on = share >= cfg.throttle_min_share
            ep = self._episodes.get(rank)
            base = self._baseline.setdefault(rank, deque(maxlen=cfg.baseline_steps))
            if ep is None and not on:
                if step_s is not None:
                    base.append((step_s, compute[rank]))
                continue
            if ep is None:
                ep = self._episodes[rank] = _Episode(step, self._allow("throttle_onset", rank, step))
                if ep.announced:
                    out.append(self._onset(step, rank, f, shares, share, step_s, compute, fastest, base))
            if on:
                ep.steps += 1
                ep.below = 0
                ep.reasons.update(shares)
                ep.throttled_s += share * (step_s or 0.0)
                continue
            ep.below += 1
            if ep.below >= cfg.throttle_end_steps:
                del self._episodes[rank]
                if ep.announced:
                    out.append(self._end(step, rank, ep))
        return out

    def _onset(
        self,
        step: int,
        rank: int,
        f: Mapping[str, float],
        shares: dict[str, float],
        share: float,
        step_s: float | None,
        compute: list[float | None],
        fastest: tuple[float, int] | None,
        base: deque[tuple[float, float | None]],
    ) -> dict[str, Any]:
        base_step = statistics.median(b[0] for b in base) if base else None
        base_comp_vals = [b[1] for b in base if b[1] is not None]
        base_comp = statistics.median(base_comp_vals) if base_comp_vals else None
        comp = compute[rank]
        cost_own = step_s / base_step - 1 if step_s and base_step else None
        comp_own = comp / base_comp - 1 if comp is not None and base_comp else None
        vs_fastest = comp / fastest[0] - 1 if comp is not None and fastest and fastest[0] > 0 else None
        reasons = sorted(shares, key=lambda r: -shares[r])
        text = ", ".join(f"{r} {100 * shares[r]:.0f}%" for r in reasons)
        message = (
            f"{self._where(rank)} throttled at step {step}: {text} of the step; "
            f"step {step_s or math.nan:.3f} s "
            f"({_pct(cost_own)} vs its recent unthrottled steps), compute {_pct(comp_own)} vs its own, "
            f"{_pct(vs_fastest)} vs the fastest rank" + ("" if fastest is None else f" (rank {fastest[1]})")
        )
        return {
            "kind": "throttle_onset",
            "severity": "warning",
            "step": step,
            **self._who(rank),
            "reasons": reasons,
            "reason_shares": {r: shares[r] for r in reasons},
            "share": share,
            "step_time_s": step_s,
            "baseline_step_time_s": base_step,
            "cost_vs_own": cost_own,
            "compute_s": comp,
            "baseline_compute_s": base_comp,
            "compute_cost_vs_own": comp_own,
            "fastest_rank": None if fastest is None else fastest[1],
            "fastest_compute_s": None if fastest is None else fastest[0],
            "cost_vs_fastest": vs_fastest,
            **self._telemetry(f),
            "message": message,
        }

    def _end(self, step: int, rank: int, ep: _Episode) -> dict[str, Any]:
        reasons = sorted(ep.reasons)
        return {
            "kind": "throttle_end",
            "severity": "info",
            "step": step,
            **self._who(rank),
            "reasons": reasons,
            "since_step": ep.start_step,
            "throttled_steps": ep.steps,
            "throttled_s": ep.throttled_s,
            "message": (
                f"{self._where(rank)} no longer throttled at step {step} ({', '.join(reasons)} since step "
                f"{ep.start_step}: {ep.steps} step(s), {ep.throttled_s:.3f} s under it)"
            ),
        }

    # -- stragglers ------------------------------------------------------------------------
    def _stragglers(
        self,
        step: int,
        figs: list[dict[str, float]],
        timing: list[dict[str, float]],
        compute: list[float | None],
    ) -> list[dict[str, Any]]:
        cfg = self.cfg
        n = len(figs)
        if n < 2 or not timing or step < cfg.warmup_steps:
            return []
        values: dict[str, list[float | None]] = {
            m: (compute if m == "compute_s" else [_f(t.get(m)) for t in timing]) for m in STRAGGLER_METRICS
        }
        known = {m: sorted(v for v in vs if v is not None) for m, vs in values.items()}
        thr, floor = 1 + cfg.straggler_threshold, cfg.straggler_min_s
        out: list[dict[str, Any]] = []
        for rank in range(n):
            over: dict[str, dict[str, float]] = {}
            for m, vs in values.items():
                v = vs[rank]
                if v is None:
                    continue
                med = _median_without(known[m], v)  # the peers': the others' values
                if med is None or med <= 0:
                    continue
                if v > med * thr and v - med >= floor:
                    over[m] = {"value_s": v, "peers_median_s": med, "excess": v / med - 1}
            count = self._straggling[rank] = self._straggling.get(rank, 0) + 1 if over else 0
            if count == cfg.straggler_steps and self._allow("straggler", rank, step):
                out.append(self._straggler(step, rank, figs, over))
        return out

    @staticmethod
    def _median(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    def _straggler(
        self, step: int, rank: int, figs: list[dict[str, float]], over: dict[str, dict[str, float]]
    ) -> dict[str, Any]:
        worst = max(over, key=lambda m: over[m]["excess"])
        f = figs[rank]
        tel = self._telemetry(f)
        peers = [figs[i] for i in range(len(figs)) if i != rank]
        peer_clock = self._median([v for p in peers if (v := _f(p.get("clock_sm_avg_mhz"))) is not None])
        peer_temp = self._median([v for p in peers if (v := _f(p.get("temp_gpu_peak_c"))) is not None])
        peer_power = self._median([v for p in peers if (v := _f(p.get("power_avg_w"))) is not None])
        shares = self._shares(f, _f(f.get("duration_s")))
        why = []
        if shares:
            why.append("throttled: " + ", ".join(f"{r} {100 * s:.0f}%" for r, s in shares.items()))
        if tel["clock_sm_avg_mhz"] is not None and peer_clock:
            why.append(f"clock {tel['clock_sm_avg_mhz']:.0f} MHz vs peers' {peer_clock:.0f}")
        if tel["temp_gpu_peak_c"] is not None and peer_temp is not None:
            why.append(f"{tel['temp_gpu_peak_c']:.0f} C vs peers' {peer_temp:.0f}")
        w = over[worst]
        message = (
            f"{self._where(rank)} straggles at step {step}: {worst} {w['value_s']:.4f} s, "
            f"{100 * w['excess']:+.0f}% over its peers' median {w['peers_median_s']:.4f} s for "
            f"{self.cfg.straggler_steps} steps" + (f"; {'; '.join(why)}" if why else "")
        )
        return {
            "kind": "straggler",
            "severity": "warning",
            "step": step,
            **self._who(rank),
            "metric": worst,
            "value_s": w["value_s"],
            "peers_median_s": w["peers_median_s"],
            "excess": w["excess"],
            "metrics": over,
            "steps": self.cfg.straggler_steps,
            **tel,
            "throttle_shares": shares,
            "peers_clock_sm_avg_mhz": peer_clock,
            "peers_temp_gpu_peak_c": peer_temp,
            "peers_power_avg_w": peer_power,
            "message": message,
        }

    # -- thermal imbalance, power ----------------------------------------------------------
    def _thermal(self, step: int, figs: list[dict[str, float]]) -> list[dict[str, Any]]:
        nodes: dict[Any, list[tuple[float, int]]] = {}
        for rank, f in enumerate(figs):
            t = _f(f.get("temp_gpu_peak_c"))
            if t is not None:
                nodes.setdefault(self._who(rank)["host"], []).append((t, rank))
        out = []
        for host, temps in nodes.items():
            if len(temps) < 2:
                continue
            (cold, cold_rank), (hot, hot_rank) = min(temps), max(temps)
            spread = hot - cold
            if spread >= self.cfg.thermal_imbalance_c and self._allow("thermal_imbalance", host, step):
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
                        "gpu_index": self._who(hot_rank)["gpu_index"],
                        "gpu_uuid": self._who(hot_rank)["gpu_uuid"],
                        "message": (
                            f"thermal imbalance on {host or 'host ?'} at step {step}: {spread:.0f} C between "
                            f"{self._where(hot_rank)} at {hot:.0f} C and rank {cold_rank} at {cold:.0f} C"
                        ),
                    }
                )
        return out

    def _power(self, step: int, figs: list[dict[str, float]]) -> list[dict[str, Any]]:
        out = []
        for rank, f in enumerate(figs):
            info = self.infos[rank] if rank < len(self.infos) else {}
            limit, power = _f(info.get("power_limit_w")), _f(f.get("power_avg_w"))
            if limit is None or power is None or limit <= 0:
                continue
            if power > limit * (1 + self.cfg.power_over_limit) and self._allow(
                "power_over_limit", rank, step
            ):
                out.append(
                    {
                        "kind": "power_over_limit",
                        "severity": "warning",
                        "step": step,
                        **self._who(rank),
                        "power_avg_w": power,
                        "power_peak_w": _f(f.get("power_peak_w")),
                        "power_limit_w": limit,
                        "over": power / limit - 1,
                        "message": (
                            f"{self._where(rank)} drew {power:.0f} W on average at step {step}, "
                            f"{100 * (power / limit - 1):.0f}% over its {limit:.0f} W limit"
                        ),
                    }
                )
        return out

    # -- sampler health ---------------------------------------------------------------------
    def _sampler(self, step: int, health: list[dict[str, float]]) -> list[dict[str, Any]]:
        """A rank's sampler stopped (a device lost, an error), missed ``sampler_missed`` or more
        deadlines since the last report, or read nulls of metrics its device supported."""
        out = []
        keys = ("sampler_deadlines_missed", "sampler_nulls", "sampler_stopped")
        for rank, h in enumerate(health):
            missed, nulls, stopped = (_f(h.get(k)) for k in keys)
            if missed is None or nulls is None or stopped is None:
                continue
            before = self._health_seen.get(rank, (0.0, 0.0, 0.0))
            self._health_seen[rank] = (missed, nulls, stopped)
            problems = []
            if stopped and not before[2]:
                problems.append(("stopped", "error", "its sampler stopped (a device lost, or an error)"))
            new_missed, new_nulls = missed - before[0], nulls - before[1]
            if new_missed >= self.cfg.sampler_missed:
                problems.append(
                    ("deadlines_missed", "warning", f"its sampler missed {new_missed:.0f} deadlines")
                )
            if new_nulls > 0:
                problems.append(
                    ("nulls", "warning", f"{new_nulls:.0f} readings of supported metrics were null")
                )
            for problem, severity, text in problems:
                if problem != "stopped" and not self._allow(f"sampler_{problem}", rank, step):
                    continue
                out.append(
                    {
                        "kind": "sampler_health",
                        "severity": severity,
                        "step": step,
                        **self._who(rank),
                        "problem": problem,
                        "deadlines_missed": missed,
                        "deadlines_missed_new": new_missed,
                        "nulls": nulls,
                        "nulls_new": new_nulls,
                        "stopped": bool(stopped),
                        "message": f"{self._where(rank)} at step {step}: {text}",
                    }
                )
        return out
