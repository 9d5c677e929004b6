"""How sure the advisor is: the expected gain of a proposal under the measured noise.

The layout and placement models predict a step time from per-stage busy times and the measured
step time (:mod:`.advise`). Here that prediction is repeated on hierarchical resamples of the
runs of one configuration (runs drawn with replacement, then blocks of steps within each drawn
run; a step's stage times and step time stay together), giving the spread of the expected gain
that the run-to-run and step-to-step variability allow (docs/advisor.md, "Noise").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from charllm_nemo.analysis.compare_stats import (
    MAX_REPEATS,
    MIN_REPEATS,
    RESAMPLES,
    SEED,
    Z975,
    block_indices,
    t975,
)

Array = np.ndarray[Any, Any]
Predict = Callable[[Array, float], float]
"""(per-stage busy medians s, step time median s) -> the expected step time s with the advice."""


@dataclass(frozen=True)
class GainInterval:
    """The expected gain (fraction of step time) and its 95 % interval; ``runs``, ``steps``:
    what it rests on; ``run_sd``: the gain's spread between runs (None with one run)."""

    point: float
    low: float
    high: float
    runs: int
    steps: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def one_group_widening(runs: int) -> float:
    """The small-sample widening of one group's interval: ``sqrt(R / (R - 1)) x t(R - 1) / z``
    (the two-group rule of :func:`.compare_stats.widening` for a single group); 1 with one run."""
    if runs < 2:
        return 1.0
    return math.sqrt(runs / (runs - 1)) * t975(runs - 1) / Z975


