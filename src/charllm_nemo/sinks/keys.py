"""The metric keys a sink logs per step, and the fixed vector that carries a rank's figures.

Framework-free: plain functions over numbers (no torch, no W&B, no numpy).

Layout (docs/wandb.md has the full table):

* ``trainer/global_step``: the step axis every other key is plotted against; the loop's 0-based
  step, the same number as the ``step`` column of the run directory's windows.
* ``rank/<r>/<figure>``: rank r's telemetry figures of the step window, one per entry of
  :data:`STEP_FIGURE_KEYS` (``rank/3/power_avg_w``, ``rank/3/throttle_hw_thermal_s``, ...), so
  a W&B panel over ``rank/*/power_avg_w`` draws one line per rank.
* ``all/<figure>``: cross-rank aggregates (:func:`aggregate_keys`).
* ``perf/*`` and ``train/*``: throughput, TFLOP/s per GPU, MFU, step time, loss
  (:func:`throughput_keys`).

A figure that is not known (None, NaN, inf) is omitted, never logged as 0.

A rank's figures reach rank 0 as one float64 vector in :data:`STEP_FIGURE_KEYS` order
(:func:`pack_step_figures`; the step API gathers them, charllm_nemo.steps, and
:func:`unpack_gathered` reads them back); NaN marks a figure the rank does not know.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from charllm_nemo.telemetry.schema import THROTTLE_REASONS

STEP_KEY = "trainer/global_step"
"""The custom step axis (W&B ``define_metric`` step_metric)."""

THROTTLE_FIGURES: tuple[str, ...] = (
    *(f"throttle_{name}_s" for name, _ in THROTTLE_REASONS),
    "throttle_any_limiting_s",
)
TRAFFIC_FIGURES: tuple[str, ...] = ("pcie_tx_bytes", "pcie_rx_bytes", "nvlink_tx_bytes", "nvlink_rx_bytes")

STEP_FIGURE_KEYS: tuple[str, ...] = (
    "duration_s",
    "energy_j",
    "power_avg_w",
    "power_peak_w",
    "temp_gpu_peak_c",
    "temp_hbm_peak_c",
    "temp_hotspot_peak_c",
    "clock_sm_avg_mhz",
    "clock_sm_min_mhz",
    *THROTTLE_FIGURES,
    "violation_power_s",
    "violation_thermal_s",
    *TRAFFIC_FIGURES,
)
"""Per-rank figures of one step window, in the order they travel in the gather vector. Every
name is a column of charllm_nemo.telemetry.attribution.ATTRIBUTION_COLUMNS (same unit)."""

# How a rank's devices combine into the rank's figure (a rank usually drives one device; an
# MI250 package or a multi-device rank has more). Energy, power and traffic add up; peaks,
# temperatures and held times take the worst device; the average clock is the devices' mean.
_SUM = frozenset({"energy_j", "power_avg_w", *TRAFFIC_FIGURES})
_MIN = frozenset({"clock_sm_min_mhz"})
_MEAN = frozenset({"clock_sm_avg_mhz"})


def finite(value: Any) -> float | None:
    """``value`` as a float when it is a finite number, else None (None, NaN, inf, bool, text)."""
    if value is None or isinstance(value, (bool, str, bytes)):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _combine(name: str, values: list[float]) -> float:
    if not values:
        return math.nan
    if name in _SUM:
        return math.fsum(values)
    if name in _MIN:
        return min(values)
    if name in _MEAN:
        return math.fsum(values) / len(values)
    return max(values)


def combine_devices(
    rows: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None, names: Sequence[str] = STEP_FIGURE_KEYS
) -> dict[str, float]:
    """One rank's figures from its devices' attribution rows (``TelemetrySession.step_figures``).

    Every key of ``names`` (default :data:`STEP_FIGURE_KEYS`; the training loop's console asks
    for its five, once a step), NaN where no device knows it. ``rows`` None (figures not
    available yet) or empty gives all NaN.
    """
    if rows is None:
        rows = []
    elif isinstance(rows, Mapping):
        rows = [rows]
    if len(rows) == 1:  # one device (one GPU per rank): its own values, as _combine leaves them
        row = rows[0]
        return {name: math.nan if (v := finite(row.get(name))) is None else v for name in names}
    out: dict[str, float] = {}
    for name in names:
        vals = [v for r in rows if (v := finite(r.get(name))) is not None]
        out[name] = _combine(name, vals)
    return out


def pack_step_figures(rows: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None) -> list[float]:
    """The gather vector of one rank: :func:`combine_devices` in :data:`STEP_FIGURE_KEYS` order."""
    figures = combine_devices(rows)
    return [figures[name] for name in STEP_FIGURE_KEYS]


def unpack_step_figures(values: Sequence[float]) -> dict[str, float]:
    """A gather vector back to ``{figure: value}`` (NaN = not known)."""
    if len(values) < len(STEP_FIGURE_KEYS):
        raise ValueError(
            f"a step-figure vector has {len(STEP_FIGURE_KEYS)} values (STEP_FIGURE_KEYS); got {len(values)}"
        )
    return {name: float(v) for name, v in zip(STEP_FIGURE_KEYS, values, strict=False)}


def unpack_gathered(gathered: Sequence[Sequence[float]]) -> list[dict[str, float]]:
    """Rank 0's gathered vectors (index = rank) to one figure dict per rank."""
    return [unpack_step_figures(v) for v in gathered]


