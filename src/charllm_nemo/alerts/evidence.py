"""One step's figures arranged for comparing ranks like with like (docs/alerts.md, "Pipelines").

:class:`StepView` holds, per rank, its compute time, pipeline stage, peer group (the ranks doing
the same work: its stage's ranks), throttle shares, clock and pipeline wait, and answers the
questions the alerts ask in O(log n) a rank (sorted lists, one median left out): the unthrottled
clock of its device model, the throttle reasons it has beyond the other ranks, the time it lost
to a lower clock, its compute against the work the layout gives its stage. Plain numbers.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from charllm_nemo.alerts.stages import StageLayout
from charllm_nemo.devices.contract import LIMITING_REASONS
from charllm_nemo.telemetry.figures import finite_or_none

ALL_REASON_KEYS: tuple[tuple[str, str], ...] = tuple((r, f"throttle_{r}_s") for r in LIMITING_REASONS)

finite = finite_or_none  # the one copy (telemetry/figures.py), under the name the alerts read it by


def median_or_none(xs: Sequence[float]) -> float | None:
    """The median of ``xs``; None for none (no peer to compare with)."""
    return statistics.median(xs) if xs else None


def ms_text(s: float) -> str:
    """``s`` seconds in milliseconds for an alert's message: whole ones from 10 ms, tenths below."""
    return f"{1e3 * s:.0f} ms" if s >= 0.01 else f"{1e3 * s:.1f} ms"


def median_without(ordered: list[float], v: float | None) -> float | None:
    """The median of ``ordered`` (sorted) with one occurrence of ``v`` left out (``v`` None or
    not in it: nothing left out): a rank's peers' median in O(log n), not a new list per rank."""
    i = -1 if v is None else bisect.bisect_left(ordered, v)
    if i < 0 or i >= len(ordered) or ordered[i] != v:
        return median_or_none(ordered)
    m = len(ordered) - 1
    if m <= 0:
        return None

    def at(k: int) -> float:  # position k of the list without position i
        return ordered[k] if k < i else ordered[k + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def compute_s(t: Mapping[str, float]) -> float | None:
    """Forward + backward + optimizer phase time, s (None when none is known)."""
    parts = [v for k in ("forward_s", "backward_s", "optimizer_s") if (v := finite(t.get(k))) is not None]
    return math.fsum(parts) if parts else None


@dataclass
class StepView:
    """One step's per-rank vectors (index = rank) and sorted copies for the peers' medians.

    ``group[r]``: ranks with equal keys do the same work (the same pipeline stage; every rank
    alike outside a pipeline; each rank alone in a pipeline whose stages are unknown).
    ``throttled[r]``: an alerting reason held for at least the configured share of the step."""

    step: int
    compute: list[float | None]
    stage: list[int | None]
    group: list[Hashable]
    throttled: list[bool]
    shares: list[dict[str, float]]  # every limiting reason's share of the step window
    clock: list[float | None]
    wait: list[float | None]
    device: list[Any]  # the device model (name) of each rank: clocks compare within one
    members: dict[Hashable, list[int]] = field(default_factory=dict)
    clocks_unthrottled: dict[Any, list[float]] = field(default_factory=dict)  # sorted, per device model
    _reasons: dict[str, list[float]] = field(default_factory=dict)
    _waits: list[float] = field(default_factory=list)
    _norm: list[float] = field(default_factory=list)
    _norm_of: list[float | None] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        step: int,
        figs: Sequence[Mapping[str, float]],
        timing: Sequence[Mapping[str, float]],
        stage: list[int | None],
        device: list[Any],
        alerting: Sequence[tuple[str, str]],
        min_share: float,
        layout: StageLayout | None,
    ) -> StepView:
        n = len(figs)
        timing = timing or [{}] * n
        compute = [compute_s(t) for t in timing]
        wait = [finite(t.get("pp_wait_s")) for t in timing]
        if any(s is not None for s in stage):
            group: list[Hashable] = [
                ("stage", s) if s is not None else ("rank", r) for r, s in enumerate(stage)
            ]
        elif any(w for w in wait):  # a pipeline whose stages nobody told: no rank's work is known alike
            group = [("rank", r) for r in range(n)]
        else:
            group = [("all",)] * n
        shares: list[dict[str, float]] = []
        for f, t in zip(figs, timing, strict=False):
            d = finite(f.get("duration_s")) or finite(t.get("step_time_s"))
            row: dict[str, float] = {}
            if d:
                for reason, key in ALL_REASON_KEYS:
                    held = finite(f.get(key))
                    if held is not None and held > 0:
                        row[reason] = min(1.0, held / d)
            shares.append(row)
        throttled = [max((s.get(a, 0.0) for a, _ in alerting), default=0.0) >= min_share for s in shares]
        clock = [finite(f.get("clock_sm_avg_mhz")) for f in figs]
        v = cls(step, compute, stage, group, throttled, shares, clock, wait, device)
        for r, g in enumerate(group):
            v.members.setdefault(g, []).append(r)
        for r, c in enumerate(clock):
            if c is not None and not throttled[r]:
                v.clocks_unthrottled.setdefault(device[r], []).append(c)
        for lst in v.clocks_unthrottled.values():
            lst.sort()
        for reason, _ in ALL_REASON_KEYS:
            v._reasons[reason] = sorted(s.get(reason, 0.0) for s in shares)
        v._waits = sorted(w for w in wait if w is not None)
        v._norm_of = [None] * n
        if layout is not None and layout.work is not None:
            for r in range(n):
                s_r, c_r = stage[r], compute[r]
                share = None if s_r is None else layout.work_share(s_r)
                if share and c_r is not None:
                    v._norm_of[r] = c_r / share
            v._norm = sorted(x for x in v._norm_of if x is not None)
        return v

    def peers(self, rank: int) -> list[int]:
        """The other ranks doing the same work as ``rank`` this step."""
        return [r for r in self.members[self.group[rank]] if r != rank]

    def unthrottled_clock(self, rank: int) -> float | None:
        """The median average SM clock of the other ranks with the same device model and no
        alerting throttle reason this step, MHz (None: there are none)."""
        ordered = self.clocks_unthrottled.get(self.device[rank], [])
        return median_without(ordered, None if self.throttled[rank] else self.clock[rank])

    def reasons_beyond_others(self, rank: int, min_share: float) -> dict[str, float]:
        """The limiting reasons whose share of ``rank``'s step exceeds the other ranks' median
        share of the same reason by at least ``min_share``: {reason: its share}."""
        out = {}
        for reason, mine in self.shares[rank].items():
            others = median_without(self._reasons[reason], mine) or 0.0
            if mine - others >= min_share:
                out[reason] = mine
        return out

    def others_wait(self, rank: int) -> float | None:
        """The other ranks' median pipeline wait (send / receive) this step, s."""
        return median_without(self._waits, self.wait[rank])

    def excess_vs_work(self, rank: int) -> float | None:
        """``rank``'s compute per unit of the work its stage is given, over the other ranks'
        median of the same, minus 1 (None without the layout's work)."""
        mine = self._norm_of[rank] if self._norm_of else None
        if mine is None:
            return None
        med = median_without(self._norm, mine)
        return mine / med - 1 if med else None
