"""What rank 0 watches for in each step's report: plain logic over numbers (docs/alerts.md).

:class:`AlertDetector` takes each :class:`~charllm_nemo.steps.report.StepReport` (every rank's
figures and its own timing of the step), the ranks' static facts (host, GPU index and UUID,
power limit; exchanged once) and, where the run has a pipeline, its
:class:`~charllm_nemo.alerts.stages.StageLayout` (each rank's stage, each stage's work), and
returns the step's alerts as flat dicts: throttle onset and end, stragglers, thermal imbalance
on a node, power over the limit, sampler health, the job's power swing and ramp (alerts/grid.py).
A rank's time is compared only with the ranks that do the same
work (its pipeline stage's); a rank alone in its stage is a straggler only on evidence beyond
timing (throttle reasons its peers lack, a clock below the unthrottled ranks', busy while the
other stages wait). Rate-limited here, so every way an alert is delivered sees the same ones.
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
from charllm_nemo.alerts.culprit import (
    Arrival,
    arrival,
    collective_wait,
    host_alert,
    host_masks,
    run_delay_beyond_peers,
    throttle_cost,
    timing_verdict,
)
from charllm_nemo.alerts.evidence import StepView, median_or_none, median_without
from charllm_nemo.alerts.evidence import finite as _f
from charllm_nemo.alerts.grid import GRID_KINDS, GridWatch
from charllm_nemo.alerts.node_checks import power_alerts, sampler_alerts, thermal_alerts
from charllm_nemo.alerts.stages import StageLayout

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

STRAGGLER_METRICS: tuple[str, ...] = ("step_time_s", "compute_s", "forward_s", "backward_s", "optimizer_s")
"""The times a straggler is judged on against its peers: its step, its compute (forward +
backward + optimizer) and each of those phases. Pipeline and gradient-sync waits are not: a long
wait marks a rank that waits for a straggler, not the straggler."""

MIN_OWN_BASELINE = 2
"""Unthrottled steps after the warm-up a rank needs before its own steps are a baseline."""

BASELINES: tuple[str, ...] = ("same_stage_peers", "own_unthrottled_steps", "unthrottled_clock")
"""What a throttle's cost is measured against, in the order tried (docs/alerts.md)."""


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.0f}%"


