"""A pre-launch energy estimate: step time, power and energy per step from the FLOP plan, with a
per-platform model fitted on measured runs.

The model, per platform (one accelerator kind), over what the dry run knows of a configuration:
``x`` = hardware FLOPs per rank per step (metrics/flops.py, recomputation included) times the
pipeline's fill-and-drain factor ``(m + pp - 1) / m`` (m microbatches: the bubble lengthens the
step, not the work):

* step time ``t = s_per_flop x x + step_overhead_s`` (a line: the platform's effective rate, and
  a fixed cost a step: optimizer, gradient reduction, launch);
* busy share ``u = s_per_flop x flops_per_rank / t`` (the share of the step spent computing);
* average power per device ``P = idle_w + (busy_w - idle_w) x u``;
* peak power per device ``peak_ratio x P``, at most the device's power limit where known;
* energy per step ``world x P x t``.

:func:`fit` takes measured runs (:class:`Point`: what ``charllm analyze`` measured of each) and
returns the platform's :class:`Calibration` with its leave-one-out error: each run's energy per
step predicted by a model fitted on the others, ``held_out_error_median`` / ``_max`` the median
and largest relative errors (the error a user should expect on a configuration the table was
not fitted on). The fitted table lives in ``energy_calibration.json`` beside this module and is
refit from a sweep by ``charllm calibrate-energy`` (docs/compare-energy.md).

Plain functions over numbers: no numpy, no framework.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from importlib import resources

from charllm_nemo.errors import ConfigError

TABLE_FILE = "energy_calibration.json"
"""The fitted table, package data of charllm_nemo.metrics."""


@dataclass(frozen=True)
class Point:
    """One measured run: hardware FLOPs per rank per step, ranks, pipeline stages, microbatches
    per step, the measured median step time (s), average and peak power per device (W) and the
    energy per step of all ranks (J)."""

    run: str
    flops_per_rank: float
    world: int
    pp: int
    microbatches: int
    step_s: float
    power_avg_w: float
    power_peak_w: float
    energy_step_j: float


@dataclass(frozen=True)
class Calibration:
    """One platform's fitted model (see the module docstring; units in the names)."""

    platform: str
    s_per_flop: float
    step_overhead_s: float
    idle_w: float
    busy_w: float
    peak_ratio: float
    power_limit_w: float | None
    runs: int
    held_out_error_median: float | None
    held_out_error_max: float | None
    fitted_from: str = ""


@dataclass(frozen=True)
class Estimate:
    """What the model expects of one configuration: step time (s), busy share, average and peak
    power per device (W), energy per step of all ranks (J)."""

    step_s: float
    busy_share: float
    power_avg_w: float
    power_peak_w: float
    energy_step_j: float


def bubble_factor(pp: int, microbatches: int) -> float:
    """The pipeline's fill and drain: a step takes ``(m + pp - 1) / m`` of its compute time."""
    m = max(1, microbatches)
    return (m + max(1, pp) - 1) / m


def estimate(cal: Calibration, flops_per_rank: float, world: int, pp: int, microbatches: int) -> Estimate:
    """The model's figures for one configuration whose pipeline stages hold equal work (see the
    module docstring): :func:`estimate_stages` with every stage at ``flops_per_rank``."""
    stages = max(1, pp)
    return estimate_stages(cal, [flops_per_rank] * stages, world / stages, microbatches)


def estimate_stages(
    cal: Calibration,
    stage_flops_per_rank: Sequence[float],
    ranks_per_stage: float,
    microbatches: int,
    vpp: int | None = None,
) -> Estimate:
    """The model's figures for a layout whose pipeline stages hold different work:
    ``stage_flops_per_rank[s]`` hardware FLOPs per rank of stage ``s`` per step.

    Each stage computes ``c_s = s_per_flop x f_s``. In a 1F1B schedule the slowest stage sets
    the steady state and every other stage adds its share of the fill and drain, one microbatch
    (of ``vpp`` chunks) each: ``t = max c + (sum c - max c) / (m x vpp) + step_overhead_s``; for
    equal stages this is ``c x (m + pp - 1) / m``, the bubble factor. Each stage's devices are
    busy ``c_s / t`` of the step and draw ``idle + (busy - idle) x c_s / t``; the energy is the sum
    over stages of ``ranks_per_stage x power x t``. So [3,1] layers costs more than [2,2]: the
    heavy stage lengthens the step while the light one idles."""
    c = [cal.s_per_flop * f for f in stage_flops_per_rank] or [0.0]
    slowest = max(c)
    chunks = max(1, microbatches) * max(1, vpp or 1)
    step_s = slowest + (math.fsum(c) - slowest) / chunks + cal.step_overhead_s
    busy = [min(1.0, x / step_s) if step_s > 0 else 0.0 for x in c]
    power = [cal.idle_w + (cal.busy_w - cal.idle_w) * u for u in busy]
    peak = max(cal.peak_ratio * p for p in power)
    if cal.power_limit_w is not None:
        peak = min(peak, cal.power_limit_w)
    energy = ranks_per_stage * math.fsum(p * step_s for p in power)
    return Estimate(step_s, statistics.fmean(busy), statistics.fmean(power), peak, energy)


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept); through the origin when the xs do not vary."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    if len(xs) < 2 or sxx <= 1e-12 * max(1.0, mx * mx) * len(xs):
        slope = statistics.median(y / x for x, y in zip(xs, ys, strict=True) if x > 0) if mx > 0 else 0.0
        return slope, 0.0
    slope = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return slope, my - slope * mx