def _medians(
    busy: Sequence[Array], step: Sequence[Array], rng: np.random.Generator, resamples: int
) -> tuple[Array, Array]:
    """(resamples x stages) pooled stage-busy medians and (resamples,) step-time medians."""
    n_runs = len(busy)
    sizes = [int(s.size) for s in step]
    n_max, stages = max(sizes), busy[0].shape[1]
    b_med = np.empty((resamples, stages))
    t_med = np.empty(resamples)
    chunk = max(1, 4_000_000 // (n_runs * n_max * (stages + 1)))  # bounds the padded cells (~32 MB)
    for lo in range(0, resamples, chunk):
        k = min(chunk, resamples - lo)
        b_out = np.full((k, n_runs * n_max, stages), np.nan)
        t_out = np.full((k, n_runs * n_max), np.nan)
        picked = rng.integers(0, n_runs, size=(k, n_runs)) if n_runs > 1 else np.zeros((k, 1), int)
        for slot in range(n_runs):
            for r in np.unique(picked[:, slot]):
                rows = np.nonzero(picked[:, slot] == r)[0]
                idx = block_indices(sizes[r], rng, rows.size)  # one index set: stages and step time
                cols = np.arange(slot * n_max, slot * n_max + sizes[r])
                b_out[rows[:, None], cols[None, :], :] = busy[r][idx]
                t_out[rows[:, None], cols[None, :]] = step[r][idx]
        b_med[lo : lo + k] = np.nanmedian(b_out, axis=1)
        t_med[lo : lo + k] = np.nanmedian(t_out, axis=1)
    return b_med, t_med


@dataclass(frozen=True)
class Resampled:
    """The pooled medians of the runs of one configuration and of their hierarchical resamples:
    ``busy`` (stages,) and ``step`` s; ``busy_r`` (resamples x stages) and ``step_r``."""

    busy: Array
    step: float
    busy_r: Array
    step_r: Array
    runs: int
    steps: int


def resample(
    busy: Sequence[Array], step: Sequence[Array], *, resamples: int = RESAMPLES // 2, seed: int = SEED
) -> Resampled:
    """Hierarchical resamples of the runs (``busy[r]``: run r's steps x stages busy times, s;
    ``step[r]``: its step times, s, the same steps)."""
    rng = np.random.default_rng(seed)
    bm, tm = _medians(busy, step, rng, resamples)
    return Resampled(
        np.median(np.concatenate(list(busy)), axis=0),
        float(np.median(np.concatenate(list(step)))),
        bm,
        tm,
        len(busy),
        int(sum(s.size for s in step)),
    )


def interval(res: Resampled, predict: Predict) -> GainInterval:
    """The gain ``1 - predict(B, T) / T`` at the pooled medians and its 95 % interval over the
    resamples, widened for few runs (:func:`one_group_widening`)."""
    point = 1.0 - predict(res.busy, res.step) / res.step
    gains = np.array([1.0 - predict(b, t) / t for b, t in zip(res.busy_r, res.step_r, strict=True)])
    gains = gains[np.isfinite(gains)]
    q_low, centre, q_high = np.percentile(gains, [2.5, 50, 97.5])
    k = one_group_widening(res.runs)
    low = min(point, point - k * (centre - q_low))
    high = max(point, point + k * (q_high - centre))
    return GainInterval(point, float(low), float(high), res.runs, res.steps)


def gain_interval(
    busy: Sequence[Array],
    step: Sequence[Array],
    predict: Predict,
    *,
    resamples: int = RESAMPLES // 2,
    seed: int = SEED,
) -> GainInterval:
    """:func:`interval` of :func:`resample` (one prediction)."""
    return interval(resample(busy, step, resamples=resamples, seed=seed), predict)


def repeats_for_gain(gi: GainInterval) -> int | None:
    """Runs of the configuration that would resolve ``gi.point`` (the fewest ``n`` >= 3 whose
    widened half-width falls below the gain), taking the measured interval's spread as what one
    run shows (``half-width / k x sqrt(R)``); None when there is no gain to resolve or more than
    :data:`MAX_REPEATS` would be needed."""
    if not (gi.point > 0 and math.isfinite(gi.half_width)):
        return None
    per_run = gi.half_width / one_group_widening(gi.runs) * math.sqrt(gi.runs)
    for n in range(max(MIN_REPEATS, gi.runs + 1), MAX_REPEATS + 1):
        if one_group_widening(n) * per_run / math.sqrt(n) < gi.point:
            return n
    return None


def repeats_text(gi: GainInterval) -> str:
    """What more runs would do for ``gi`` (the tail of a "no change" line)."""
    if not gi.point > 0:
        return "the model expects no gain at all: more runs would not make one"
    n = repeats_for_gain(gi)
    if n is None:
        return f"more than {MAX_REPEATS} runs of this configuration would be needed to resolve it"
    return f"about {n} runs of this configuration would resolve it"


SEGMENTS = 4
"""With one run, its measured steps in this many consecutive parts stand in for repeats."""

ONE_SHORT_RUN = (
    "one run of {steps} measured step(s): too few to tell a lasting imbalance from a passing one "
    "(its quarters need {least} steps); train longer (batch.train_steps={train} or more) or repeat the run"
)


def with_drift(
    gi: GainInterval, busy: Sequence[Array], step: Sequence[Array], predict: Predict
) -> GainInterval | None:
    """With one run, widen ``gi`` by the run's own drift: the gain computed on each of
    :data:`SEGMENTS` consecutive parts of the run, as if they were repeats (their mean +- Student's
    t interval); the union of both intervals. A lasting imbalance (a throttled GPU) holds
    in every part, a passing one (a quiet minute on a shared host) does not. None when the run
    has fewer than 2 steps a part; ``gi`` itself with several runs (their spread is measured)."""
    if gi.runs > 1:
        return gi
    b, t = busy[0], step[0]
    if t.size < 2 * SEGMENTS:
        return None
    parts = np.array_split(np.arange(t.size), SEGMENTS)
    gains = [
        1.0 - predict(np.median(b[i], axis=0), float(np.median(t[i]))) / float(np.median(t[i])) for i in parts
    ]
    centre, sd = float(np.mean(gains)), float(np.std(gains, ddof=1))
    half = t975(SEGMENTS - 1) * sd / math.sqrt(SEGMENTS)
    return GainInterval(gi.point, min(gi.low, centre - half), max(gi.high, centre + half), gi.runs, gi.steps)


def one_run_text(what: str, gi: GainInterval) -> str:
    """Why one run gets no advice even past its own noise, and what would decide it."""
    n = repeats_for_gain(gi)
    runs = f"about {n} runs" if n else f"{MIN_REPEATS} or more runs"
    return (
        "no change yet: one run shows the noise of its own steps, not the run-to-run variability "
        f"that decides a re-run on a shared host; {what} is expected to gain {gi.point * 100:.1f}% "
        f"(95% interval over its steps and its {SEGMENTS} quarters [{gi.low * 100:+.1f}, "
        f"{gi.high * 100:+.1f}]%): repeat the run ({runs} of this configuration) and advise on their "
        "folder, which pools the repeats"
    )
