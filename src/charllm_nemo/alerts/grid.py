"""The job's power as the grid sees it, live: an alert when its swing or ramp crosses a limit.

Synchronous training makes every GPU of a job rise and fall together at the iteration period,
and the facility sees the sum (issue #46; docs/alerts.md ``power_swing`` / ``power_ramp``).
Rank 0 gets, per step, each rank's figures (telemetry/figures.py): ``power_swing_w`` (its
devices' highest minus lowest instant power sampled in the step), ``power_ramp_up_w_s`` /
``power_ramp_down_w_s`` (their steepest rise / fall between two consecutive samples) and
``power_peak_w``. From those, per step:

* the job swing ``sum over ranks of (peak - trough)``: an **upper bound** of the job's
  peak-to-trough (``max_t sum P - min_t sum P <= sum (max P - min P)``), equal to it when the
  ranks peak and bottom out together, as data-parallel ranks do; larger when they do not
  (pipeline stages out of phase);
* the job ramp ``sum over ranks of the steepest rise`` (and fall): the job's steepest sampled
  rise if the ranks' steepest rises coincide, an upper bound if not; at the sampling period's
  resolution (an edge faster than one period shows as its change over that period).

A limit is crossed when the figure reaches it in ``power_limit_steps`` of the last
``power_limit_window`` steps (steps whose figures no rank had count as below): one noisy step
does not raise it. No I/O; the detector (alerts/detect.py) calls :meth:`GridWatch.check`.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from charllm_nemo.alerts.config import AlertsConfig
from charllm_nemo.alerts.evidence import finite as _f

GRID_KINDS: tuple[str, ...] = ("power_swing", "power_ramp")
"""The alert kinds of this module."""


@dataclass(frozen=True)
class JobPower:
    """One step's job-level power figures from the ranks' (module doc). W and W/s; ``ranks``:
    how many ranks gave a swing (the sums are over those), ``world``: how many ranks there are."""

    swing_w: float | None
    peak_w: float | None
    ramp_up_w_s: float | None
    ramp_down_w_s: float | None
    ranks: int
    world: int


def _sum(figs: Sequence[Mapping[str, float]], name: str) -> tuple[float | None, int]:
    values = [v for f in figs if (v := _f(f.get(name))) is not None]
    return (sum(values) if values else None), len(values)


def job_power(figs: Sequence[Mapping[str, float]]) -> JobPower:
    """The job's swing, summed peak and ramps of one step from every rank's figures (index =
    rank; NaN or missing = not known)."""
    swing, ranks = _sum(figs, "power_swing_w")
    return JobPower(
        swing_w=swing,
        peak_w=_sum(figs, "power_peak_w")[0],
        ramp_up_w_s=_sum(figs, "power_ramp_up_w_s")[0],
        ramp_down_w_s=_sum(figs, "power_ramp_down_w_s")[0],
        ranks=ranks,
        world=len(figs),
    )


def _w(x: float) -> str:
    for unit, scale in (("MW", 1e6), ("kW", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} W"


class GridWatch:
    """The k-of-n gate and the alerts for the two limits (module doc); one per detector."""

    def __init__(self, cfg: AlertsConfig) -> None:
        self.cfg = cfg
        n = cfg.power_limit_window
        self._swing: deque[float | None] = deque(maxlen=n)  # per step: the figure if at the limit
        self._ramp: deque[float | None] = deque(maxlen=n)

    @property
    def on(self) -> bool:
        return self.cfg.power_swing_limit_w is not None or self.cfg.power_ramp_limit_w_s is not None

    def check(self, allow: Any, step: int, figs: Sequence[Mapping[str, float]]) -> list[dict[str, Any]]:
        """This step's ``power_swing`` / ``power_ramp`` alerts (``allow``: the detector's rate
        limit, ``allow(kind, key, step)``)."""
        if not self.on or not figs:
            return []
        job = job_power(figs)
        out = []
        swing_limit = self.cfg.power_swing_limit_w
        if swing_limit is not None:
            s = job.swing_w
            self._swing.append(s if s is not None and s >= swing_limit else None)
            if self._crossed(self._swing) and allow("power_swing", None, step):
                out.append(self._swing_alert(step, job, swing_limit))
        ramp_limit = self.cfg.power_ramp_limit_w_s
        if ramp_limit is not None:
            up, down = job.ramp_up_w_s, job.ramp_down_w_s
            steepest = max((r for r in (up, down) if r is not None), default=None)
            self._ramp.append(steepest if steepest is not None and steepest >= ramp_limit else None)
            if self._crossed(self._ramp) and allow("power_ramp", None, step):
                out.append(self._ramp_alert(step, job, ramp_limit))
        return out

    def _crossed(self, hits: deque[float | None]) -> bool:
        """This step at the limit, and ``power_limit_steps`` of the last steps in the window."""
        return hits[-1] is not None and sum(h is not None for h in hits) >= self.cfg.power_limit_steps

    def _over(self, hits: deque[float | None]) -> tuple[int, float]:
        over = [h for h in hits if h is not None]
        return len(over), statistics.median(over)

    def _base(self, step: int, job: JobPower, hits: deque[float | None]) -> dict[str, Any]:
        k, median = self._over(hits)
        return {
            "severity": "warning",
            "step": step,
            "rank": None,
            "host": None,
            "local_rank": None,
            "gpu_index": None,
            "gpu_uuid": None,
            "pp_stage": None,
            "steps_over": k,
            "window": len(hits),
            "median_over": median,
            "ranks": job.ranks,
            "world_size": job.world,
            "job_swing_w": job.swing_w,
            "job_peak_w": job.peak_w,
            "job_ramp_up_w_s": job.ramp_up_w_s,
            "job_ramp_down_w_s": job.ramp_down_w_s,
        }

    def _of(self, job: JobPower) -> str:
        return f"{job.ranks}/{job.world} ranks" if job.ranks < job.world else f"all {job.world} ranks"

    def _swing_alert(self, step: int, job: JobPower, limit: float) -> dict[str, Any]:
        a = self._base(step, job, self._swing)
        swing = job.swing_w or 0.0
        share = swing / job.peak_w if job.peak_w else None
        of_peak = "" if share is None else f", {100 * share:.0f}% of the summed peak {_w(job.peak_w or 0.0)}"
        a.update(
            kind="power_swing",
            limit_w=limit,
            basis="sum over ranks of each rank's highest minus lowest instant power sampled in the step",
            swing_share_of_peak=share,
            message=(
                f"job power swing {_w(swing)} at step {step} (limit {_w(limit)}; at or over it in "
                f"{a['steps_over']} of the last {a['window']} steps, median {_w(a['median_over'])}"
                f"{of_peak}): the sum over {self._of(job)} of each rank's peak minus trough sampled "
                "in the step, an upper bound of the job's swing, exact when the ranks peak together"
            ),
        )
        return a

    def _ramp_alert(self, step: int, job: JobPower, limit: float) -> dict[str, Any]:
        a = self._base(step, job, self._ramp)
        up, down = job.ramp_up_w_s or 0.0, job.ramp_down_w_s or 0.0
        direction, ramp = ("up", up) if up >= down else ("down", down)
        a.update(
            kind="power_ramp",
            limit_w_s=limit,
            direction=direction,
            basis="sum over ranks of each rank's steepest change between two consecutive samples in the step",
            message=(
                f"job power ramp {direction} {_w(ramp)}/s at step {step} (limit {_w(limit)}/s; at or "
                f"over it in {a['steps_over']} of the last {a['window']} steps, median "
                f"{_w(a['median_over'])}/s; up {_w(up)}/s, down {_w(down)}/s): the sum over "
                f"{self._of(job)} of each rank's steepest change between consecutive samples, the "
                "job's if their steepest edges coincide, an upper bound if not; at the sampling "
                "period's resolution"
            ),
        )
        return a