def rank_keys(rank: int, figures: Mapping[str, Any]) -> dict[str, float]:
    """``rank/<rank>/<figure>`` for each figure of :data:`STEP_FIGURE_KEYS` that is known."""
    prefix = f"rank/{int(rank)}/"
    out: dict[str, float] = {}
    for name in STEP_FIGURE_KEYS:
        v = finite(figures.get(name))
        if v is not None:
            out[prefix + name] = v
    return out


def _known(per_rank: Sequence[Mapping[str, Any]], name: str) -> list[float]:
    return [v for f in per_rank if (v := finite(f.get(name))) is not None]


def aggregate_keys(per_rank: Sequence[Mapping[str, Any]]) -> dict[str, float | int]:
    """Cross-rank aggregates of one step; ``per_rank[r]`` is rank r's figures.

    ``all/energy_j`` sum over ranks (J); ``all/power_mean_w`` / ``_max_w`` / ``_min_w`` over
    the ranks' average power (W); ``all/power_peak_w`` the highest instant power of any rank;
    ``all/temp_max_c`` the hottest rank's peak GPU temperature and ``all/temp_spread_c`` hottest
    minus coolest rank (°C); ``all/temp_hbm_max_c``; ``all/clock_sm_mean_mhz``;
    ``all/ranks_throttled`` ranks with ``throttle_any_limiting_s > 0``; ``all/throttle_max_s``
    and ``all/throttle_share`` (the largest fraction of a rank's step window under a limiting
    throttle reason); traffic sums ``all/pcie_tx_bytes`` ...; ``all/ranks_reporting`` ranks
    with a known energy. Each aggregate is over the ranks that know the figure and is omitted
    when none does (``all/ranks_reporting`` is always there).
    """
    out: dict[str, float | int] = {}
    energy = _known(per_rank, "energy_j")
    out["all/ranks_reporting"] = len(energy)
    if energy:
        out["all/energy_j"] = math.fsum(energy)
    power = _known(per_rank, "power_avg_w")
    if power:
        out["all/power_mean_w"] = math.fsum(power) / len(power)
        out["all/power_max_w"] = max(power)
        out["all/power_min_w"] = min(power)
    peak = _known(per_rank, "power_peak_w")
    if peak:
        out["all/power_peak_w"] = max(peak)
    temp = _known(per_rank, "temp_gpu_peak_c")
    if temp:
        out["all/temp_max_c"] = max(temp)
        out["all/temp_spread_c"] = max(temp) - min(temp)
    hbm = _known(per_rank, "temp_hbm_peak_c")
    if hbm:
        out["all/temp_hbm_max_c"] = max(hbm)
    clock = _known(per_rank, "clock_sm_avg_mhz")
    if clock:
        out["all/clock_sm_mean_mhz"] = math.fsum(clock) / len(clock)
    throttle = _known(per_rank, "throttle_any_limiting_s")
    if throttle:
        out["all/ranks_throttled"] = sum(1 for v in throttle if v > 0)
        out["all/throttle_max_s"] = max(throttle)
    shares = [
        t / d
        for f in per_rank
        if (t := finite(f.get("throttle_any_limiting_s"))) is not None
        and (d := finite(f.get("duration_s"))) is not None
        and d > 0
    ]
    if shares:
        out["all/throttle_share"] = max(shares)
    for name in TRAFFIC_FIGURES:
        vals = _known(per_rank, name)
        if vals:
            out[f"all/{name}"] = math.fsum(vals)
    return out


