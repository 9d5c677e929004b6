"""The one table of per-step figures: every number a step reports, its unit, how it combines
across a rank's devices and across ranks, and where it appears.

Everything else is derived from :data:`RANK_FIGURES` and :data:`STEP_FIELDS`, never listed again:
the rank vector (telemetry/rank_vector.py ``STEP_FIGURE_KEYS``, ``pack_step_figures``), the
``steps.jsonl`` / ``summary.json`` schema and its reader checks (telemetry/filecheck.py
``STEP_SPEC``, ``SUMMARY_SPEC``'s medians), the medians of ``summary.json``
(train/report.py ``SUMMARY_FIELDS``), the W&B keys (sinks/keys.py), rank 0's console line
(steps/observers.py ``format_report``) and the field lists of docs/store.md and docs/wandb.md
(:func:`docs_tables`; tests/steps/test_figures.py checks the pages hold them). A new figure is
one entry here.

Framework-free and below ``sinks/`` and ``steps/`` in the layer order (docs/architecture.md):
plain data, no numpy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from charllm_nemo.telemetry.schema import THROTTLE_REASONS

Combine = Literal["sum", "mean", "max", "min"]
"""How values of several devices, or of several ranks, become one."""

Aggregate = Literal["sum", "mean", "max", "min", "spread", "count", "count_positive", "max_share"]
"""A W&B ``all/*`` key over the ranks that know the figure: the four :data:`Combine` ones;
``spread`` (max - min), ``count`` (ranks that know it; logged even when 0),
``count_positive`` (ranks with a value > 0), ``max_share`` (the largest value / the rank's own
``duration_s``)."""

Console = Callable[[Mapping[str, Any]], "str | None"]
"""A step's console part from its row (``StepReport.to_dict()`` plus ``world_size``); None:
nothing shown."""

NUMBER: tuple[str, ...] = ("number", "null")


@dataclass(frozen=True)
class RankFigure:
    """A figure every rank reports of its step window, travelling in the rank's vector.

    ``column``: the attribution column it is read from (telemetry/attribution.py
    ``ATTRIBUTION_COLUMNS``; default ``name``); a column the attribution does not have stays
    NaN: unknown, omitted everywhere. ``devices``: how a rank's devices combine.
    ``report``: how the ranks combine into the ``steps.jsonl`` field of the same name (None:
    per rank only). ``median``: ``summary.json`` has ``<name>_median``. ``aggregates``: the W&B
    ``all/<key>`` keys over ranks. ``console``: its part of the step line."""

    name: str
    unit: str
    doc: str
    devices: Combine = "max"
    column: str | None = None
    report: Combine | None = None
    median: bool = False
    aggregates: tuple[tuple[str, Aggregate], ...] = ()
    console: Console | None = None

    @property
    def source(self) -> str:
        return self.column or self.name


@dataclass(frozen=True)
class StepField:
    """A field of a step's report (``StepReport``, a ``steps.jsonl`` line, a ``per_step`` entry).

    ``kinds``: the JSON kinds it may hold (telemetry/filecheck.py's names). ``wandb``: its W&B
    key (None: not logged under its own name). ``median``: ``summary.json`` has
    ``<name>_median``."""

    name: str
    unit: str
    doc: str
    kinds: tuple[str, ...] = NUMBER
    wandb: str | None = None
    median: bool = False
    console: Console | None = None


def _si(v: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.2f}{unit}"
    return f"{v:.1f}"


def _energy(r: Mapping[str, Any]) -> str:
    e, n, world = r.get("energy_j"), r.get("ranks_reporting", 0), r.get("world_size", 1)
    if e is None:
        return "energy n/a"
    bound = r.get("energy_bound_j")
    shown = f"{e:.3g} J" + ("" if bound is None else f" +- {bound:.2g}")
    return shown + ("" if n >= world else f" ({n}/{world} ranks)")


def _power(r: Mapping[str, Any]) -> str | None:
    """``W/GPU avg, peak``; `` (synthetic)`` when the device is the synthetic model (the row's
    ``synthetic``, set by the console line: the power is modelled, not measured)."""
    avg, peak = r.get("power_avg_w"), r.get("power_peak_w")
    shown = "" if peak is None else f"peak {peak:.0f} W"
    model = " (synthetic)" if r.get("synthetic") else ""
    if avg is None:
        return (shown + model) if shown else None
    return f"{avg:.0f} W/GPU avg" + (f", {shown}" if shown else "") + model


def _mfu(r: Mapping[str, Any]) -> str | None:
    if r.get("tokens_per_s") is None:
        return None
    if r.get("mfu") is None:
        return "MFU n/a"
    attn = f" ({r['mfu_attention']} attn)" if r.get("mfu_attention") else ""
    return f"MFU {100 * r['mfu']:.1f}%{attn}"


def _coverage(r: Mapping[str, Any]) -> str | None:
    c = r.get("coverage")
    if c is None or c >= 1:
        return None
    gap = r.get("gap_max_s")
    return f"sampled {100 * c:.0f}%" + ("" if gap is None else f" (gap {gap:.2f} s)")


def _shown(fmt: str, name: str, scale: float = 1.0) -> Console:
    def part(r: Mapping[str, Any]) -> str | None:
        v = r.get(name)
        return None if v is None else fmt.format(v * scale)

    return part


_TRAFFIC = ("pcie_tx_bytes", "pcie_rx_bytes", "nvlink_tx_bytes", "nvlink_rx_bytes")
_THROTTLE = tuple(name for name, _ in THROTTLE_REASONS)

RANK_FIGURES: tuple[RankFigure, ...] = (
    RankFigure("duration_s", "s", "the rank's step window"),
    RankFigure(
        "energy_j",
        "J",
        "energy of the step (counter, else power integral)",
        "sum",
        report="sum",
        median=True,
        aggregates=(("all/energy_j", "sum"), ("all/ranks_reporting", "count")),
        console=_energy,
    ),
    RankFigure(
        "energy_bound_j",
        "J",
        "bound on the step energy's error (docs/attribution.md, Energy bounds); null: no bound",
        "sum",
        report="sum",
        aggregates=(("all/energy_bound_j", "sum"),),
    ),
    RankFigure(
        "power_avg_w",
        "W",
        "mean power (energy / duration)",
        "sum",
        report="mean",
        median=True,
        aggregates=(("all/power_mean_w", "mean"), ("all/power_max_w", "max"), ("all/power_min_w", "min")),
        console=_power,
    ),
    RankFigure(
        "power_peak_w",
        "W",
        "highest instant power sampled in the step (null: no sample inside)",
        report="max",
        median=True,
        aggregates=(("all/power_peak_w", "max"),),
    ),
    RankFigure(
        "power_swing_w",
        "W",
        "highest minus lowest instant power sampled in the step, summed over devices; over ranks: "
        "the job's swing, an upper bound (exact when the ranks peak together; docs/alerts.md)",
        "sum",
        report="sum",
        median=True,
        aggregates=(("all/power_swing_w", "sum"),),
    ),
    RankFigure(
        "power_ramp_up_w_s",
        "W/s",
        "steepest rise of instant power between two consecutive samples in the step, summed over "
        "devices; over ranks: the job's ramp if the ranks' steepest rises coincide",
        "sum",
        report="sum",
    ),
    RankFigure(
        "power_ramp_down_w_s",
        "W/s",
        "steepest fall between two consecutive samples in the step, summed as power_ramp_up_w_s",
        "sum",
        report="sum",
    ),
    RankFigure(
        "temp_gpu_peak_c",
        "°C",
        "peak GPU temperature",
        report="max",
        median=True,
        aggregates=(("all/temp_max_c", "max"), ("all/temp_spread_c", "spread")),
        console=_shown("max {:.0f} C", "temp_gpu_peak_c"),
    ),
    RankFigure("temp_hbm_peak_c", "°C", "peak HBM temperature", aggregates=(("all/temp_hbm_max_c", "max"),)),
    RankFigure("temp_hotspot_peak_c", "°C", "peak hotspot temperature"),
    RankFigure(
        "clock_sm_avg_mhz", "MHz", "mean SM clock", "mean", aggregates=(("all/clock_sm_mean_mhz", "mean"),)
    ),
    RankFigure("clock_sm_min_mhz", "MHz", "lowest SM clock", "min"),
    *(RankFigure(f"throttle_{n}_s", "s", f"time the {n} throttle reason was set") for n in _THROTTLE),
    RankFigure(
        "throttle_any_limiting_s",
        "s",
        "time any limiting reason (power cap, slowdown, thermal, brake, board limit, reliability) was set",
        aggregates=(
            ("all/ranks_throttled", "count_positive"),
            ("all/throttle_max_s", "max"),
            ("all/throttle_share", "max_share"),
        ),
    ),
    RankFigure("violation_power_s", "s", "delta of the driver's power violation counter"),
    RankFigure("violation_thermal_s", "s", "delta of the driver's thermal violation counter"),
    *(
        RankFigure(
            n, "B", f"delta of the {n} counter over the step", "sum", aggregates=((f"all/{n}", "sum"),)
        )
        for n in _TRAFFIC
    ),
    RankFigure(
        "coverage",
        "fraction",
        "share of the step window's time with samples (1: no sampling gap)",
        "min",
        report="min",
        aggregates=(("all/coverage_min", "min"),),
        console=_coverage,
    ),
    RankFigure(
        "gap_max_s",
        "s",
        "longest interval inside the step window without a sample",
        report="max",
        aggregates=(("all/gap_max_s", "max"),),
    ),
)
"""Per-rank figures of one step window, in the order they travel in the rank's vector."""

_HEAD_FIELDS: tuple[StepField, ...] = (
    StepField("step", "", "the loop's 0-based step", ("int",)),
    StepField(
        "loss",
        "",
        "loss over the global batch",
        wandb="train/loss",
        console=lambda r: "loss n/a" if r.get("loss") is None else f"loss {r['loss']:.4f}",
    ),
    StepField("grad_norm", "", "gradient norm", wandb="train/grad_norm"),
    StepField(
        "step_time_s",
        "s",
        "step time, max over ranks",
        wandb="perf/step_time_s",
        median=True,
        console=_shown("{:.1f} ms", "step_time_s", 1e3),
    ),
    StepField(
        "tokens_per_s",
        "1/s",
        "global batch tokens per second",
        wandb="perf/tokens_per_s",
        median=True,
        console=lambda r: None if r.get("tokens_per_s") is None else f"{_si(r['tokens_per_s'])} tok/s",
    ),
    StepField(
        "samples_per_s", "1/s", "global batch samples per second", wandb="perf/samples_per_s", median=True
    ),
    StepField(
        "model_tflops_per_gpu",
        "TFLOP/s",
        "model FLOPs per GPU",
        wandb="perf/tflops_per_gpu",
        median=True,
        console=_shown("{:.3g} TFLOP/s/GPU", "model_tflops_per_gpu"),
    ),
    StepField(
        "hardware_tflops_per_gpu",
        "TFLOP/s",
        "model + recompute FLOPs per GPU",
        wandb="perf/hw_tflops_per_gpu",
        median=True,
    ),
    StepField(
        "mfu",
        "fraction",
        "model TFLOP/s per GPU / peak (absent when the peak is unknown)",
        wandb="perf/mfu",
        median=True,
        console=_mfu,
    ),
    StepField("mfu_attention", "", "how MFU counted attention: full or causal", ("string", "null")),
)
_TAIL_FIELDS: tuple[StepField, ...] = (
    StepField(
        "throttle_share",
        "fraction",
        "max over ranks of the time a limiting throttle reason was set / step time",
        median=True,
        console=_shown("throttle {:.0f}%", "throttle_share", 100),
    ),
    StepField(
        "sampling_gap",
        "",
        "true when a rank's samples left part of the step uncovered (coverage < 1); "
        "null when no rank reported coverage",
        ("bool", "null"),
    ),
    StepField("ranks_reporting", "count", "ranks whose energy is known", ("int", "null")),
    StepField("num_microbatches", "count", "microbatches of the step", ("int", "null")),
)


def step_fields(rank_figures: Sequence[RankFigure]) -> tuple[StepField, ...]:
    """Every field of a step's report, in console order: the head fields, one per rank figure
    with a ``report`` rule, the tail fields."""
    return (
        *_HEAD_FIELDS,
        *(
            StepField(
                f.name, f.unit, f"{f.doc}; {f.report} over ranks", NUMBER, median=f.median, console=f.console
            )
            for f in rank_figures
            if f.report is not None
        ),
        *_TAIL_FIELDS,
    )


STEP_FIELDS: tuple[StepField, ...] = step_fields(RANK_FIGURES)
"""Every field of a step's report: a ``steps.jsonl`` line, a ``per_step`` entry of
``summary.json``."""


# ---- derived ---------------------------------------------------------------------------------
def figure_names() -> tuple[str, ...]:
    """:data:`RANK_FIGURES` names in vector order."""
    return tuple(f.name for f in RANK_FIGURES)


def step_spec() -> dict[str, tuple[str, ...]]:
    """Field -> JSON kinds of a ``steps.jsonl`` line (the reader's checks)."""
    return {f.name: f.kinds for f in STEP_FIELDS}


def median_fields() -> tuple[str, ...]:
    """The fields whose medians ``summary.json`` holds (``<name>_median``)."""
    return tuple(f.name for f in STEP_FIELDS if f.median)


def wandb_step_keys() -> dict[str, str]:
    """Step field -> its own W&B key."""
    return {f.name: f.wandb for f in STEP_FIELDS if f.wandb is not None}


def finite_or_none(value: Any) -> float | None:
    """``value`` as a float when it is a finite number, else None (None, NaN, inf, bool, text).
    The one copy: the sinks, the step API, the alerts and the analysis all read numbers through
    it. Figures mostly arrive as floats (NaN for unknown): ``v - v == 0`` holds for exactly the
    finite ones, the fast path."""
    if type(value) is float:
        return value if value - value == 0 else None
    if value is None or isinstance(value, (bool, str, bytes)):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def combine(how: Combine, values: Sequence[float]) -> float | None:
    """``values`` (finite) combined ``how``; None when there are none."""
    if not values:
        return None
    if how == "sum":
        return math.fsum(values)
    if how == "mean":
        return math.fsum(values) / len(values)
    return max(values) if how == "max" else min(values)


def aggregate(
    how: Aggregate, values: Sequence[float], durations: Sequence[float | None]
) -> float | int | None:
    """One W&B ``all/*`` value over the ranks' known ``values`` (``durations``: each one's rank
    ``duration_s``, for ``max_share``); None: omitted."""
    if how == "count":
        return len(values)
    if not values:
        return None
    if how == "spread":
        return max(values) - min(values)
    if how == "count_positive":
        return sum(1 for v in values if v > 0)
    if how == "max_share":
        shares = [v / d for v, d in zip(values, durations, strict=True) if d is not None and d > 0]
        return max(shares) if shares else None
    return combine(how, values)


# ---- the docs' field lists (docs/store.md, docs/wandb.md) ------------------------------------
def _kinds(kinds: tuple[str, ...]) -> str:
    return ", ".join("float" if k == "number" else k for k in kinds)


def steps_table() -> str:
    """The ``steps.jsonl`` field table of docs/store.md."""
    lines = ["| key | type | unit | meaning | median in summary.json |", "| --- | --- | --- | --- | --- |"]
    for f in STEP_FIELDS:
        lines.append(f"| `{f.name}` | {_kinds(f.kinds)} | {f.unit} | {f.doc} | {'yes' if f.median else ''} |")
    return "\n".join(lines)


def _agg_doc(how: Aggregate, name: str) -> str:
    if how == "max_share":
        return f"largest `{name}` / `duration_s` of a rank"
    if how == "count":
        return f"ranks that know `{name}` (always logged)"
    if how == "count_positive":
        return f"ranks with `{name}` > 0"
    return f"{how} over ranks of `{name}`"


def wandb_table() -> str:
    """The key table of docs/wandb.md."""
    lines = ["| key | unit | what |", "| --- | --- | --- |", "| `trainer/global_step` | | the step axis |"]
    lines += [f"| `{f.wandb}` | {f.unit} | {f.doc} |" for f in STEP_FIELDS if f.wandb is not None]
    lines += [f"| `rank/<r>/{f.name}` | {f.unit} | {f.doc} |" for f in RANK_FIGURES]
    for f in RANK_FIGURES:
        for key, how in f.aggregates:
            unit = "count" if how.startswith("count") else "fraction" if how == "max_share" else f.unit
            lines.append(f"| `{key}` | {unit} | {_agg_doc(how, f.name)} |")
    return "\n".join(lines)


def docs_tables() -> dict[str, str]:
    """Marker name -> the table between ``<!-- figures:NAME -->`` and ``<!-- /figures:NAME -->``
    in docs/ (scripts/figure_docs.py rewrites them)."""
    return {"steps": steps_table(), "wandb": wandb_table()}


def render_docs(text: str) -> str:
    """``text`` (a docs page) with every marked table replaced by the current one."""
    for name, table in docs_tables().items():
        begin, end = f"<!-- figures:{name} -->", f"<!-- /figures:{name} -->"
        i, j = text.find(begin), text.find(end)
        if i >= 0 and j > i:
            text = text[: i + len(begin)] + "\n" + table + "\n" + text[j:]
    return text
