"""Culprit or victim: which rank of a group held the others this step, and why (docs/alerts.md).

In data, tensor and expert parallel layouts the ranks of a group meet at collectives; the rank
that arrives last holds the others, who wait. A timing comparison of phases blames whoever has
the longest phase, which is often the rank that *waits* (its phase holds the collective's wait,
or its step holds the gradient all-reduce's). Three plain decisions here, each over one step's
numbers:

* :func:`arrival`: from each rank's time at the collectives the step marks (the gradient
  all-reduce ``grad_sync_s`` and pipeline send / receive ``pp_wait_s``), who arrived last (it
  waited least: an all-reduce releases every rank at once, so each rank's wait is the last
  arrival's lateness over its own, whatever the ranks' clocks) and how long the others waited for
  it. No verdict when the waits are unknown or equal within the noise (collectives inside the
  phases, as tensor and expert parallel layers have them, are not marked).
* :func:`timing_verdict`: what the timing says of one rank: it ``held`` its peers, it ``waited``
  for another, its compute is ``over`` its peers' (only where the waits give no verdict), or
  ``none``; where the layout puts collectives inside the phases, always ``unmeasured``.
* :func:`host_verdict`: for a rank that held its peers with its device running like theirs,
  whether the host's CPUs were contended (steps/host.py: PSI, run-queue delay, steal), and the
  facts that say so; None when nothing shows it (the alert is then held, not guessed).
* :func:`host_masks`: whether the host held a throttled rank's peers back longer than its
  device cost it, so that the step's timing can show nothing either way and the device's
  evidence decides (on a busy host the run queue, hundreds of ms, decides who arrives last
  more than a clock 20 % low does).
* :func:`throttle_cost`: a throttled rank's cost against the first baseline that exists, never
  negative.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from charllm_nemo.alerts.evidence import finite

VERDICTS: tuple[str, ...] = ("held", "waited", "over", "unmeasured", "none")
"""What :func:`timing_verdict` may say of a rank (the detector adds ``masked``: a step whose
arrival the host decided, :func:`host_masks`)."""


@dataclass(frozen=True)
class Arrival:
    """One group's arrival at the step's marked collectives. ``order``: its ranks, first to
    arrive (waited most) to last; ``waits``: each rank's wait (s); ``held_s``: the other ranks'
    median wait beyond the last one's (s); ``held_excess``: ``held_s`` over the other ranks'
    median compute (how much longer the last rank's work made theirs); ``compute``: each
    rank's compute (s, where known)."""

    order: tuple[int, ...]
    waits: dict[int, float]
    held_s: float
    held_excess: float
    compute: dict[int, float]

    @property
    def last(self) -> int:
        return self.order[-1]

    def waited_s(self, rank: int) -> float:
        """How long ``rank`` waited beyond the last arrival (s; 0 for the last)."""
        return self.waits[rank] - self.waits[self.last]


def collective_wait(t: Mapping[str, float]) -> float | None:
    """A rank's time at the step's marked collectives (s): gradient syncs and pipeline waits
    (None when the rank does not sum its phases)."""
    g, p = finite(t.get("grad_sync_s")), finite(t.get("pp_wait_s"))
    if g is None and p is None:
        return None
    return (g or 0.0) + (p or 0.0)


def arrival(
    ranks: Sequence[int], wait: Sequence[float | None], compute: Sequence[float | None], min_s: float
) -> Arrival | None:
    """The arrival of ``ranks`` (a group doing the same work) at the step's marked collectives
    (``wait[r]``: rank r's :func:`collective_wait`; ``compute[r]``: its forward + backward +
    optimizer, s). None when a wait is unknown or the waits are within ``min_s`` of each other:
    then the marks cannot tell who was late."""
    if len(ranks) < 2:
        return None
    waits = {r: wait[r] for r in ranks}
    if any(w is None for w in waits.values()):
        return None
    known = {r: float(w) for r, w in waits.items() if w is not None}
    order = tuple(sorted(ranks, key=lambda r: (-known[r], r)))
    last = order[-1]
    if known[order[0]] - known[last] < min_s:
        return None
    others = [r for r in ranks if r != last]
    held = statistics.median(known[r] - known[last] for r in others)
    comp = [c for r in others if (c := compute[r]) is not None and c > 0]
    excess = held / statistics.median(comp) if comp else 0.0
    mine = {r: c for r in ranks if (c := compute[r]) is not None}
    return Arrival(order, known, held, excess, mine)


def timing_verdict(
    rank: int,
    arr: Arrival | None,
    over: bool,
    coupled: bool,
    threshold: float,
    min_s: float,
) -> str:
    """What one step's timing says of ``rank`` (one of :data:`VERDICTS`). ``arr``: its group's
    :func:`arrival`; ``over``: its compute or a phase exceeds its peers' median by ``threshold``
    and ``min_s``; ``coupled``: the layout has collectives inside the phases (tensor, expert or
    context parallel), where phase times hold the waits and say nothing of who was late, and
    the marked collectives' arrival says only who finished the tail after the last collective
    inside the phases (the ranks met there): nothing either."""
    if coupled:
        return "unmeasured"
    if arr is not None:
        if rank == arr.last:
            return "held" if arr.held_s >= min_s and arr.held_excess >= threshold else "none"
        waited, comp = arr.waited_s(rank), arr.compute.get(rank)
        return "waited" if waited >= min_s and comp and waited >= threshold * comp else "none"
    return "over" if over else "none"


def host_verdict(
    rank: int,
    peers: Sequence[int],
    timing: Sequence[Mapping[str, float]],
    held_s: float,
    pressure: float,
    min_s: float,
) -> dict[str, Any] | None:
    """Whether the host's CPUs held ``rank`` back this step, from its :data:`HOST_FIELDS`
    (steps/host.py) and its peers'. Contention when any holds: its training thread waited in
    the run queue at least ``min_s`` and a ``pressure`` share of ``held_s`` (the time its peers
    waited for it) more than its peers' median; some task on its host waited for a CPU at least
    a ``pressure`` share of its step (PSI); the hypervisor took at least that share (steal).
    Returns the facts (every one, None where not known) and ``said`` (the ones that hold, as
    text), or None when none holds or none is known."""
    t = timing[rank]
    step = finite(t.get("step_time_s"))
    delay = finite(t.get("run_delay_s"))
    peer_delays = [d for p in peers if (d := finite(timing[p].get("run_delay_s"))) is not None]
    peers_delay = statistics.median(peer_delays) if peer_delays else None
    psi = finite(t.get("cpu_pressure_s"))
    psi_share = min(1.0, psi / step) if psi is not None and step else None
    steal = finite(t.get("cpu_steal_share"))
    load = finite(t.get("load_1m"))
    said = []
    if delay is not None:
        beyond = delay - (peers_delay or 0.0)
        if beyond >= min_s and beyond >= pressure * held_s:
            said.append(
                f"its training thread waited {1e3 * delay:.0f} ms for a CPU (run queue; its peers' "
                f"median {1e3 * (peers_delay or 0.0):.0f} ms)"
            )
    if psi_share is not None and psi_share >= pressure:
        said.append(f"some task on its host waited for a CPU {100 * psi_share:.0f}% of the step (PSI)")
    if steal is not None and steal >= pressure:
        said.append(f"the hypervisor took {100 * steal:.0f}% of the CPUs (steal)")
    if not said:
        return None
    if load is not None:
        said.append(f"load {load:.1f} per CPU")
    return {
        "run_delay_s": delay,
        "peers_run_delay_s": peers_delay,
        "cpu_pressure_share": psi_share,
        "cpu_steal_share": steal,
        "load_per_cpu": load,
        "said": said,
    }


def host_masks(
    rank: int, peers: Sequence[int], timing: Sequence[Mapping[str, float]], lost_s: float, min_s: float
) -> bool:
    """Whether the host held ``rank``'s peers back (their median run-queue wait beyond its own,
    at least ``min_s``) for at least half of what its device cost it this step (``lost_s``): then
    the step's timing cannot show its device's loss, and its device's evidence decides alone."""
    mine = finite(timing[rank].get("run_delay_s"))
    theirs = [d for p in peers if (d := finite(timing[p].get("run_delay_s"))) is not None]
    if mine is None or not theirs:
        return False
    beyond = statistics.median(theirs) - mine
    return beyond >= min_s and beyond >= 0.5 * lost_s


def run_delay_beyond_peers(
    rank: int, peers: Sequence[int], timing: Sequence[Mapping[str, float]]
) -> float | None:
    """``rank``'s run-queue wait over its peers' median (s; None when not known)."""
    mine = finite(timing[rank].get("run_delay_s"))
    theirs = [d for p in peers if (d := finite(timing[p].get("run_delay_s"))) is not None]
    return None if mine is None or not theirs else mine - statistics.median(theirs)


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def host_alert(
    det: Any,
    v: Any,
    rank: int,
    figs: Sequence[Mapping[str, float]],
    timing: Sequence[Mapping[str, float]],
    over: Mapping[str, Mapping[str, float]],
    arr: Arrival | None,
    alike: bool,
) -> dict[str, Any] | None:
    """For ``rank``, which held its peers ``straggler_steps`` steps in a row with no device
    evidence (charllm_nemo.alerts.straggler.StragglerWatch calls it): the ``host_contention``
    alert where its device runs like its peers' (``alike``) and :func:`host_verdict` finds the
    host's CPUs contended; else None, the verdict held (counted in ``det.held``, the detector's,
    why in ``det.held_last``). Rate-limited per host."""
    cfg = det.cfg
    peers = v.peers(rank)
    if arr is not None and arr.last == rank:
        held_s = arr.held_s
        how = f"arrived last at the step's collectives; its peers waited {1e3 * held_s:.0f} ms"
    else:
        worst = max(over, key=lambda m: over[m]["excess"])
        w = over[worst]
        held_s = w["value_s"] - w["peers_median_s"]
        how = f"{worst} {100 * w['excess']:+.0f}% over its peers' median"
    facts = None
    if alike:
        facts = host_verdict(rank, peers, timing, held_s, cfg.host_pressure, cfg.straggler_min_s)
    if facts is None:
        det.held += 1
        det.held_last = (
            f"rank {rank} held its peers at step {v.step} ({how}) with "
            + (
                "its device like theirs and no host contention seen"
                if alike
                else "its device unlike theirs by less than the straggler threshold"
            )
            + ": the evidence cannot say why"
        )
        return None
    host = det.who(rank)["host"]
    if not det.allow("host_contention", host, v.step):
        return None
    f = figs[rank]
    pf = [figs[p] for p in peers]
    clock, temp = finite(f.get("clock_sm_avg_mhz")), finite(f.get("temp_gpu_peak_c"))
    peer_clock = _med([x for p in pf if (x := finite(p.get("clock_sm_avg_mhz"))) is not None])
    peer_temp = _med([x for p in pf if (x := finite(p.get("temp_gpu_peak_c"))) is not None])
    base = v.unthrottled_clock(rank)
    device = []
    if clock is not None:
        device.append(f"clock {clock:.0f} MHz" + ("" if base is None else f" vs the unthrottled {base:.0f}"))
    if temp is not None and peer_temp is not None:
        device.append(f"{temp:.0f} C vs its peers' {peer_temp:.0f}")
    device.append("no throttle reason beyond its peers'")
    said = facts.pop("said")
    return {
        "kind": "host_contention",
        "severity": "warning",
        "step": v.step,
        **det.who(rank),
        "cause": "host_cpu",
        "peers": peers,
        "held_s": held_s,
        "steps": cfg.straggler_steps,
        "timing": "held" if arr is not None and arr.last == rank else "over",
        **facts,
        "clock_sm_avg_mhz": clock,
        "unthrottled_clock_mhz": base,
        "peers_clock_sm_avg_mhz": peer_clock,
        "temp_gpu_peak_c": temp,
        "peers_temp_gpu_peak_c": peer_temp,
        "message": (
            f"{det.where(rank)} held its peers at step {v.step} for {cfg.straggler_steps} steps ({how}) "
            f"with its device running unthrottled ({', '.join(device)}): not the device; host CPU "
            "contention: " + "; ".join(said)
        ),
    }


def throttle_cost(
    comp: float | None,
    cool: list[float],
    base_comp: float | None,
    base_steps: int,
    loss: Mapping[str, Any] | None,
    clock: float | None,
) -> tuple[str | None, float | None, float | None, float | None, str, str | None]:
    """A throttled rank's cost this step (docs/alerts.md, ``throttle_onset``): ``(baseline,
    baseline_s, cost, lost_s, said, note)``. ``comp``: its compute (s); ``cool``: its
    unthrottled peers' compute (empty where their phases hold waits for it); ``base_comp``: its
    own median unthrottled compute over ``base_steps`` steps; ``loss``: its clock's loss
    (AlertDetector.loss) and ``clock`` its clock (MHz). The first baseline that exists, in the
    order peers, own steps, clock; a timing baseline that makes the cost negative (it measured
    faster: that timing holds the others' waits or the host's noise, not its device) is set
    aside for the clock, and ``note`` says why. Never a negative cost or loss."""
    baseline = ref = cost = lost = note = None
    if comp is not None and cool and statistics.median(cool) > 0:
        baseline, ref = "same_stage_peers", statistics.median(cool)
        said = f"its stage's {len(cool)} unthrottled rank(s)' median compute {ref:.3f} s"
    elif comp is not None and base_comp:
        baseline, ref = "own_unthrottled_steps", base_comp
        said = f"its own median compute {ref:.3f} s over {base_steps} unthrottled steps"
    else:
        said = "no unthrottled baseline yet (no unthrottled peer, own step or clock)"
    if ref is not None and comp is not None:
        cost, lost = comp / ref - 1, comp - ref
        if cost < 0:
            note = (
                f"measured {100 * -cost:.0f}% faster than {said}, which holds the other "
                f"ranks' waits or the host's noise, not its device: cost from the clock instead"
            )
            baseline = ref = cost = lost = None
    if baseline is None and comp is not None and loss is not None:
        baseline = "unthrottled_clock"
        cost, lost = max(0.0, loss["clock_excess"]), loss["lost_s"]
        said = (
            f"the unthrottled clock (its {clock or math.nan:.0f} MHz vs "
            f"{loss['baseline_clock_mhz']:.0f} MHz, {loss['clock_baseline']})"
        )
        if loss["clock_excess"] < 0:
            note = (note + "; " if note else "") + "its clock is not below the unthrottled ranks'"
    elif baseline is None and note is not None:
        said = "no clock baseline"
        note += " (none known: no cost)"
    return baseline, ref, cost, lost, said, note