def _fit_only(platform: str, points: Sequence[Point], power_limit_w: float | None) -> Calibration:
    xs = [p.flops_per_rank * bubble_factor(p.pp, p.microbatches) for p in points]
    slope, overhead = _line(xs, [p.step_s for p in points])
    if slope <= 0 or overhead < 0:  # noise on a few runs: keep the model physical
        slope = statistics.median(p.step_s / x for p, x in zip(points, xs, strict=True) if x > 0)
        overhead = 0.0
    busy = [min(1.0, slope * p.flops_per_rank / p.step_s) for p in points]
    power_slope, idle = _line(busy, [p.power_avg_w for p in points])
    busy_w = idle + power_slope
    if idle < 0 or busy_w < 0 or power_slope == 0:
        idle = busy_w = statistics.median(p.power_avg_w for p in points)
    ratio = statistics.median(p.power_peak_w / p.power_avg_w for p in points if p.power_avg_w > 0)
    return Calibration(platform, slope, overhead, idle, busy_w, ratio, power_limit_w, len(points), None, None)


def fit(
    platform: str, points: Sequence[Point], power_limit_w: float | None = None, fitted_from: str = ""
) -> Calibration:
    """The platform's model fitted on ``points`` (at least 2 runs), with its leave-one-out error
    on the energy per step (needs 3 runs or more; None below). ConfigError on too few runs."""
    good = [
        p
        for p in points
        if all(
            math.isfinite(v) and v > 0 for v in (p.flops_per_rank, p.step_s, p.power_avg_w, p.energy_step_j)
        )
    ]
    if len(good) < 2:
        raise ConfigError(
            f"platform {platform!r}: {len(good)} usable run(s); a fit needs 2 or more runs with step "
            "time, FLOPs, power and energy (give a sweep with several configurations)"
        )
    errors = []
    if len(good) >= 3:
        for i, held in enumerate(good):
            cal = _fit_only(platform, good[:i] + good[i + 1 :], power_limit_w)
            e = estimate(cal, held.flops_per_rank, held.world, held.pp, held.microbatches)
            errors.append(abs(e.energy_step_j - held.energy_step_j) / held.energy_step_j)
    cal = _fit_only(platform, good, power_limit_w)
    return Calibration(
        **{
            **asdict(cal),
            "held_out_error_median": statistics.median(errors) if errors else None,
            "held_out_error_max": max(errors) if errors else None,
            "fitted_from": fitted_from,
        }
    )


def load_table(text: str | None = None) -> dict[str, Calibration]:
    """The fitted table (``text``: its JSON; default the package's own file), platform -> model."""
    if text is None:
        text = resources.files("charllm_nemo.metrics").joinpath(TABLE_FILE).read_text(encoding="utf-8")
    data = json.loads(text)
    names = {f.name for f in fields(Calibration)}
    out = {}
    for platform, entry in data.get("platforms", {}).items():
        if isinstance(entry, dict) and names <= set(entry):
            out[platform] = Calibration(**{k: entry[k] for k in names})
    return out


def dump_table(table: dict[str, Calibration]) -> str:
    """The table as the JSON :func:`load_table` reads (sorted, one platform an entry)."""
    return json.dumps({"platforms": {k: asdict(table[k]) for k in sorted(table)}}, indent=1) + "\n"


def platform_for(table: dict[str, Calibration], name: str | None, on_cpu: bool) -> Calibration | None:
    """The table's entry for ``name`` (exact, else the one entry whose name contains it,
    case-insensitively); on a CPU run without a name, the synthetic device's."""
    if name is None:
        if not on_cpu:
            return None
        name = "synthetic"
    if name in table:
        return table[name]
    hits = [v for k, v in table.items() if name.lower() in k.lower()]
    return hits[0] if len(hits) == 1 else None
