"""What rank 0 watches for in each step's report: plain logic over numbers (docs/alerts.md).

:class:`AlertDetector` takes each :class:`~charllm_nemo.steps.report.StepReport` (every rank's
figures and its own timing of the step), the ranks' static facts (host, GPU index and UUID,
power limit; exchanged once) and, where the run has a pipeline, its
:class:`~charllm_nemo.alerts.stages.StageLayout` (each rank's stage, each stage's work), and
returns the step's alerts as flat dicts: throttle onset and end, stragglers, thermal imbalance
on a node, power over the limit, sampler health, the job's power swing and ramp (alerts/grid.py).
Stragglers and host contention are :class:`~charllm_nemo.alerts.straggler.StragglerWatch`'s
(alerts/straggler.py): a rank's time is compared only with the ranks that do the same work (its
pipeline stage's); a rank alone in its stage is a straggler only on evidence beyond timing.
Rate-limited here, so every way an alert is delivered sees the same ones.
No I/O, no torch, no W&B.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from charllm_nemo.alerts.config import AlertsConfig
from charllm_nemo.alerts.culprit import throttle_cost
from charllm_nemo.alerts.evidence import StepView
from charllm_nemo.alerts.evidence import finite as _f
from charllm_nemo.alerts.evidence import ms_text as _ms
from charllm_nemo.alerts.grid import GRID_KINDS, GridWatch
from charllm_nemo.alerts.node_checks import power_alerts, sampler_alerts, thermal_alerts
from charllm_nemo.alerts.stages import StageLayout
from charllm_nemo.alerts.straggler import StragglerWatch

ALERT_KINDS: tuple[str, ...] = (
    "throttle_onset",
    "throttle_end",
    "straggler",
    "thermal_imbalance",
    "power_over_limit",
    "sampler_health",
    "host_contention",
    *GRID_KINDS,
)
"""Every ``kind`` an alert may have (docs/alerts.md)."""

MIN_OWN_BASELINE = 2
"""Unthrottled steps after the warm-up a rank needs before its own steps are a baseline."""

BASELINES: tuple[str, ...] = ("same_stage_peers", "own_unthrottled_steps", "unthrottled_clock")
"""What a throttle's cost is measured against, in the order tried (docs/alerts.md)."""


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
    ``set_rank_info(infos)`` gives the ranks' static facts (index = rank; a ``pp_stage`` there
    is each rank's stage where ``stages`` is not given). ``stages``: the run's pipeline layout
    (None: no pipeline, or one whose stages are not known: then, once the ranks report pipeline
    waits, no rank is compared with another by time alone). ``collectives_in_phases``: the
    layout has collectives inside the forward and backward phases (tensor, expert or context
    parallel), so a rank's phase times hold its waits for its peers and are compared with no
    one's. ``suppressed`` counts the alerts the rate limit held back; ``held`` the straggler
    verdicts the evidence could not decide (``held_last`` says the last one's why)."""

    def __init__(
        self, cfg: AlertsConfig, stages: StageLayout | None = None, *, collectives_in_phases: bool = False
    ) -> None:
        self.cfg = cfg
        self.stages = stages
        self.coupled = collectives_in_phases
        self.held = 0  # straggler verdicts held: timing alone, the device alike, no host contention seen
        self.held_last: str | None = None
        self.infos: list[Mapping[str, Any]] = []
        self._episodes: dict[int, _Episode] = {}
        self._baseline: dict[int, deque[tuple[float, float | None]]] = {}
        self._last: dict[tuple[str, Any], int] = {}
        self.suppressed = 0
        self.raised = 0
        self._health_seen: dict[int, tuple[float, float, float]] = {}  # per rank, the last counts
        self._reason_keys = [(r, f"throttle_{r}_s") for r in cfg.throttle_reasons]
        self._alerting = frozenset(cfg.throttle_reasons)
        self._clock_seen: dict[Any, tuple[int, float]] = {}  # device model -> (step, unthrottled clock)
        self._grid = GridWatch(cfg)  # the job's power swing and ramp (alerts/grid.py)
        self._stragglers = StragglerWatch(self)  # stragglers and host contention (alerts/straggler.py)

    def set_rank_info(self, infos: Sequence[Mapping[str, Any]]) -> None:
        self.infos = list(infos)

    # -- per step --------------------------------------------------------------------------
    def check(self, report: Any) -> list[dict[str, Any]]:
        figs: list[dict[str, float]] = report.per_rank
        timing: list[dict[str, float]] = report.per_rank_timing
        if not figs:
            return []
        n = len(figs)
        v = StepView.build(
            int(report.step),
            figs,
            timing,
            [self._stage(r) for r in range(n)],
            [self._info(r).get("gpu_name") for r in range(n)],
            self._reason_keys,
            self.cfg.throttle_min_share,
            self.stages,
        )
        for device, clocks in v.clocks_unthrottled.items():
            if clocks:
                self._clock_seen[device] = (v.step, statistics.median(clocks))
        alerts: list[dict[str, Any]] = []
        alerts += self._throttle(v, figs, timing)
        alerts += self._stragglers.check(v, figs, timing)
        alerts += thermal_alerts(self, v.step, figs)
        alerts += power_alerts(self, v.step, figs)
        alerts += self._grid.check(self.allow, v.step, figs)
        alerts += sampler_alerts(self, v.step, getattr(report, "per_rank_health", []), self._health_seen)
        if len(alerts) > self.cfg.max_per_step:
            self.suppressed += len(alerts) - self.cfg.max_per_step
            alerts = alerts[: self.cfg.max_per_step]
        self.raised += len(alerts)
        return alerts

    def allow(self, kind: str, key: Any, step: int) -> bool:
        last = self._last.get((kind, key))
        if last is not None and step - last < self.cfg.repeat_after_steps:
            self.suppressed += 1
            return False
        self._last[(kind, key)] = step
        return True

    def _info(self, rank: int) -> Mapping[str, Any]:
        return self.infos[rank] if rank < len(self.infos) else {}

    def _stage(self, rank: int) -> int | None:
        if self.stages is not None:
            return self.stages.stage(rank)
        s = self._info(rank).get("pp_stage")
        return s if isinstance(s, int) and not isinstance(s, bool) else None

    def num_stages(self) -> int | None:
        """The run's pipeline stages: the layout's, else one past the highest stage a rank
        reported; None where no rank's stage is known."""
        if self.stages is not None:
            return self.stages.stages
        known = [s for r in range(len(self.infos)) if (s := self._stage(r)) is not None]
        return max(known) + 1 if known else None

    def who(self, rank: int) -> dict[str, Any]:
        info = self._info(rank)
        return {
            "rank": rank,
            "host": info.get("host"),
            "local_rank": info.get("local_rank"),
            "gpu_index": info.get("gpu_index"),
            "gpu_uuid": info.get("gpu_uuid"),
            "pp_stage": self._stage(rank),
        }

    def where(self, rank: int) -> str:
        w = self.who(rank)
        gpu = "GPU ?" if w["gpu_index"] is None else f"GPU {w['gpu_index']}"
        if w["gpu_uuid"]:
            gpu += f" {w['gpu_uuid']}"
        stages = self.num_stages()
        stage = (
            f", stage {w['pp_stage']} of {stages}" if w["pp_stage"] is not None and (stages or 1) > 1 else ""
        )
        return f"rank {rank} ({w['host'] or 'host ?'}, {gpu}{stage})"

    def telemetry(self, f: Mapping[str, float]) -> dict[str, Any]:
        """A rank's power, peak temperature and SM clocks from its figures ``f``, as its
        alerts carry them (None where not finite)."""
        return {
            "power_avg_w": _f(f.get("power_avg_w")),
            "temp_gpu_peak_c": _f(f.get("temp_gpu_peak_c")),
            "clock_sm_avg_mhz": _f(f.get("clock_sm_avg_mhz")),
            "clock_sm_min_mhz": _f(f.get("clock_sm_min_mhz")),
        }

    def _clock_baseline(self, rank: int, v: StepView) -> tuple[float | None, str | None]:
        """The device's unthrottled clock for ``rank`` (MHz) and where it comes from: the other
        ranks of its device model without an alerting reason this step, else the last step
        that had some."""
        c = v.unthrottled_clock(rank)
        if c is not None:
            return c, "the unthrottled ranks' median clock this step"
        seen = self._clock_seen.get(v.device[rank])
        if seen is not None and seen[0] < v.step:
            return seen[1], f"the unthrottled ranks' median clock at step {seen[0]}"
        return None, None

    def loss(self, rank: int, v: StepView) -> dict[str, Any] | None:
        """What ``rank`` lost to a lower clock this step: its compute at its clock against the
        same work at the unthrottled clock (compute-bound work scales with the clock)."""
        comp, c = v.compute[rank], v.clock[rank]
        base, source = self._clock_baseline(rank, v)
        if comp is None or c is None or c <= 0 or not base:
            return None
        return {
            "baseline_clock_mhz": base,
            "clock_baseline": source,
            "clock_excess": base / c - 1,
            "lost_s": max(0.0, comp * (1 - c / base)),
            "reasons_beyond_peers": v.reasons_beyond_others(rank, self.cfg.throttle_min_share),
        }

    # -- throttle --------------------------------------------------------------------------
    def _throttle(
        self, v: StepView, figs: list[dict[str, float]], timing: list[dict[str, float]]
    ) -> list[dict[str, Any]]:
        cfg = self.cfg
        out: list[dict[str, Any]] = []
        for rank, f in enumerate(figs):
            t = timing[rank] if timing else {}
            step_s = _f(t.get("step_time_s")) or _f(f.get("duration_s"))
            shares = {r: s for r, s in v.shares[rank].items() if r in self._alerting}
            share = max(shares.values(), default=0.0)
            on = v.throttled[rank]
            ep = self._episodes.get(rank)
            base = self._baseline.setdefault(rank, deque(maxlen=cfg.baseline_steps))
            if ep is None and not on:
                if step_s is not None and v.step >= cfg.warmup_steps:  # warm-up steps are no baseline
                    base.append((step_s, v.compute[rank]))
                continue
            if ep is None:
                ep = self._episodes[rank] = _Episode(v.step, self.allow("throttle_onset", rank, v.step))
                if ep.announced:
                    out.append(self._onset(v, rank, f, shares, share, step_s, base))
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
                    out.append(self._end(v.step, rank, ep))
        return out

    def _onset(
        self,
        v: StepView,
        rank: int,
        f: Mapping[str, float],
        shares: dict[str, float],
        share: float,
        step_s: float | None,
        base: deque[tuple[float, float | None]],
    ) -> dict[str, Any]:
        step, comp = v.step, v.compute[rank]
        own = len(base) >= MIN_OWN_BASELINE
        base_step = statistics.median(b[0] for b in base) if own else None
        base_comp_vals = [b[1] for b in base if b[1] is not None]
        base_comp = statistics.median(base_comp_vals) if own and base_comp_vals else None
        cost_own = step_s / base_step - 1 if step_s and base_step else None
        comp_own = comp / base_comp - 1 if comp is not None and base_comp else None
        same = [(c, p) for p in v.peers(rank) if (c := v.compute[p]) is not None]
        fastest = min(same, default=None)  # the fastest rank doing the same work
        vs_fastest = comp / fastest[0] - 1 if comp is not None and fastest and fastest[0] > 0 else None
        # Peers' compute is a baseline only where their phases hold no wait for this rank (no
        # collective inside the phases: data parallel replicas, a pipeline stage's replicas).
        cool = [] if self.coupled else [c for c, p in same if not v.throttled[p]]
        loss = self.loss(rank, v)
        baseline, ref, cost, lost, said, note = throttle_cost(
            comp, cool, base_comp, len(base), loss, v.clock[rank]
        )
        reasons = sorted(shares, key=lambda r: -shares[r])
        text = ", ".join(f"{r} {100 * shares[r]:.0f}%" for r in reasons)
        cost_text = "" if cost is None or lost is None else f" {_pct(cost)} ({_ms(max(0.0, lost))} lost)"
        message = (
            f"{self.where(rank)} throttled at step {step}: {text} of the step; compute "
            f"{comp or math.nan:.3f} s{cost_text} against {said}" + (f" ({note})" if note else "")
        )
        return {
            "kind": "throttle_onset",
            "severity": "warning",
            "step": step,
            **self.who(rank),
            "reasons": reasons,
            "reason_shares": {r: shares[r] for r in reasons},
            "share": share,
            "baseline": baseline,
            "baseline_s": ref,
            "cost": cost,
            "lost_s": lost,
            "cost_note": note,
            "baseline_clock_mhz": None if loss is None else loss["baseline_clock_mhz"],
            "clock_baseline": None if loss is None else loss["clock_baseline"],
            "cost_vs_clock": None if loss is None else loss["clock_excess"],
            "step_time_s": step_s,
            "baseline_step_time_s": base_step,
            "cost_vs_own": cost_own,
            "compute_s": comp,
            "baseline_compute_s": base_comp,
            "compute_cost_vs_own": comp_own,
            "fastest_rank": None if fastest is None else fastest[1],
            "fastest_compute_s": None if fastest is None else fastest[0],
            "cost_vs_fastest": vs_fastest,
            **self.telemetry(f),
            "message": message,
        }

    def _end(self, step: int, rank: int, ep: _Episode) -> dict[str, Any]:
        reasons = sorted(ep.reasons)
        return {
            "kind": "throttle_end",
            "severity": "info",
            "step": step,
            **self.who(rank),
            "reasons": reasons,
            "since_step": ep.start_step,
            "throttled_steps": ep.steps,
            "throttled_s": ep.throttled_s,
            "message": (
                f"{self.where(rank)} no longer throttled at step {step} ({', '.join(reasons)} since step "
                f"{ep.start_step}: {ep.steps} step(s), {ep.throttled_s:.3f} s under it)"
            ),
        }
