"""Rank placement advice: which GPU takes which pipeline stage, the layout kept.

A stage's time per unit of work (``Stage.per_layer_s``: forward + backward seconds per layer's
FLOPs, the output layer counted) is taken as its GPU's speed; a stage's work is its layers plus
its fixed work (``Stage.extra_layers``). Moving GPUs between stages moves their speed: the
slowest GPU should take the least work. Applied, on one node, by reordering
``CUDA_VISIBLE_DEVICES`` (rank r uses the r-th visible device). Limits: docs/advisor.md.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from charllm_nemo.analysis.advise import (
    MIN_GAIN,
    MIN_STEPS,
    Advice,
    Measured,
    NoAdvice,
    measure_run,
    pipeline_time_s,
    run_evidence,
)
from charllm_nemo.analysis.advise_stats import (
    ONE_SHORT_RUN,
    SEGMENTS,
    Predict,
    gain_interval,
    one_run_text,
    repeats_text,
    with_drift,
)

BRUTE_FORCE_STAGES = 8
"""Up to this many stages every assignment is tried (8! = 40,320); above, the slowest GPU is
matched with the least work (sorted), which is optimal for the largest stage time alone."""


def best_assignment(
    work: list[float], speed_s: list[float], microbatches: int, throttled: list[bool] | None = None
) -> tuple[list[int], float]:
    """(``order``, pipeline time s): stage ``t`` gets the GPU now on stage ``order[t]``,
    minimising :func:`pipeline_time_s` of ``work[t] x speed_s[order[t]]``; ties keep the
    current placement (the identity is tried first). A ``throttled`` GPU never moves to a stage
    with more work than its own."""
    p = len(work)
    if p != len(speed_s) or p == 0:
        raise ValueError(f"work={work} and speed_s={speed_s} must be non-empty and of one length")
    hot = throttled or [False] * p

    def cost(order: tuple[int, ...] | list[int]) -> float:
        return pipeline_time_s([work[t] * speed_s[order[t]] for t in range(p)], microbatches)

    def allowed(order: tuple[int, ...] | list[int]) -> bool:
        return all(not hot[g] or work[t] <= work[g] for t, g in enumerate(order))

    if p <= BRUTE_FORCE_STAGES:
        best = min((o for o in itertools.permutations(range(p)) if allowed(o)), key=cost)
        return list(best), cost(best)
    by_work = sorted(range(p), key=lambda t: work[t])
    by_speed = sorted(range(p), key=lambda g: -speed_s[g])  # slowest GPU first
    order = [0] * p
    for t, g in zip(by_work, by_speed, strict=True):
        order[t] = g
    identity = list(range(p))
    if allowed(order) and cost(order) < cost(identity):
        return order, cost(order)
    return identity, cost(identity)


def placement_advice(
    info: dict[str, Any],
    summary: dict[str, Any],
    config: dict[str, Any],
    rows: dict[str, list[dict[str, Any]]],
    min_gain: float = MIN_GAIN,
    min_steps: int = MIN_STEPS,
) -> Advice | NoAdvice:
    """Placement advice for one run (one rank per stage, one node, distinct GPUs), or why not."""
    ms = measure_run(info, summary, config, rows, min_steps, kind="rank_placement")
    if isinstance(ms, NoAdvice):
        return ms
    return placement_for([ms], min_gain)


def placement_for(group: list[Measured], min_gain: float = MIN_GAIN) -> Advice | NoAdvice:
    """Placement advice for the runs of one configuration (one or more), or why not: advised
    only past the measured noise, as the layout (docs/advisor.md, "Noise")."""
    from charllm_nemo.analysis.advise_layout import pool

    ms = pool(group)
    run, stages = ms.run, ms.stages
    label = run if len(ms.runs) == 1 else f"{run} (+{len(ms.runs) - 1} repeat(s))"

    def no(reason: str) -> NoAdvice:
        return NoAdvice("rank_placement", label, reason)

    if any(len(s.ranks) != 1 for s in stages):
        return no("a stage has several ranks (TP or DP): moving one GPU alone does not move the stage")
    gpus = [s.devices[0] if len(s.devices) == 1 else None for s in stages]
    if any(g is None for g in gpus):
        return no("the GPU of a stage is unknown (no device index in the ranks table)")
    hosts = {str(g).rsplit(":GPU", 1)[0] for g in gpus}
    indices = [str(g).rsplit(":GPU", 1)[1] for g in gpus]
    if len(hosts) != 1:
        return no(f"the stages run on {len(hosts)} hosts: CUDA_VISIBLE_DEVICES reorders GPUs within one node")
    if len(set(indices)) != len(indices):
        return no(f"the stages share GPU indices {indices} (CPU ranks, or one GPU shared): nothing to move")
    work = [s.work for s in stages]
    speed = [s.per_layer_s for s in stages]
    m = ms.microbatches
    order, new_pipe = best_assignment(work, speed, m, [s.throttled for s in stages])
    old_pipe = pipeline_time_s([s.busy_s for s in stages], m)
    expected = max(ms.step_s - (old_pipe - new_pipe), new_pipe)
    gain = 1.0 - expected / ms.step_s
    if order == list(range(len(stages))):
        return no("the GPUs already sit on the best stages for their measured speed")
    predict = placement_predictor(work, order, m)
    gi = gain_interval(ms.busy, ms.step, predict)
    if gi.low > 0:  # past the step noise: with one run, its quarters must agree too
        drift = with_drift(gi, ms.busy, ms.step, predict)
        if drift is None:
            return no(ONE_SHORT_RUN.format(steps=gi.steps, least=2 * SEGMENTS, train=2 * SEGMENTS + 2))
        gi = drift
    rests = (
        f"expected gain {gi.point * 100:.1f}%, 95% interval [{gi.low * 100:+.1f}, {gi.high * 100:+.1f}]% "
        f"over {gi.steps} steps of {gi.runs} run(s)"
        + (f" and its {SEGMENTS} quarters" if gi.runs == 1 and gi.low > 0 else "")
    )
    if gi.low <= 0:
        return no(f"no change: the expected gain is within the noise ({rests}); {repeats_text(gi)}")
    if gi.runs == 1:
        return no(one_run_text(f"the placement {[str(gpus[g]) for g in order]}", gi))
    if gain < min_gain:
        return no(f"the best placement would gain {gain * 100:.1f}% (< {min_gain * 100:.0f}%)")
    visible = ",".join(indices[g] for g in order)
    moves = [f"stage {t} <- {gpus[g]} (now on stage {g})" for t, g in enumerate(order) if g != t]
    return Advice(
        kind="rank_placement",
        run=run,
        current=[str(g) for g in gpus],
        proposed=[str(gpus[g]) for g in order],
        expected_gain=gain,
        evidence=[*run_evidence(ms), rests, "moves: " + "; ".join(moves)],
        overrides=[f"CUDA_VISIBLE_DEVICES={visible}"],
        measured_step_s=ms.step_s,
        expected_step_s=expected,
        placement=(
            f"an environment setting, not a Hydra override: CUDA_VISIBLE_DEVICES={visible} charllm train "
            "... (launcher=local on that node; rank r uses the r-th listed GPU)"
        ),
        gain_interval=[gi.low, gi.high],
        confidence=0.95,
        runs=list(ms.runs),
    )


def placement_predictor(work: list[float], order: list[int], microbatches: int) -> Predict:
    """The expected step time (s) with stage ``t`` on the GPU now on stage ``order[t]``, from
    measured stage busy times ``B`` (s) and step time ``T`` (s): a GPU's time per unit of work
    ``B[g] / work[g]`` moves with it, the rest of the step is kept as measured."""

    def predict(busy: np.ndarray[Any, Any], step_s: float) -> float:
        b = [float(x) for x in busy]
        new = [work[t] * b[g] / work[g] for t, g in enumerate(order)]
        new_pipe = pipeline_time_s(new, microbatches)
        return max(step_s - pipeline_time_s(b, microbatches) + new_pipe, new_pipe)

    return predict
