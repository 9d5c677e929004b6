"""The metric keys a sink logs per step.

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
:func:`unpack_gathered` reads them back); NaN marks a figure the rank does not know. That layout
is the figure table's (telemetry/rank_vector.py); it is named here too for the sinks' readers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from charllm_nemo.telemetry.figures import RANK_FIGURES, aggregate, wandb_step_keys
from charllm_nemo.telemetry.figures import (
    finite_or_none as finite,  # re-exported to the W&B sink under its old name
)
from charllm_nemo.telemetry.rank_vector import (
    STEP_FIGURE_COLUMNS,
    STEP_FIGURE_KEYS,
    THROTTLE_FIGURES,
    TRAFFIC_FIGURES,
    combine_devices,
    pack_step_figures,
    unpack_gathered,
    unpack_step_figures,
)

__all__ = [
    "STEP_FIGURE_COLUMNS",
    "STEP_FIGURE_KEYS",
    "STEP_KEY",
    "SUMMARY_KEYS",
    "THROTTLE_FIGURES",
    "TRAFFIC_FIGURES",
    "StepKeys",
    "aggregate_keys",
    "combine_devices",
    "finite",
    "pack_step_figures",
    "rank_keys",
    "step_metrics",
    "summary_keys",
    "throughput_keys",
    "unpack_gathered",
    "unpack_step_figures",
]

STEP_KEY = "trainer/global_step"
"""The custom step axis (W&B ``define_metric`` step_metric)."""


def rank_keys(rank: int, figures: Mapping[str, Any]) -> dict[str, float]:
    """``rank/<rank>/<figure>`` for each figure of :data:`STEP_FIGURE_KEYS` that is known."""
    prefix = f"rank/{int(rank)}/"
    out: dict[str, float] = {}
    for name in STEP_FIGURE_KEYS:
        v = finite(figures.get(name))
        if v is not None:
            out[prefix + name] = v
    return out


def aggregate_keys(per_rank: Sequence[Mapping[str, Any]]) -> dict[str, float | int]:
    """Cross-rank aggregates of one step (``all/*``); ``per_rank[r]`` is rank r's figures.

    Each figure's ``aggregates`` in charllm_nemo.telemetry.figures ``RANK_FIGURES`` (docs/wandb.md
    lists them): over the ranks that know the figure, omitted when none does
    (``all/ranks_reporting``, a count, is always there)."""
    out: dict[str, float | int] = {}
    durations = [finite(f.get("duration_s")) for f in per_rank]
    for fig in RANK_FIGURES:
        if not fig.aggregates:
            continue
        pairs = [
            (v, d)
            for f, d in zip(per_rank, durations, strict=True)
            if (v := finite(f.get(fig.name))) is not None
        ]
        values = [v for v, _ in pairs]
        for key, how in fig.aggregates:
            value = aggregate(how, values, [d for _, d in pairs])
            if value is not None:
                out[key] = value
    return out


# StepReport field (charllm_nemo.steps.report) -> key.
SUMMARY_KEYS: dict[str, str] = wandb_step_keys()


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
