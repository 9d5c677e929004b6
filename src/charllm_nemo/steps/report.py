"""One step over all ranks (:class:`StepReport`), and the one vector per rank that carries it.

Each rank sends, once a step, one float64 vector (:func:`pack_rank_vector`): its loss terms, its
step time and the telemetry figures of an earlier step (the one due; charllm_nemo.steps.telemetry
says which) in :data:`~charllm_nemo.telemetry.rank_vector.STEP_FIGURE_KEYS` order, NaN where unknown.
Every rank receives every vector (one ``all_gather``: all ranks must agree on the step time,
which decides how late figures are reported); rank 0 turns them into the step's report
(:func:`combine_rank_vectors`). Framework-free: plain floats, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from charllm_nemo.steps.host import HOST_FIELDS
from charllm_nemo.steps.marks import PHASE_GROUPS
from charllm_nemo.telemetry.figures import RANK_FIGURES, combine, finite_or_none
from charllm_nemo.telemetry.rank_vector import STEP_FIGURE_COLUMNS, STEP_FIGURE_KEYS, combine_devices

HEAD_FIELDS: tuple[str, ...] = ("loss_sum", "loss_tokens", "loss", "loss_count", "step_time_s")
"""The first entries of a rank's vector: ``loss_sum`` / ``loss_tokens`` (a summed token loss and
its token count, 0 where the rank has none), ``loss`` / ``loss_count`` (an already averaged loss
and 1, or 0 and 0), the rank's own ``step_time_s`` of the step that just ended; then
:data:`RANK_TIMING_FIELDS` and :data:`STEP_FIGURE_KEYS` of the step being reported."""
RANK_TIMING_FIELDS: tuple[str, ...] = ("step_time_s", *PHASE_GROUPS, *HOST_FIELDS)
"""The rank's own timing of the step being reported (s): its step window, its phase time by
group, and how much its host's CPUs held it back since its previous step
(:data:`~charllm_nemo.steps.host.HOST_FIELDS`; all NaN unless its StepTelemetry sums phases:
``phase_times=True``, which alerts ask for).
Held on each rank until the step's figures are due, so one row holds one step."""
HEALTH_FIELDS: tuple[str, ...] = ("sampler_deadlines_missed", "sampler_nulls", "sampler_stopped")
"""The rank's sampler health when it sent the vector (NaN unless its StepTelemetry was made with
``phase_times=True``, as alerts do): deadlines missed and null readings of supported metrics so
far (counts), and 1 when its sampler stopped (a device lost, an error), else 0."""
VECTOR_WIDTH = len(HEAD_FIELDS) + len(RANK_TIMING_FIELDS) + len(HEALTH_FIELDS) + len(STEP_FIGURE_KEYS)
_TIM0 = len(HEAD_FIELDS)
_HEA0 = _TIM0 + len(RANK_TIMING_FIELDS)
_FIG0 = _HEA0 + len(HEALTH_FIELDS)
_ENERGY = _FIG0 + STEP_FIGURE_KEYS.index("energy_j")
_THROTTLE = _FIG0 + STEP_FIGURE_KEYS.index("throttle_any_limiting_s")
_REPORTED = tuple((_FIG0 + i, f) for i, f in enumerate(RANK_FIGURES) if f.report is not None)
"""(vector index, figure) of every rank figure the report combines over ranks."""


