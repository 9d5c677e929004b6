"""Layout advice for the runs of one configuration: the re-deal of :mod:`.advise`'s model,
advised only past the measured noise (:mod:`.advise_stats`; docs/advisor.md, "Noise")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import numpy as np

from charllm_nemo.analysis.advise import (
    MIN_GAIN,
    MIN_STEPS,
    Advice,
    Measured,
    NoAdvice,
    Stage,
    _list,
    _work,
    layout_predictor,
    measure_run,
    placement_note,
    propose_layout,
    run_evidence,
)
from charllm_nemo.analysis.advise_stats import (
    ONE_SHORT_RUN,
    SEGMENTS,
    GainInterval,
    Resampled,
    interval,
    one_run_text,
    repeats_text,
    resample,
    with_drift,
)
from charllm_nemo.analysis.advise_work import WorkModel

QUARTERS = f" and its {SEGMENTS} quarters"

CANDIDATE_RESAMPLES = 200
"""Resamples whose own best re-deal joins the candidates of :func:`steadiest`."""


def pool(group: list[Measured]) -> Measured:
    """The runs of one configuration as one :class:`Measured`: stage busy times and the step
    time are the medians of every run's steps together, a stage's telemetry the worst over the
    runs (highest throttle share, temperature and power, lowest clock)."""
    first = group[0]
    busy = np.concatenate([b for ms in group for b in ms.busy])
    step = np.concatenate([t for ms in group for t in ms.step])
    stages = []
    for k, st in enumerate(first.stages):
        peers = [ms.stages[k] for ms in group]

        def worst(name: str, pick: Callable[..., Any] = max, peers: list[Stage] = peers) -> Any:
            got = [getattr(x, name) for x in peers if getattr(x, name) is not None]
            return pick(got) if got else None

        stages.append(
            Stage(
                stage=st.stage, layers=st.layers, ranks=st.ranks, busy_s=float(np.median(busy[:, k])),
                slowest_rank=st.slowest_rank, throttle_share=worst("throttle_share"),
                temp_peak_c=worst("temp_peak_c"), power_avg_w=worst("power_avg_w"),
                clock_avg_mhz=worst("clock_avg_mhz", min), devices=st.devices, extra_layers=st.extra_layers,
            )
        )  # fmt: skip
    times = [t for ms in group for t in ms.times]
    return Measured(
        first.run, stages, first.microbatches, times, float(np.median(step)), first.head,
        [b for ms in group for b in ms.busy], [t for ms in group for t in ms.step], first.work,
        [r for ms in group for r in ms.runs],
    )  # fmt: skip


def layout_for(group: list[Measured], min_gain: float = MIN_GAIN) -> Advice | NoAdvice:
    """Layout advice for the runs of one configuration (one or more), or why there is none: a
    re-deal is advised only when its expected gain's 95 % interval lies above 0 and the gain
    reaches ``min_gain`` (docs/advisor.md, "Noise")."""
    ms = pool(group)
    run, stages, step_s = ms.run, ms.stages, ms.step_s
    layers = [s.layers for s in stages]
    label = run if len(ms.runs) == 1 else f"{run} (+{len(ms.runs) - 1} repeat(s))"

    def no(reason: str) -> NoAdvice:
        return NoAdvice("pipeline_layout", label, reason)

    if sum(layers) < len(layers) + 1:
        return no(f"{sum(layers)} layers over {len(layers)} stages: every stage needs >= 1, nothing can move")
    m = ms.microbatches
    proposed, expected, gain = propose_layout(stages, m, step_s, 0.0, ms.work)
    evidence = run_evidence(ms)
    if proposed == layers:
        throttled = [s.stage for s in stages if s.throttled]
        held = f" (throttled stage(s) {throttled} are not given more layers)" if throttled else ""
        return no(
            f"stages are balanced: the measured layout is already the best split{held}; keep "
            f"parallel.pipeline_layout={_list(layers)}. " + " | ".join(evidence)
        )
    res = resample(ms.busy, ms.step)
    proposed, gi = steadiest(stages, proposed, res, m, ms.work)
    if gi.low > 0:  # past the step noise: with one run, its quarters must agree too
        now = [s.work for s in stages]
        drift = with_drift(gi, ms.busy, ms.step, layout_predictor(now, _work(stages, proposed, ms.work), m))
        if drift is None:
            return no(ONE_SHORT_RUN.format(steps=gi.steps, least=2 * SEGMENTS, train=2 * SEGMENTS + 2))
        gi = drift
    rests = (
        f"expected gain {gi.point * 100:.1f}%, 95% interval [{gi.low * 100:+.1f}, {gi.high * 100:+.1f}]% "
        + (
            f"over {gi.runs} runs and their steps (runs resampled, then steps within them)"
            if gi.runs > 1
            else f"over the {gi.steps} steps of one run{QUARTERS if gi.low > 0 else ''} (run-to-run "
            "variability not measured: repeat the run to include it)"
        )
    )
    evidence.append(rests)
    if gi.low <= 0:
        more = repeats_text(gi)
        return no(
            f"no change: the expected gain is within the noise ({rests}); {more} "
            f"(the best re-deal would be {_list(proposed)}). " + " | ".join(evidence)
        )
    if gi.runs == 1:
        return no(one_run_text(f"the re-deal {_list(proposed)}", gi) + ". " + " | ".join(evidence))
    if gi.point < min_gain:
        return no(
            f"no change: the best re-deal {_list(proposed)} would gain {gi.point * 100:.1f}% "
            f"(< --min-gain {min_gain * 100:.0f}%). " + " | ".join(evidence)
        )
    gain, expected = gi.point, step_s * (1 - gi.point)
    return Advice(
        kind="pipeline_layout",
        run=run,
        current=layers,
        proposed=proposed,
        expected_gain=gain,
        evidence=evidence,
        overrides=[f"parallel.pipeline_layout={_list(proposed)}", "parallel.pipeline_layout_scheme=null"],
        measured_step_s=step_s,
        expected_step_s=expected,
        placement=placement_note(stages, proposed),
        stages=[
            {**asdict(s), "per_layer_s": s.per_layer_s, "proposed_layers": n}
            for s, n in zip(stages, proposed, strict=True)
        ],
        gain_interval=[gi.low, gi.high],
        confidence=0.95,
        runs=list(ms.runs),
    )


def steadiest(
    stages: list[Stage], best: list[int], res: Resampled, microbatches: int, work: WorkModel
) -> tuple[list[int], GainInterval]:
    """Among the re-deals the noise allows (the best one at the pooled medians and the best
    of each of the first :data:`CANDIDATE_RESAMPLES` resamples), the one that moves the fewest
    layers while its expected gain is within the best's interval half-width of the best gain
    (ties: the larger gain), with its gain interval. Near-equal re-deals swap places from run to
    run with the noise; the smallest of them is the one every repeat agrees on."""
    current = [s.layers for s in stages]
    now = [s.work for s in stages]
    seen = {tuple(best)}
    for b in res.busy_r[:CANDIDATE_RESAMPLES]:
        redrawn = [replace(s, busy_s=float(x)) for s, x in zip(stages, b, strict=True)]
        seen.add(tuple(propose_layout(redrawn, microbatches, float(np.median(res.step_r)), 0.0, work)[0]))
    seen.discard(tuple(current))
    if not seen:
        seen = {tuple(best)}
    scored = {
        c: interval(res, layout_predictor(now, _work(stages, list(c), work), microbatches)) for c in seen
    }
    top = max(scored.values(), key=lambda g: g.point)

    def moved(c: tuple[int, ...]) -> int:
        return sum(abs(a - b) for a, b in zip(c, current, strict=True))

    near = [c for c, g in scored.items() if g.point >= top.point - top.half_width]
    pick = min(near, key=lambda c: (moved(c), -scored[c].point, c))
    return list(pick), scored[pick]


def layout_advice(
    info: dict[str, Any],
    summary: dict[str, Any],
    config: dict[str, Any],
    rows: dict[str, list[dict[str, Any]]],
    min_gain: float = MIN_GAIN,
    min_steps: int = MIN_STEPS,
) -> Advice | NoAdvice:
    """Layout advice for one run (``info``: its ``runs`` row), or why there is none."""
    ms = measure_run(info, summary, config, rows, min_steps)
    if isinstance(ms, NoAdvice):
        return ms
    return layout_for([ms], min_gain)
