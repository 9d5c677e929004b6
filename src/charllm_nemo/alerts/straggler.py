"""Stragglers: which rank slows the ranks that do its work, on what evidence (docs/alerts.md).

:class:`StragglerWatch` is the straggler half of the
:class:`~charllm_nemo.alerts.detect.AlertDetector`, which calls :meth:`StragglerWatch.check` each
step. A rank's time is compared only with the ranks that do the same work (its pipeline stage's):
it straggles on its device's evidence (a limiting reason its peers lack and the clock it cost)
with the timing not against it (alerts/culprit.py says who arrived last at the collectives); a
rank that held its peers with its device like theirs is the host's (``host_contention``) or held.
A rank alone in its stage straggles only on evidence beyond timing (throttle reasons its peers
lack, a clock below the unthrottled ranks', busy while the other stages wait). No I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from charllm_nemo.alerts.config import AlertsConfig
from charllm_nemo.alerts.culprit import (
    Arrival,
    arrival,
    collective_wait,
    host_alert,
    host_masks,
    run_delay_beyond_peers,
    timing_verdict,
)
from charllm_nemo.alerts.evidence import StepView, median_or_none, median_without
from charllm_nemo.alerts.evidence import finite as _f
from charllm_nemo.alerts.evidence import ms_text as _ms

STRAGGLER_METRICS: tuple[str, ...] = ("step_time_s", "compute_s", "forward_s", "backward_s", "optimizer_s")
"""The times a straggler is judged on against its peers: its step, its compute (forward +
backward + optimizer) and each of those phases. Pipeline and gradient-sync waits are not: a long
wait marks a rank that waits for a straggler, not the straggler."""


class Detector(Protocol):
    """What the straggler checks use of the detector (charllm_nemo.alerts.detect.AlertDetector);
    :func:`~charllm_nemo.alerts.culprit.host_alert` also counts its held verdicts there."""

    @property
    def cfg(self) -> AlertsConfig: ...
    @property
    def coupled(self) -> bool: ...

    held: int
    held_last: str | None

    def who(self, rank: int) -> dict[str, Any]: ...
    def where(self, rank: int) -> str: ...
    def allow(self, kind: str, key: Any, step: int) -> bool: ...
    def num_stages(self) -> int | None: ...
    def telemetry(self, f: Mapping[str, float]) -> dict[str, Any]: ...
    def loss(self, rank: int, v: StepView) -> dict[str, Any] | None: ...


class StragglerWatch:
    """The straggler and host-contention alerts of a run (module doc), for ``det``'s ranks: per
    rank, the steps in a row it straggled and those it held its peers with no device evidence
    (both raise their alert at ``straggler_steps``)."""

    def __init__(self, det: Detector) -> None:
        self.det = det
        self._straggling: dict[int, int] = {}
        self._culprit: dict[int, int] = {}  # per rank, steps in a row it held its peers, device alike

    def check(
        self, v: StepView, figs: list[dict[str, float]], timing: list[dict[str, float]]
    ) -> list[dict[str, Any]]:
        """A rank with peers (the same stage) straggles on its device's evidence
        (:meth:`device`) with the timing not against it (it held its peers at the step's
        collectives, or its compute is over theirs, or the collectives sit inside the phases);
        a rank that held its peers with its device like theirs is the host's (host contention)
        or held. A rank alone in its stage on evidence (:meth:`evidence`). docs/alerts.md."""
        cfg, coupled = self.det.cfg, self.det.coupled
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
        device = [self.device(r, v) if len(v.members[v.group[r]]) > 1 else None for r in range(n)]
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
                    if x is None or med is None or med <= 0 or coupled:
                        continue
                    if x > med * thr and x - med >= floor:
                        over[m] = {"value_s": x, "peers_median_s": med, "excess": x / med - 1}
                arr = arrivals[g]
                verdict = timing_verdict(rank, arr, bool(over), coupled, cfg.straggler_threshold, floor)
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
                evidence = self.evidence(rank, v)
            hit = evidence is not None
            count = self._straggling[rank] = self._straggling.get(rank, 0) + 1 if hit else 0
            if count == cfg.straggler_steps and self.det.allow("straggler", rank, v.step):
                out.append(self.alert(v, rank, figs, over, evidence, verdict, arr, timing))
            held = self._culprit[rank] = self._culprit.get(rank, 0) + 1 if culprit else 0
            if held == cfg.straggler_steps:
                alike = self.device_alike(rank, v)
                alert = host_alert(self.det, v, rank, figs, timing, over, arr, alike)
                if alert is not None:
                    out.append(alert)
        return out

    def device(self, rank: int, v: StepView) -> dict[str, Any] | None:
        """The device evidence that ``rank`` is slow: a limiting reason its peers lack (by
        ``throttle_min_share`` of the step) and a clock that makes its compute exceed the
        unthrottled clock's by ``straggler_threshold`` and ``straggler_min_s`` (its loss)."""
        loss = self.det.loss(rank, v)
        cfg = self.det.cfg
        if loss is None or not loss["reasons_beyond_peers"]:
            return None
        if loss["clock_excess"] < cfg.straggler_threshold or loss["lost_s"] < cfg.straggler_min_s:
            return None
        return loss

    def device_alike(self, rank: int, v: StepView) -> bool:
        """``rank``'s device runs like its peers': no limiting reason beyond theirs, and a clock
        (where known) within ``straggler_threshold`` of the unthrottled ranks'."""
        if v.reasons_beyond_others(rank, self.det.cfg.throttle_min_share):
            return False
        c, base = v.clock[rank], v.unthrottled_clock(rank)
        return c is None or base is None or c * (1 + self.det.cfg.straggler_threshold) >= base

    def evidence(self, rank: int, v: StepView) -> dict[str, Any] | None:
        """A rank alone in its stage straggles when all hold: a limiting reason its peers lack
        (by ``throttle_min_share`` of the step), a clock that makes its compute exceed the
        unthrottled clock's by ``straggler_threshold`` and ``straggler_min_s``, and it is busy
        while the other stages wait (its pipeline wait at most theirs)."""
        loss = self.device(rank, v)
        if loss is None:
            return None
        wait, others = v.wait[rank], v.others_wait(rank)
        if wait is not None and others is not None and wait > others:
            return None  # the others do not wait for it: throttled (its own alert), not straggling
        return {**loss, "pp_wait_s": wait, "peers_pp_wait_s": others}

    def alert(
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
        tel = self.det.telemetry(f)
        peers = v.peers(rank) if verdict is not None else [r for r in range(len(figs)) if r != rank]
        pf = [figs[p] for p in peers]
        peer_clock = median_or_none([x for p in pf if (x := _f(p.get("clock_sm_avg_mhz"))) is not None])
        peer_temp = median_or_none([x for p in pf if (x := _f(p.get("temp_gpu_peak_c"))) is not None])
        peer_power = median_or_none([x for p in pf if (x := _f(p.get("power_avg_w"))) is not None])
        shares = v.shares[rank]
        loss = evidence or self.det.loss(rank, v)
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
        if host is not None and host >= self.det.cfg.straggler_min_s:  # its times hold this too
            why.append(f"its host also held it: {_ms(host)} more than its peers waiting for a CPU")
        excess_work = v.excess_vs_work(rank)
        steps = self.det.cfg.straggler_steps
        held = None
        if arr is not None and verdict == "held":
            held = (
                f"arrived last at the step's collectives: its {len(peers)} peer(s) waited "
                f"{_ms(arr.held_s)} for it (median)"
            )
        med: float | None
        staged = v.stage[rank] is not None and (self.det.num_stages() or 1) > 1
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
        else:  # the device's evidence: its clock against the unthrottled clock
            comp = v.compute[rank] or 0.0
            if verdict in ("unmeasured", "masked") and evidence is not None:
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
            else:
                assert evidence is not None and "peers_pp_wait_s" in evidence
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
        message = f"{self.det.where(rank)} straggles at step {v.step}: {head}" + (
            f"; {'; '.join(why)}" if why else ""
        )
        return {
            "kind": "straggler",
            "severity": "warning",
            "step": v.step,
            **self.det.who(rank),
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