@dataclass
class StepReport:
    """One training step over all ranks, as rank 0's observers receive it.

    ``loss``: the step's loss (token-weighted over the ranks that sent summed terms, else the
    mean of the ranks that sent one; None when none did). ``step_time_s``: the slowest rank's
    step (s). Rates (:class:`~charllm_nemo.steps.rates.StepRates`): ``tokens_per_s``,
    ``samples_per_s``, ``model_tflops_per_gpu`` / ``hardware_tflops_per_gpu`` (TFLOP/s per rank),
    ``mfu`` (fraction of the peak; None when the peak is unknown) counted with
    ``mfu_attention`` (``full`` | ``causal``: how attention FLOPs are counted). Telemetry over
    the ranks that reported it (``ranks_reporting``): ``energy_j`` (J, summed), ``power_avg_w``
    (W, mean of the ranks' averages), ``power_peak_w`` (W, max), ``temp_gpu_peak_c`` (°C, max),
    ``throttle_share`` (max over ranks of the time a limiting throttle reason was set / step
    time); the others in :attr:`figures`; ``sampling_gap`` (True when a rank's samples left
    part of the step uncovered, ``coverage`` < 1). Telemetry fields stay None until the step's
    figures are due. ``rank_vectors``: every rank's figures as gathered (index = rank;
    :attr:`per_rank` reads them as dicts).
    """

    step: int
    loss: float | None
    step_time_s: float
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    model_tflops_per_gpu: float | None = None
    hardware_tflops_per_gpu: float | None = None
    mfu: float | None = None
    mfu_attention: str | None = None
    energy_j: float | None = None
    power_avg_w: float | None = None
    power_peak_w: float | None = None
    temp_gpu_peak_c: float | None = None
    throttle_share: float | None = None
    sampling_gap: bool | None = None
    ranks_reporting: int = 0
    num_microbatches: int | None = None
    figures: dict[str, float | None] = field(default_factory=dict)
    """The cross-rank figures of charllm_nemo.telemetry.figures ``RANK_FIGURES`` with no field of
    their own here (``coverage``, ``gap_max_s``): written beside the fields."""
    rank_vectors: list[list[float]] | None = field(default=None, repr=False)

    @property
    def per_rank(self) -> list[dict[str, float]]:
        """Every rank's telemetry figures of this step (index = rank; NaN = not known), by
        :data:`STEP_FIGURE_KEYS` name; empty until they are due."""
        if not self.rank_vectors:
            return []
        return [dict(zip(STEP_FIGURE_KEYS, row[_FIG0:], strict=True)) for row in self.rank_vectors]

    @property
    def per_rank_timing(self) -> list[dict[str, float]]:
        """Every rank's own timing of this step (index = rank), by :data:`RANK_TIMING_FIELDS`
        name (s; NaN = not known); empty until the step's figures are due."""
        if not self.rank_vectors:
            return []
        return [dict(zip(RANK_TIMING_FIELDS, row[_TIM0:_HEA0], strict=True)) for row in self.rank_vectors]

    @property
    def per_rank_health(self) -> list[dict[str, float]]:
        """Every rank's sampler health (index = rank), by :data:`HEALTH_FIELDS` name (NaN = not
        sent); empty until the step's figures are due."""
        if not self.rank_vectors:
            return []
        return [dict(zip(HEALTH_FIELDS, row[_HEA0:_FIG0], strict=True)) for row in self.rank_vectors]

    def figure_rows(self) -> list[list[float]] | None:
        """Every rank's figures as lists in :data:`STEP_FIGURE_KEYS` order (what
        ``AsyncSink.log_figures`` takes as ``gathered``), None until they are due."""
        if not self.rank_vectors:
            return None
        return [row[_FIG0:] for row in self.rank_vectors]

    def to_dict(self, *, per_rank: bool = False) -> dict[str, Any]:
        """The report as a flat dict (steps.jsonl / summary.json rows: docs/store.md); with
        ``per_rank`` also ``per_rank``: the list of every rank's figures."""
        out = asdict(self)
        del out["rank_vectors"]
        figures = out.pop("figures")
        out.update((name, figures.get(name)) for name in _EXTRA_FIGURES)
        if per_rank:
            out["per_rank"] = self.per_rank
        return out