def _ms(s: float) -> str:
    return f"{1e3 * s:.0f} ms" if s >= 0.01 else f"{1e3 * s:.1f} ms"


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
        self._culprit: dict[int, int] = {}  # per rank, steps in a row it held its peers, device alike
        self.infos: list[Mapping[str, Any]] = []
        self._episodes: dict[int, _Episode] = {}
        self._baseline: dict[int, deque[tuple[float, float | None]]] = {}
        self._straggling: dict[int, int] = {}
        self._last: dict[tuple[str, Any], int] = {}
        self.suppressed = 0
        self.raised = 0
        self._health_seen: dict[int, tuple[float, float, float]] = {}  # per rank, the last counts
        self._reason_keys = [(r, f"throttle_{r}_s") for r in cfg.throttle_reasons]
        self._alerting = frozenset(cfg.throttle_reasons)
        self._clock_seen: dict[Any, tuple[int, float]] = {}  # device model -> (step, unthrottled clock)
        self._grid = GridWatch(cfg)  # the job's power swing and ramp (alerts/grid.py)

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
        alerts += self._stragglers(v, figs, timing)
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

    def _num_stages(self) -> int | None:
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
        stages = self._num_stages()
        stage = (
            f", stage {w['pp_stage']} of {stages}" if w["pp_stage"] is not None and (stages or 1) > 1 else ""
        )
        return f"rank {rank} ({w['host'] or 'host ?'}, {gpu}{stage})"

    def _telemetry(self, f: Mapping[str, float]) -> dict[str, Any]:
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

    def _loss(self, rank: int, v: StepView) -> dict[str, Any] | None:
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
        loss = self._loss(rank, v)
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
            **self._telemetry(f),
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

    # -- stragglers ------------------------------------------------------------------------
    def _stragglers(
        self, v: StepView, figs: list[dict[str, float]], timing: list[dict[str, float]]
    ) -> list[dict[str, Any]]:
        """A rank with peers (the same stage) straggles on its device's evidence
        (:meth:`_device`) with the timing not against it (it held its peers at the step's
        collectives, or its compute is over theirs, or the collectives sit inside the phases);
        a rank that held its peers with its device like theirs is the host's (host contention)
        or held. A rank alone in its stage on evidence (:meth:`_evidence`). docs/alerts.md."""
        cfg = self.cfg
        n = len(figs)
        if n < 2 or not timing or v.step < cfg.warmup_steps:
            return []
        values: dict[str, list[float | None]] = {
            m: (v.compute if m == "compute_s" else [_f(t.get(m)) for t in timing]) for m in STRAGGLER_METRICS
        }
        known: dict[tuple[Any, str], list[float]] = {}
        for g, ranks in v.members.items():
            if len(ranks) > 1:
                for m, vs in values.items():
                    known[(g, m)] = sorted(x for r in ranks if (x := vs[r]) is not None)
        thr, floor = 1 + cfg.straggler_threshold, cfg.straggler_min_s
        waits = [collective_wait(t) for t in timing]
        arrivals = {g: arrival(rs, waits, v.compute, floor) for g, rs in v.members.items() if len(rs) > 1}
        device = [self._device(r, v) if len(v.members[v.group[r]]) > 1 else None for r in range(n)]
        out: list[dict[str, Any]] = []
        for rank in range(n):
            over: dict[str, dict[str, float]] = {}
            evidence = verdict = arr = None
            culprit = False
            g = v.group[rank]
            if len(v.members[g]) > 1:
                for m, vs in values.items():
                    x = vs[rank]
                    med = None if x is None else median_without(known[(g, m)], x)  # the peers'
                    if x is None or med is None or med <= 0 or self.coupled:
                        continue
                    if x > med * thr and x - med >= floor:
                        over[m] = {"value_s": x, "peers_median_s": med, "excess": x / med - 1}
                arr = arrivals[g]
                verdict = timing_verdict(rank, arr, bool(over), self.coupled, cfg.straggler_threshold, floor)
                evidence = device[rank]
                if evidence is not None and verdict not in ("held", "over", "unmeasured"):
                    # it waited for another, or nobody waited: throttled, not straggling; unless
                    # the host held its peers back longer than its device cost it: then timing
                    # can show nothing, and its device's evidence decides (as where unmeasured)
                    if host_masks(rank, v.peers(rank), timing, evidence["lost_s"], floor):
                        verdict = "masked"
                    else:
                        evidence = None
                # late with no device evidence of its own: the host, or held. Its phases over its
                # peers' (no arrival seen) may be a slow peer's doing: only where none has evidence.
                culprit = evidence is None and (
                    verdict == "held" or (verdict == "over" and not any(device[p] for p in v.members[g]))
                )
            else:
                evidence = self._evidence(rank, v)
            hit = evidence is not None
            count = self._straggling[rank] = self._straggling.get(rank, 0) + 1 if hit else 0
            if count == cfg.straggler_steps and self.allow("straggler", rank, v.step):
                out.append(self._straggler(v, rank, figs, over, evidence, verdict, arr, timing))
            held = self._culprit[rank] = self._culprit.get(rank, 0) + 1 if culprit else 0
            if held == cfg.straggler_steps:
                alert = host_alert(self, v, rank, figs, timing, over, arr)
                if alert is not None:
                    out.append(alert)
        return out

    def _device(self, rank: int, v: StepView) -> dict[str, Any] | None:
        """The device evidence that ``rank`` is slow: a limiting reason its peers lack (by
        ``throttle_min_share`` of the step) and a clock that makes its compute exceed the
        unthrottled clock's by ``straggler_threshold`` and ``straggler_min_s`` (its loss)."""
        loss = self._loss(rank, v)
        cfg = self.cfg
        if loss is None or not loss["reasons_beyond_peers"]:
            return None
        if loss["clock_excess"] < cfg.straggler_threshold or loss["lost_s"] < cfg.straggler_min_s:
            return None
        return loss

    def device_alike(self, rank: int, v: StepView) -> bool:
        """``rank``'s device runs like its peers': no limiting reason beyond theirs, and a clock
        (where known) within ``straggler_threshold`` of the unthrottled ranks'."""
        if v.reasons_beyond_others(rank, self.cfg.throttle_min_share):
            return False
        c, base = v.clock[rank], v.unthrottled_clock(rank)
        return c is None or base is None or c * (1 + self.cfg.straggler_threshold) >= base

    def _evidence(self, rank: int, v: StepView) -> dict[str, Any] | None:
        """A rank alone in its stage straggles when all hold: a limiting reason its peers lack
        (by ``throttle_min_share`` of the step), a clock that makes its compute exceed the
        unthrottled clock's by ``straggler_threshold`` and ``straggler_min_s``, and it is busy
        while the other stages wait (its pipeline wait at most theirs)."""
        loss = self._device(rank, v)
        if loss is None:
            return None
        wait, others = v.wait[rank], v.others_wait(rank)
        if wait is not None and others is not None and wait > others:
            return None  # the others do not wait for it: throttled (its own alert), not straggling
        return {**loss, "pp_wait_s": wait, "peers_pp_wait_s": others}

    def _straggler(
        self,
        v: StepView,
        rank: int,
        figs: list[dict[str, float]],
        over: dict[str, dict[str, float]],
        evidence: dict[str, Any] | None,
        verdict: str | None = None,
        arr: Arrival | None = None,
        timing: Sequence[Mapping[str, float]] = (),
    ) -> dict[str, Any]:
        f = figs[rank]
        tel = self._telemetry(f)
        peers = v.peers(rank) if verdict is not None else [r for r in range(len(figs)) if r != rank]
        pf = [figs[p] for p in peers]
        peer_clock = median_or_none([x for p in pf if (x := _f(p.get("clock_sm_avg_mhz"))) is not None])
        peer_temp = median_or_none([x for p in pf if (x := _f(p.get("temp_gpu_peak_c"))) is not None])
        peer_power = median_or_none([x for p in pf if (x := _f(p.get("power_avg_w"))) is not None])
        shares = v.shares[rank]
        loss = evidence or self._loss(rank, v)
        beyond = {} if loss is None else loss["reasons_beyond_peers"]
        lost_to = max(beyond, key=lambda r: beyond[r]) if beyond else None
        lost = None if loss is None else loss["lost_s"]
        why = []
        if lost_to is not None and lost and loss is not None:
            why.append(
                f"lost {_ms(lost)} to {lost_to} ({100 * beyond[lost_to]:.0f}% of the step; clock "
                f"{tel['clock_sm_avg_mhz']:.0f} MHz vs {loss['baseline_clock_mhz']:.0f} MHz, "
                f"{loss['clock_baseline']})"
            )
        elif shares:
            why.append("throttled: " + ", ".join(f"{r} {100 * s:.0f}%" for r, s in shares.items()))
        if tel["temp_gpu_peak_c"] is not None and peer_temp is not None:
            why.append(f"{tel['temp_gpu_peak_c']:.0f} C vs peers' {peer_temp:.0f}")
        if verdict == "masked":
            why.append(
                "who arrived last was the host's doing this step (its peers waited longer for a CPU "
                "than its clock cost it): its device's evidence decides"
            )
        host = run_delay_beyond_peers(rank, peers, timing) if timing else None
        if host is not None and host >= self.cfg.straggler_min_s:  # its times hold this too
            why.append(f"its host also held it: {_ms(host)} more than its peers waiting for a CPU")
        excess_work = v.excess_vs_work(rank)
        steps = self.cfg.straggler_steps
        held = None
        if arr is not None and verdict == "held":
            held = (
                f"arrived last at the step's collectives: its {len(peers)} peer(s) waited "
                f"{_ms(arr.held_s)} for it (median)"
            )
        med: float | None
        staged = v.stage[rank] is not None and (self._num_stages() or 1) > 1
        what = "its stage's peers'" if staged else "its peers'"
        if over:
            worst = max(over, key=lambda m: over[m]["excess"])
            w = over[worst]
            head = (
                f"{worst} {w['value_s']:.4f} s, {100 * w['excess']:+.0f}% over {what} median "
                f"{w['peers_median_s']:.4f} s for {steps} steps" + (f"; {held}" if held else "")
            )
            compared, metric, value, med, excess = (
                "same_stage_peers",
                worst,
                w["value_s"],
                w["peers_median_s"],
                w["excess"],
            )
        elif held is not None and arr is not None:
            comp = v.compute[rank] or 0.0
            head = f"{held}, busy {comp:.4f} s a step computing, for {steps} steps"
            others = [arr.waits[p] for p in peers if p in arr.waits]
            compared, metric, value, med, excess = (
                "arrival",
                "collective_wait_s",
                arr.waits[rank],
                median_or_none(others),
                arr.held_excess,
            )
        elif verdict in ("unmeasured", "masked") and evidence is not None:
            comp = v.compute[rank] or 0.0
            head = (
                f"compute {comp:.4f} s a step at a clock that makes it "
                f"{100 * evidence['clock_excess']:+.0f}% over the same work at the unthrottled clock, "
                f"for {steps} steps"
                + (
                    "; its peers wait for it inside the phases (collectives of tensor / expert "
                    "parallel layers, not marked)"
                    if verdict == "unmeasured"
                    else ""
                )
            )
            compared, metric, value, med, excess = (
                "unthrottled_clock",
                "compute_s",
                comp,
                None,
                evidence["clock_excess"],
            )
        else:
            assert evidence is not None and "peers_pp_wait_s" in evidence
            comp = v.compute[rank] or 0.0
            waits = evidence["peers_pp_wait_s"]
            head = (
                f"busy {comp:.4f} s a step computing while the other stages wait"
                + ("" if waits is None else f" {waits:.4f} s (median)")
                + f", for {steps} steps"
            )
            if excess_work is not None:
                head += f"; {100 * excess_work:+.0f}% over the other stages per unit of the layout's work"
            compared, metric, value, med, excess = (
                "unthrottled_clock",
                "compute_s",
                comp,
                None,
                evidence["clock_excess"],
            )
        message = f"{self.where(rank)} straggles at step {v.step}: {head}" + (
            f"; {'; '.join(why)}" if why else ""
        )
        return {
            "kind": "straggler",
            "severity": "warning",
            "step": v.step,
            **self.who(rank),
            "cause": "device",
            "compared_with": compared,
            "peers": peers,
            "metric": metric,
            "value_s": value,
            "peers_median_s": med,
            "excess": excess,
            "metrics": over,
            "steps": steps,
            "lost_s": lost,
            "lost_to": lost_to,
            "reasons_beyond_peers": beyond,
            "baseline_clock_mhz": None if loss is None else loss["baseline_clock_mhz"],
            "clock_baseline": None if loss is None else loss["clock_baseline"],
            "pp_wait_s": v.wait[rank],
            "peers_pp_wait_s": v.others_wait(rank),
            "timing": verdict,
            "run_delay_beyond_peers_s": host,
            "arrived_last": None if arr is None else arr.last == rank,
            "held_peers_s": arr.held_s if arr is not None and arr.last == rank else None,
            "excess_vs_work": excess_work,
            **tel,
            "throttle_shares": shares,
            "peers_clock_sm_avg_mhz": peer_clock,
            "peers_temp_gpu_peak_c": peer_temp,
            "peers_power_avg_w": peer_power,
            "message": message,
        }
