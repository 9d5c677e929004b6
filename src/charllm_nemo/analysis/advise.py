"""``charllm advise``: measured imbalance turned into a pipeline layout and a micro batch size.

Input: the tables of :func:`charllm_nemo.analysis.analyze.analyze` (nothing is read from the
run directory here but each run's ``summary.json`` layout, through the loaded runs). The model
(docs/advisor.md):

* **layout**: per stage, its forward + backward time per step (``throttle_slowdown``'s
  ``busy_median_s``, the slowest rank of the stage) divided by its layers gives a time per layer
  that already holds whatever slowed the stage (a hot, throttled, slower GPU; the embedding or
  the loss). Layers are re-dealt so that the largest ``layers x time per layer`` is smallest;
  the step time is predicted with the 1F1B model ``(sum + (m - 1) x max) / m`` of the per-step
  stage times (``m`` microbatches) in place of the measured one.
* **micro batch size**: over runs that differ only in ``micro_batch_size`` (a sweep), the
  highest throughput, and among those within ``tolerance`` of it the one with the fewest power
  excursions above the limit and the least throttling.

Everything is plain Python over a few rows per run; the CLI side is :mod:`.advise_cmd`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any

import numpy as np

from charllm_nemo.analysis.advise_work import WorkModel
from charllm_nemo.telemetry.figures import finite_or_none as _f

MIN_STEPS = 3
"""Fewest measured steps (warm-up excluded) a run needs for layout advice."""

MIN_GAIN = 0.03
"""Smallest expected gain (fraction of step time or throughput) worth a re-run."""

THROTTLED_SHARE = 0.05
"""A stage is throttled when one of its ranks spent this share of its step time or more under a
limiting throttle reason: the advisor never gives it more work (docs/advisor.md)."""

SLOW_DEVICE = 0.10
"""A stage whose time per unit of work is this much above the fastest stage's is called a slow
device in the evidence (below: a heavy stage, if it is the slowest)."""

MBS_TOLERANCE = 0.02
"""Micro batch sizes within this share of the best throughput count as equally fast; the one
with the fewest excursions and least throttling among them is proposed."""


@dataclass
class Stage:
    """What was measured on one pipeline stage (over its ranks: the slowest, hottest, ...).

    ``busy_s``: forward + backward time per step of its slowest rank, s (median over the
    measured steps); ``throttle_share``: the largest share of step time any of its ranks spent
    under a limiting throttle reason (fraction); ``temp_peak_c`` (°C), ``power_avg_w`` (W),
    ``clock_avg_mhz`` (MHz, the lowest): from the ``ranks`` table; None where not measured."""

    stage: int
    layers: int
    ranks: list[int]
    busy_s: float
    slowest_rank: int
    throttle_share: float | None = None
    temp_peak_c: float | None = None
    power_avg_w: float | None = None
    clock_avg_mhz: float | None = None
    devices: list[str] = field(default_factory=list)  # "host:GPU index" of its ranks
    extra_layers: float = 0.0  # fixed work outside the layers, in layers' FLOPs (the logits)

    @property
    def work(self) -> float:
        """The stage's work in layers' FLOPs (its layers, recomputation, the output layer)."""
        return self.layers + self.extra_layers

    @property
    def per_layer_s(self) -> float:
        """Forward + backward seconds per layer (per layer's FLOPs) per step on this stage."""
        return self.busy_s / self.work

    @property
    def throttled(self) -> bool:
        """Whether a rank of the stage spent :data:`THROTTLED_SHARE` or more of its step time
        under a limiting throttle reason (power, thermal, ...)."""
        return self.throttle_share is not None and self.throttle_share >= THROTTLED_SHARE


@dataclass
class Advice:
    """One piece of advice. ``kind``: ``pipeline_layout`` or ``micro_batch_size``.
    ``expected_gain``: fraction (0.12 = 12 % shorter step for a layout, 12 % more samples/s for
    a micro batch size); ``measured_step_s`` / ``expected_step_s``: s (layout only);
    ``overrides``: the Hydra overrides that apply it; ``command``: a whole ``charllm train``
    line that re-runs the run with it (None when the run's config could not be recomposed)."""

    kind: str
    run: str
    current: Any
    proposed: Any
    expected_gain: float
    evidence: list[str]
    overrides: list[str]
    command: str | None = None
    measured_step_s: float | None = None
    expected_step_s: float | None = None
    placement: str | None = None
    stages: list[dict[str, Any]] = field(default_factory=list)
    gain_interval: list[float] | None = None
    confidence: float | None = None
    runs: list[str] = field(default_factory=list)


@dataclass
class NoAdvice:
    """Why no advice of ``kind`` could be given for ``run`` (the sweep or run key)."""

    kind: str
    run: str
    reason: str


@dataclass
class AdviceReport:
    """Everything ``charllm advise`` says about a path."""

    path: str
    advice: list[Advice] = field(default_factory=list)
    no_advice: list[NoAdvice] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-able dicts (schema: docs/advisor.md)."""
        return {
            "path": self.path,
            "advice": [asdict(a) for a in self.advice],
            "no_advice": [asdict(n) for n in self.no_advice],
            "problems": list(self.problems),
        }


# -- the layout model ---------------------------------------------------------------------------


def pipeline_time_s(stage_busy_s: list[float], microbatches: int) -> float:
    """1F1B estimate of a step's pipeline compute, s: the per-microbatch stage times ``busy / m``
    summed (one microbatch's trip through every stage) plus ``m - 1`` times the slowest stage
    (the steady state runs at its pace)."""
    m = max(1, microbatches)
    return (sum(stage_busy_s) + (m - 1) * max(stage_busy_s)) / m


def balance_layers(
    num_layers: int,
    per_layer_s: list[float],
    current: list[int],
    extra: list[float] | None = None,
    work: Callable[[int, int], float] | None = None,
    caps: list[int] | None = None,
) -> list[int]:
    """Layers per stage (each >= 1, summing to ``num_layers``) minimising the largest stage
    time ``work(stage, layers) x per_layer_s`` (``work`` default: ``layers + extra``, ``extra``
    0 where None): every stage starts with one layer, then each further layer goes where the
    stage's time after it is smallest (greedy, optimal for this min-max with work growing in the
    layers); a tie goes to the stage that holds more layers in ``current``, so a balanced run
    keeps its layout. ``caps``: the most layers each stage may hold (a throttled stage: its
    current count); when the caps leave nowhere to go, ``current`` is returned."""
    p = len(per_layer_s)
    e = extra or [0.0] * p
    if p < 1 or num_layers < p:
        raise ValueError(f"cannot deal {num_layers} layers over {p} stages (each needs >= 1)")
    if any(not math.isfinite(u) or u <= 0 for u in per_layer_s):
        raise ValueError(f"per_layer_s={per_layer_s} must be finite and > 0")
    limit = caps or [num_layers] * p

    def cost(i: int, n: int) -> float:
        return (work(i, n) if work is not None else n + e[i]) * per_layer_s[i]

    layers = [1] * p
    for _ in range(num_layers - p):
        room = [i for i in range(p) if layers[i] < limit[i]]
        if not room:
            return list(current)
        s = min(room, key=lambda i: (cost(i, layers[i] + 1), -current[i], i))
        layers[s] += 1
    return layers


def layout_predictor(
    work_now: list[float], work_new: list[float], microbatches: int
) -> Callable[[np.ndarray[Any, Any], float], float]:
    """The expected step time (s) with the work per stage ``work_new`` from measured stage busy
    times ``B`` (s) and step time ``T`` (s) at ``work_now``: each stage's time per unit of work
    ``B / work_now`` kept, the pipeline's compute re-estimated, everything outside it (optimizer,
    gradient syncs, waits the model does not see) kept as measured:
    ``max(T - pipeline(B) + pipeline(B_new), pipeline(B_new))``."""

    def predict(busy: np.ndarray[Any, Any], step_s: float) -> float:
        b = [float(x) for x in busy]
        new = [w1 * bi / w0 for bi, w0, w1 in zip(b, work_now, work_new, strict=True)]
        new_pipe = pipeline_time_s(new, microbatches)
        return max(step_s - pipeline_time_s(b, microbatches) + new_pipe, new_pipe)

    return predict


def propose_layout(
    stages: list[Stage],
    microbatches: int,
    step_s: float,
    min_gain: float = MIN_GAIN,
    work: WorkModel | None = None,
) -> tuple[list[int], float, float]:
    """(proposed layers per stage, expected step time s, expected gain as a fraction of
    ``step_s``). The proposal is the current layout when no re-deal gains ``min_gain``. A
    throttled stage (:attr:`Stage.throttled`) never gets more layers than it has. ``work``: how
    a stage's work grows with its layers (default: each stage's ``extra_layers`` kept fixed)."""
    current = [s.layers for s in stages]
    p = len(stages)
    new = balance_layers(
        sum(current),
        [s.per_layer_s for s in stages],
        current,
        [s.extra_layers for s in stages],
        (lambda i, n: work.stage(i, n, p)) if work is not None and work.known else None,
        [s.layers if s.throttled else sum(current) for s in stages],
    )
    work_new = _work(stages, new, work)
    expected = layout_predictor([s.work for s in stages], work_new, microbatches)(
        np.array([s.busy_s for s in stages]), step_s
    )
    gain = 1.0 - expected / step_s
    if new == current or gain < min_gain:
        return current, step_s, 0.0 if new == current else gain
    return new, expected, gain


def _work(stages: list[Stage], layers: list[int], work: WorkModel | None) -> list[float]:
    """The work of each stage holding ``layers`` (the work model's, else layers + fixed extra)."""
    if work is not None and work.known:
        return work.stages(layers)
    return [n + s.extra_layers for s, n in zip(stages, layers, strict=True)]


def stage_evidence(stages: list[Stage]) -> list[str]:
    """One line per stage: layers, busy time, time per layer against the fastest, telemetry."""
    fastest = min(s.per_layer_s for s in stages)
    lines = []
    for s in stages:
        parts = [
            f"stage {s.stage} (ranks {','.join(map(str, s.ranks))}"
            + (f" on {', '.join(s.devices)}" if s.devices else "")
            + f"): {s.layers} layer(s)"
            + (f" + output layer ({s.extra_layers:.2f})" if s.extra_layers else "")
            + f", forward+backward {s.busy_s * 1e3:.1f} ms/step "
            f"(slowest rank {s.slowest_rank}), {s.per_layer_s * 1e3:.2f} ms/layer "
            f"({(s.per_layer_s / fastest - 1) * 100:+.0f}% vs the fastest stage)"
        ]
        if s.throttle_share is not None:
            parts.append(f"throttled {s.throttle_share * 100:.0f}% of step time")
        if s.temp_peak_c is not None:
            parts.append(f"peak {s.temp_peak_c:.1f} °C")
        if s.power_avg_w is not None:
            parts.append(f"avg {s.power_avg_w:.0f} W")
        if s.clock_avg_mhz is not None:
            parts.append(f"SM clock {s.clock_avg_mhz:.0f} MHz")
        lines.append(", ".join(parts))
    return lines


def placement_note(stages: list[Stage], proposed: list[int]) -> str | None:
    """Which GPU takes the lighter stage: the advice is tied to the current rank -> GPU
    placement, so say which devices must keep which stage (None when the layout is even)."""
    if len(set(proposed)) == 1:
        return None
    light = min(range(len(stages)), key=lambda i: (proposed[i], i))
    s = stages[light]
    where = f"rank(s) {','.join(map(str, s.ranks))}" + (f" ({', '.join(s.devices)})" if s.devices else "")
    return (
        f"stage {light} gets the fewest layers ({proposed[light]}); keep it on {where} (the same "
        "rank -> GPU placement as this run): on another placement the slow GPU may take a heavy stage"
    )


# -- from the analysis tables -------------------------------------------------------------------


def _layers_per_stage(summary: dict[str, Any], config: dict[str, Any], pp: int) -> list[int] | None:
    lay = summary.get("layout") if isinstance(summary.get("layout"), dict) else {}
    got = lay.get("layers_per_stage") if isinstance(lay, dict) else None
    if isinstance(got, list) and len(got) == pp and all(isinstance(n, int) and n > 0 for n in got):
        return list(got)
    par = config.get("parallel") if isinstance(config.get("parallel"), dict) else {}
    explicit = par.get("pipeline_layout") if isinstance(par, dict) else None
    if isinstance(explicit, list) and len(explicit) == pp:
        return [int(n) for n in explicit]
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    n = model.get("num_layers") if isinstance(model, dict) else None
    if (
        isinstance(n, int)
        and pp > 0
        and n % pp == 0
        and not (isinstance(par, dict) and par.get("pipeline_layout_scheme"))
    ):
        return [n // pp] * pp
    return None


def head_layers(config: dict[str, Any]) -> float | None:
    """The last stage's work outside its layers (the output layer's logits GEMM), in layers:
    logits FLOPs / the mean layer's FLOPs, from the run's model config and the FLOP model of
    :mod:`charllm_nemo.metrics.flops` (None when the config does not give the model's shape)."""
    from dataclasses import fields

    from charllm_nemo.errors import ConfigError
    from charllm_nemo.metrics.flops import ModelShape, model_flops_per_step
    from charllm_nemo.train.config import ModelConfig

    model = config.get("model")
    if not isinstance(model, dict):
        return None
    names = {f.name for f in fields(ModelConfig)}
    try:
        shape = ModelShape.from_model_config(ModelConfig(**{k: v for k, v in model.items() if k in names}))
        flops = model_flops_per_step(shape, 1)
    except (ConfigError, TypeError, ValueError):  # an odd config: no head term, said in the evidence
        return None
    body = flops.total - flops.logits
    return flops.logits / (body / shape.num_layers) if body > 0 and shape.num_layers > 0 else None


def run_stages(
    run: str, rows: dict[str, list[dict[str, Any]]], layers: list[int], head: float = 0.0
) -> tuple[list[Stage] | None, str | None]:
    """A run's stages from its ``throttle_slowdown`` and ``ranks`` rows, or (None, why not)."""
    ts = [r for r in rows.get("throttle_slowdown", []) if r.get("run") == run]
    dev = {
        int(r["rank"]): r for r in rows.get("ranks", []) if r.get("run") == run and r.get("rank") is not None
    }
    hosts = {int(r["rank"]): r.get("host") for r in rows.get("hosts", []) if r.get("run") == run}
    by_stage: dict[int, list[dict[str, Any]]] = {}
    for r in ts:
        if r.get("pp_stage") is None:
            return None, f"rank {r.get('rank')} has no pipeline stage in its windows"
        by_stage.setdefault(int(r["pp_stage"]), []).append(r)
    if sorted(by_stage) != list(range(len(layers))):
        return None, (
            f"measured stages {sorted(by_stage)} do not match the layout's {len(layers)} stages "
            "(a rank folder missing, or no measured step windows)"
        )
    stages = []
    for k in sorted(by_stage):
        ranks = sorted(int(r["rank"]) for r in by_stage[k])
        busy = [(_f(r.get("busy_median_s")), int(r["rank"])) for r in by_stage[k]]
        known = [(b, rk) for b, rk in busy if b is not None and b > 0]
        if not known:
            return None, (
                f"stage {k} has no forward/backward phase windows (record them: "
                "telemetry.windows=[step,microbatch,phase])"
            )
        b, slow = max(known)
        shares = [_f(r.get("throttle_any_limiting_share")) for r in by_stage[k]]
        d = [dev[rk] for rk in ranks if rk in dev]
        temps = [t for t in (_f(x.get("temp_gpu_peak_c")) for x in d) if t is not None]
        power = [t for t in (_f(x.get("power_avg_w")) for x in d) if t is not None]
        clock = [t for t in (_f(x.get("clock_sm_avg_mhz")) for x in d) if t is not None]
        where = [
            f"{hosts.get(rk, '?')}:GPU{int(dev[rk]['device_index'])}"
            for rk in ranks
            if rk in dev and dev[rk].get("device_index") is not None
        ]
        stages.append(
            Stage(
                stage=k,
                layers=layers[k],
                ranks=ranks,
                busy_s=b,
                slowest_rank=slow,
                throttle_share=max((s for s in shares if s is not None), default=None),
                temp_peak_c=max(temps, default=None),
                power_avg_w=max(power, default=None),
                clock_avg_mhz=min(clock, default=None),
                devices=where,
                extra_layers=head if k == len(layers) - 1 else 0.0,
            )
        )
    return stages, None


@dataclass
class Measured:
    """What the layout and placement models need of one run, or of the runs of one
    configuration pooled: the stages, microbatches per step, the measured step times (s) and
    their median, the output layer's work in layers; ``busy`` (steps x stages, s) and ``step``
    (s) per run: each measured step's stage busy times (the slowest rank of each stage) and its
    step time, for the noise (:mod:`.advise_stats`); ``runs``: the run keys."""

    run: str
    stages: list[Stage]
    microbatches: int
    times: list[float]
    step_s: float
    head: float | None
    busy: list[np.ndarray[Any, Any]] = field(default_factory=list)
    step: list[np.ndarray[Any, Any]] = field(default_factory=list)
    work: WorkModel = field(default_factory=WorkModel)
    runs: list[str] = field(default_factory=list)


def _per_step(
    run: str, rows: dict[str, list[dict[str, Any]]], stages: list[Stage]
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(steps x stages busy s, steps step time s) over the measured steps every stage and the
    step time are known for (``busy_steps`` and ``thermal_steps`` rows)."""
    stage_of = {rk: s.stage for s in stages for rk in s.ranks}
    per: dict[int, dict[int, float]] = {}
    for r in rows.get("busy_steps", []):
        b, step, rank = _f(r.get("busy_s")), r.get("step"), r.get("rank")
        if r.get("run") != run or b is None or not isinstance(step, int) or rank is None:
            continue
        k = stage_of.get(int(rank))
        if k is not None:
            per.setdefault(step, {})[k] = max(b, per.get(step, {}).get(k, 0.0))
    times = {
        int(r["step"]): t
        for r in rows.get("thermal_steps", [])
        if r.get("run") == run and isinstance(r.get("step"), int) and (t := _f(r.get("step_time_s")))
    }
    keep = sorted(st for st, by in per.items() if len(by) == len(stages) and st in times)
    busy = np.array([[per[st][s.stage] for s in stages] for st in keep], dtype=np.float64)
    return busy.reshape(len(keep), len(stages)), np.array([times[st] for st in keep], dtype=np.float64)


def measure_run(
    info: dict[str, Any],
    summary: dict[str, Any],
    config: dict[str, Any],
    rows: dict[str, list[dict[str, Any]]],
    min_steps: int = MIN_STEPS,
    kind: str = "pipeline_layout",
) -> Measured | NoAdvice:
    """A run's :class:`Measured` (``info``: its ``runs`` row), or why the data cannot support
    advice of ``kind`` (one stage, interleaving, too few steps, no phase windows, ...)."""
    from charllm_nemo.analysis.advise_work import work_model

    run = str(info["run"])

    def no(reason: str) -> NoAdvice:
        return NoAdvice(kind, run, reason)

    pp = info.get("pp")
    if not isinstance(pp, int) or pp < 2:
        return no(f"no pipeline parallelism (pp={pp}): there are no stages to re-balance")
    vpp = (summary.get("layout") or {}).get("vpp") if isinstance(summary.get("layout"), dict) else None
    if isinstance(vpp, int) and vpp > 1:
        return no(f"interleaved pipeline (vpp={vpp}): the per-stage model does not cover virtual stages")
    steps = [r for r in rows.get("thermal_steps", []) if r.get("run") == run]
    times = [t for t in (_f(r.get("step_time_s")) for r in steps) if t is not None and t > 0]
    if len(times) < min_steps:
        return no(
            f"{len(times)} measured step(s) (the first is warm-up and not counted); need at least "
            f"{min_steps}: train longer (batch.train_steps={min_steps + 2} or more)"
        )
    layers = _layers_per_stage(summary, config, pp)
    if layers is None:
        return no("layers per stage unknown: neither summary.json's layout nor the config gives them")
    work = work_model(config)
    stages, why = run_stages(run, rows, layers, 0.0)
    if stages is None:
        return no(str(why))
    for st in stages:
        st.extra_layers = work.stage(st.stage, st.layers, len(stages)) - st.layers if work.known else 0.0
    m = (summary.get("layout") or {}).get("num_microbatches") or summary.get("num_microbatches")
    if not isinstance(m, int) or m < 1:
        return no("the number of microbatches per step is unknown (summary.json has no num_microbatches)")
    busy, step = _per_step(run, rows, stages)
    if step.size < min_steps:
        return no(
            f"{step.size} measured step(s) with every stage's forward/backward time; need at least "
            f"{min_steps} to measure the step-to-step noise"
        )
    head = work.head if work.known else None
    return Measured(run, stages, m, times, median(times), head, [busy], [step], work, [run])


def run_evidence(ms: Measured) -> list[str]:
    """The evidence lines every piece of layout or placement advice carries."""
    stages, m, step_s = ms.stages, ms.microbatches, ms.step_s
    evidence = stage_evidence(stages)
    evidence += stage_diagnosis(stages)
    runs = f"{len(ms.runs)} runs of this configuration, " if len(ms.runs) > 1 else ""
    evidence.append(
        f"step time {step_s * 1e3:.1f} ms (median of {runs}{len(ms.times)} measured steps), "
        f"{m} microbatches; "
        f"1F1B pipeline compute {pipeline_time_s([s.busy_s for s in stages], m) * 1e3:.1f} ms of it"
    )
    spread = median([abs(t - step_s) for t in ms.times]) / step_s
    evidence.append(f"step times vary by {spread * 100:.1f}% step to step (median absolute deviation)")
    evidence.append(ms.work.describe())
    return evidence


def stage_diagnosis(stages: list[Stage]) -> list[str]:
    """Tell a slow device from a heavy stage: the slowest stage's time per unit of work against
    the fastest stage's (a slow device: :data:`SLOW_DEVICE` or more above, with its clock and
    throttling), or its share of the work (a heavy stage: at the others' speed, more work)."""
    fastest = min(s.per_layer_s for s in stages)
    slowest = max(stages, key=lambda s: s.busy_s)
    mean_work = sum(s.work for s in stages) / len(stages)
    lines = []
    for s in stages:
        above = s.per_layer_s / fastest - 1
        if above >= SLOW_DEVICE:
            why = []
            if s.throttled:
                why.append(f"throttled {s.throttle_share * 100:.0f}% of step time")  # type: ignore[operator]
            clocks = [x.clock_avg_mhz for x in stages if x.clock_avg_mhz is not None]
            if s.clock_avg_mhz is not None and clocks and s.clock_avg_mhz < max(clocks) * 0.95:
                why.append(f"SM clock {s.clock_avg_mhz:.0f} MHz against {max(clocks):.0f}")
            lines.append(
                f"stage {s.stage} is a slow device: {above * 100:.0f}% more time per unit of work than the "
                "fastest stage"
                + (f" ({', '.join(why)})" if why else "")
                + (": it is not given more work" if s.throttled else "")
            )
    if not any(line.startswith(f"stage {slowest.stage} ") for line in lines) and slowest.work > mean_work:
        lines.append(
            f"stage {slowest.stage} is a heavy stage: {slowest.work:.2f} layers of work against a mean of "
            f"{mean_work:.2f}, at the others' speed (within {SLOW_DEVICE * 100:.0f}% per unit of work)"
        )
    return lines


def _list(v: list[int]) -> str:
    return "[" + ",".join(str(n) for n in v) + "]"