# StepReport field (charllm_nemo.steps.report) -> key.
SUMMARY_KEYS: dict[str, str] = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "step_time_s": "perf/step_time_s",
    "tokens_per_s": "perf/tokens_per_s",
    "samples_per_s": "perf/samples_per_s",
    "model_tflops_per_gpu": "perf/tflops_per_gpu",
    "hardware_tflops_per_gpu": "perf/hw_tflops_per_gpu",
    "mfu": "perf/mfu",
}


def throughput_keys(
    *,
    loss: float | None = None,
    step_time_s: float | None = None,
    tokens_per_s: float | None = None,
    samples_per_s: float | None = None,
    tflops_per_gpu: float | None = None,
    mfu: float | None = None,
    hw_tflops_per_gpu: float | None = None,
    grad_norm: float | None = None,
) -> dict[str, float]:
    """``train/loss``, ``train/grad_norm``, ``perf/step_time_s`` (s, max over ranks),
    ``perf/tokens_per_s``, ``perf/samples_per_s``, ``perf/tflops_per_gpu`` (model TFLOP/s per
    GPU), ``perf/hw_tflops_per_gpu``, ``perf/mfu`` (fraction: 0.45 = 45 %); unknown omitted."""
    return summary_keys(
        {
            "loss": loss,
            "grad_norm": grad_norm,
            "step_time_s": step_time_s,
            "tokens_per_s": tokens_per_s,
            "samples_per_s": samples_per_s,
            "model_tflops_per_gpu": tflops_per_gpu,
            "hardware_tflops_per_gpu": hw_tflops_per_gpu,
            "mfu": mfu,
        }
    )


def summary_keys(summary: Mapping[str, Any]) -> dict[str, float]:
    """:func:`throughput_keys` from a ``StepReport.to_dict()`` (charllm_nemo.steps) or any mapping
    with its field names (:data:`SUMMARY_KEYS`); other fields are ignored."""
    out: dict[str, float] = {}
    for name, key in SUMMARY_KEYS.items():
        v = finite(summary.get(name))
        if v is not None:
            out[key] = v
    return out


def step_metrics(
    step: int,
    *,
    summary: Mapping[str, Any] | None = None,
    per_rank: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, float | int]:
    """Everything a sink logs for one step: the step axis, :func:`summary_keys`, then each
    rank's :func:`rank_keys` (``per_rank[r]`` = rank r) and :func:`aggregate_keys`."""
    out: dict[str, float | int] = {STEP_KEY: int(step)}
    if summary is not None:
        out.update(summary_keys(summary))
    if per_rank is not None:
        for r, figures in enumerate(per_rank):
            out.update(rank_keys(r, figures))
        out.update(aggregate_keys(per_rank))
    return out


class StepKeys:
    """:func:`step_metrics` from raw per-step numbers, with a choice of per-rank keys.

    ``rank_figures``: the per-rank figures to log (default every one of
    :data:`STEP_FIGURE_KEYS`; each costs one key per rank, so a 1024-rank job logs ~27k keys a
    step with all of them). ``rank_every``: per-rank keys every N steps (steps divisible by N);
    the aggregates, throughput and loss are logged every step whatever N is.
    """

    def __init__(self, rank_figures: Sequence[str] | None = None, rank_every: int = 1) -> None:
        figures = tuple(STEP_FIGURE_KEYS if rank_figures is None else rank_figures)
        unknown = [f for f in figures if f not in STEP_FIGURE_KEYS]
        if unknown:
            raise ValueError(f"unknown per-rank figure(s) {unknown}; use names from STEP_FIGURE_KEYS")
        if rank_every < 1:
            raise ValueError(f"rank_every={rank_every} must be >= 1")
        self.rank_figures = figures
        self.rank_every = int(rank_every)

    def __call__(
        self,
        step: int,
        summary: Mapping[str, Any] | None,
        gathered: Sequence[Sequence[float]] | None,
    ) -> dict[str, float | int]:
        """The step's metrics from a summary mapping and rank 0's gathered vectors."""
        out: dict[str, float | int] = {STEP_KEY: int(step)}
        if summary is not None:
            out.update(summary_keys(summary))
        if gathered is not None:
            per_rank = unpack_gathered(gathered)
            if self.rank_figures and step % self.rank_every == 0:
                for r, figures in enumerate(per_rank):
                    prefix = f"rank/{r}/"
                    for name in self.rank_figures:
                        v = finite(figures.get(name))
                        if v is not None:
                            out[prefix + name] = v
            out.update(aggregate_keys(per_rank))
        return out