def pack_rank_vector(
    *,
    loss_sum: float = 0.0,
    loss_tokens: float = 0.0,
    loss: float | None = None,
    step_time_s: float = 0.0,
    figures: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None = None,
    timing: Sequence[float] | None = None,
    health: Sequence[float] | None = None,
) -> list[float]:
    """This rank's vector: :data:`HEAD_FIELDS`, its ``timing`` of the reported step
    (:data:`RANK_TIMING_FIELDS` values; None = not known, NaN), its sampler ``health``
    (:data:`HEALTH_FIELDS`; None: NaN), then its devices' figures
    combined (:func:`~charllm_nemo.telemetry.rank_vector.combine_devices`; ``figures`` None = not known,
    all NaN). A ``loss`` that is not a finite number counts as none."""
    value = math.nan if loss is None else float(loss)
    has_loss = math.isfinite(value)
    head = [float(loss_sum), float(loss_tokens), value if has_loss else 0.0, 1.0 if has_loss else 0.0]
    head.append(float(step_time_s))
    if timing is None:
        head.extend([math.nan] * len(RANK_TIMING_FIELDS))
    else:
        head.extend(float(v) for v in timing)
        head.extend([math.nan] * (len(RANK_TIMING_FIELDS) - len(timing)))
    head.extend([math.nan] * len(HEALTH_FIELDS) if health is None else [float(v) for v in health])
    if figures is None:
        return head + [math.nan] * len(STEP_FIGURE_KEYS)
    one = figures if isinstance(figures, Mapping) else figures[0] if len(figures) == 1 else None
    if one is not None:  # one device (one GPU a rank): its own values, as combine_devices leaves them
        get = one.get
        head.extend(v if type(v := get(c)) is float and v - v == 0 else _nan_or(v) for c in _COLUMNS)
        return head
    combined = combine_devices(figures)
    return head + [combined[name] for name in STEP_FIGURE_KEYS]


_COLUMNS = tuple(STEP_FIGURE_COLUMNS[name] for name in STEP_FIGURE_KEYS)
"""The attribution column of each figure of the vector, in :data:`STEP_FIGURE_KEYS` order."""


def _nan_or(value: Any) -> float:
    v = finite_or_none(value)
    return math.nan if v is None else v


@dataclass(frozen=True)
class StepHead:
    """What every rank learns from a step's vectors: the loss (None: no rank had one) and the
    slowest rank's step time (s)."""

    loss: float | None
    step_time_s: float


def combine_head(rows: Sequence[Sequence[float]]) -> StepHead:
    """The loss and the step time (max over ranks) from every rank's vector."""
    tokens = math.fsum(r[1] for r in rows)
    if tokens > 0:
        loss: float | None = math.fsum(r[0] for r in rows) / tokens
    else:
        count = math.fsum(r[3] for r in rows)
        loss = math.fsum(r[2] for r in rows) / count if count > 0 else None
    return StepHead(loss, max(r[4] for r in rows))


_OWN_FIELDS = frozenset(f.name for f in fields(StepReport))
_EXTRA_FIGURES = tuple(f.name for _, f in _REPORTED if f.name not in _OWN_FIELDS)


def apply_rank_figures(report: StepReport, rows: Sequence[Sequence[float]]) -> None:
    """Put the ranks' telemetry figures (every rank's vector) into ``report``: each figure of
    ``RANK_FIGURES`` with a ``report`` rule combined over the ranks that know it (energy only
    over the ranks that know their energy: ``ranks_reporting``), ``throttle_share`` the largest
    limiting-throttle time over the step time, ``sampling_gap`` from ``coverage``."""
    report.ranks_reporting = sum(1 for r in rows if math.isfinite(r[_ENERGY]))
    report.rank_vectors = [list(r) for r in rows]
    for i, fig in _REPORTED:
        assert fig.report is not None
        value = combine(fig.report, [r[i] for r in rows if math.isfinite(r[i])])
        if fig.name in _OWN_FIELDS:
            setattr(report, fig.name, value)
        else:
            report.figures[fig.name] = value
    throttle = [r[_THROTTLE] for r in rows if math.isfinite(r[_THROTTLE])]
    report.throttle_share = (
        max(throttle) / report.step_time_s if throttle and report.step_time_s > 0 else None
    )
    coverage = report.figures.get("coverage")
    report.sampling_gap = None if coverage is None else coverage < 1.0
