"""``charllm compare A B [C ...]``: did a change help? Run against run, with the spread.

Each argument is a run directory, a sweep configuration (``run=<key>``, its latest attempt) or a
tree of them; the per-step figures of every run found under one argument are pooled into one
group (repeats of a configuration count together). The first group is the baseline; every other
group is compared with it on each figure of :data:`FIGURES`:

* the figure's median over the group's measured steps (the first step of each run, warm-up and
  allocation, is left out when the run has more, as ``summary.json``'s medians do);
* the relative difference of the medians, ``(median_B - median_A) / |median_A|`` (for the
  throttle share, whose baseline is often 0, the absolute difference);
* a 95 % interval for that difference from a moving-block bootstrap over steps (consecutive
  steps are correlated: a hot device stays hot, so resampling single steps would understate the
  spread; blocks of ``ceil(n ** (1/3))`` steps keep that correlation);
* a verdict (``better`` / ``worse``, by the figure's direction) only where the interval
  excludes zero; otherwise ``no clear difference``.

The bootstrap's random generator is seeded, so the same runs give the same intervals. The steps
come from rank 0's ``steps.jsonl`` (or ``summary.json``'s ``per_step`` when the run has no
``steps.jsonl``), read through the hardened reader (:mod:`charllm_nemo.telemetry.layout`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from charllm_nemo.analysis.compare_stats import (
    CONFIDENCE,
    MAX_REPEATS,
    MIN_REPEATS,
    RESAMPLES,
    SEED,
    hierarchical_difference,
    repeats_needed,
    segment_spread,
    trend_change,
)
from charllm_nemo.analysis.load import find_runs
from charllm_nemo.errors import StoreError
from charllm_nemo.telemetry.figures import finite_or_none
from charllm_nemo.telemetry.filecheck import printable, validate_step, validate_summary
from charllm_nemo.telemetry.layout import SIZE_CAPS, iter_jsonl_numbered, read_json, scan_run


@dataclass(frozen=True)
class Figure:
    """One compared figure: its name, unit, which way is better, whether the difference is
    relative to the baseline's median (a rate, a time) or absolute (a share, whose baseline is
    often 0), whether it is *time-like* (its run-to-run spread comes from the host as much as
    from the configuration: one run per side cannot judge it), and its resolution (absolute, in
    its unit: a difference below it is no difference)."""

    name: str
    unit: str
    higher_is_better: bool
    relative: bool = True
    time_like: bool = False
    resolution: float = 0.0


POWER_RESOLUTION_W = 5.0
"""NVIDIA's stated accuracy of a board power reading (nvidia-smi(1), ``power.draw``: "accurate to
within +/- 5 watts"): two peaks closer than that are not told apart."""

FIGURES: tuple[Figure, ...] = (
    Figure("step_time_s", "s", False, time_like=True, resolution=1e-6),
    Figure("tokens_per_s", "tokens/s", True, time_like=True),
    Figure("energy_per_token_j", "J/token", False, time_like=True),
    Figure("tokens_per_j", "tokens/J", True, time_like=True),
    Figure("power_peak_w", "W", False, resolution=POWER_RESOLUTION_W),
    Figure("temp_gpu_peak_c", "°C", False, resolution=1.0),
    Figure("throttle_share", "fraction", False, relative=False, resolution=1e-3),
)
"""What ``compare`` reports, in order. Energy per token and tokens per joule use only the steps
every rank reported energy for (a partial sum would flatter the run). Resolutions: a step's time
from marks on a monotonic clock, 1 µs (tokens/s and the energy figures follow from the step's
time and the energy counter: their resolution is taken relative, :data:`RELATIVE_RESOLUTION`);
temperatures are whole degrees; throttle shares are told apart to 0.1 percentage point."""

RELATIVE_RESOLUTION = 1e-6
"""The smallest relative difference any relative figure can show (a 1 µs mark on a step of
1 s; an energy counter's 1 mJ on 1 kJ)."""

MIN_STEPS = 2
"""Fewest measured values a side needs for any verdict (one step has no spread)."""

SEGMENTS = 4
"""A single run's drift: its steps in this many consecutive parts (docs/compare-energy.md)."""


@dataclass
class Group:
    """One argument's runs and their per-step figures: ``per_run[name]`` one array per run
    (measured steps in step order), ``elapsed[name]`` the matching end times of those steps in s
    since the run's first step began (the sum of step times: for an equal-time comparison),
    ``values[name]`` every run's values pooled."""

    label: str
    runs: list[str]
    per_run: dict[str, list[np.ndarray[Any, Any]]]
    elapsed: dict[str, list[np.ndarray[Any, Any]]]
    problems: list[str] = field(default_factory=list)

    @property
    def values(self) -> dict[str, np.ndarray[Any, Any]]:
        return {k: np.concatenate(v) if v else np.empty(0) for k, v in self.per_run.items()}

    def steps(self, name: str) -> int:
        return int(sum(a.size for a in self.per_run[name]))

    def runs_with(self, name: str) -> int:
        return sum(1 for a in self.per_run[name] if a.size)


def step_figures(row: dict[str, Any], world_size: int | None) -> dict[str, float | None]:
    """The compared figures of one step line (None where the line cannot give one)."""
    step_time = finite_or_none(row.get("step_time_s"))
    tps = finite_or_none(row.get("tokens_per_s"))
    energy = finite_or_none(row.get("energy_j"))
    reporting = row.get("ranks_reporting")
    if world_size is not None and isinstance(reporting, int) and reporting < world_size:
        energy = None  # a partial sum over the ranks that reported
    tokens = tps * step_time if tps is not None and step_time is not None and step_time > 0 else None
    per_token = energy / tokens if energy is not None and tokens else None
    return {
        "step_time_s": step_time,
        "tokens_per_s": tps,
        "energy_per_token_j": per_token,
        "tokens_per_j": 1.0 / per_token if per_token else None,
        "power_peak_w": finite_or_none(row.get("power_peak_w")),
        "temp_gpu_peak_c": finite_or_none(row.get("temp_gpu_peak_c")),
        "throttle_share": finite_or_none(row.get("throttle_share")),
    }


def run_steps(run_dir: Path, problems: list[str]) -> tuple[list[dict[str, Any]], int | None]:
    """Rank 0's step lines of one run (validated, sorted by step, one per step) and the run's
    world size (from ``summary.json``, else the rank folders)."""
    files = scan_run(run_dir)
    summary: dict[str, Any] = {}
    if files.summary is not None:
        summary = validate_summary(
            read_json(files.summary, SIZE_CAPS["summary"], problems), files.summary, problems
        )
    rows: dict[int, dict[str, Any]] = {}
    if files.steps is not None:
        for lineno, data in iter_jsonl_numbered(files.steps, SIZE_CAPS["steps"], problems):
            row = validate_step(data, f"{files.steps}:{lineno}", problems)
            if isinstance(row.get("step"), int):
                rows[row["step"]] = row
    elif isinstance(summary.get("per_step"), list):
        for i, entry in enumerate(summary["per_step"]):
            row = validate_step(entry, files.summary or run_dir, problems, what=f"per_step[{i}]")
            if isinstance(row.get("step"), int):
                rows[row["step"]] = row
    world = summary.get("world_size")
    if not isinstance(world, int) or world < 1:
        world = len(files.ranks) or None
    return [rows[s] for s in sorted(rows)], world


def load_group(path: str | os.PathLike[str], skip_first: int = 1) -> Group:
    """Every run under ``path`` (:func:`~charllm_nemo.analysis.load.find_runs`), its measured
    steps kept per run. StoreError when ``path`` holds no run."""
    problems: list[str] = []
    per_run: dict[str, list[np.ndarray[Any, Any]]] = {f.name: [] for f in FIGURES}
    elapsed: dict[str, list[np.ndarray[Any, Any]]] = {f.name: [] for f in FIGURES}
    runs = find_runs(path)
    for run_dir in runs:
        rows, world = run_steps(run_dir, problems)
        if not rows:
            problems.append(f"{printable(run_dir)}: no step figures (no steps.jsonl, no summary per_step)")
            for f in FIGURES:  # an empty entry keeps per_run aligned with runs
                per_run[f.name].append(np.empty(0))
                elapsed[f.name].append(np.empty(0))
            continue
        # Time since the run's first step began, at each step's end (warm-up included: the die
        # warms through it too); a step without a time adds nothing.
        ends = np.cumsum([max(0.0, finite_or_none(r.get("step_time_s")) or 0.0) for r in rows])
        first = skip_first if len(rows) > skip_first else 0
        figures = [step_figures(row, world) for row in rows[first:]]
        for f in FIGURES:
            kept = [
                (v, t)
                for v, t in zip((x[f.name] for x in figures), ends[first:], strict=True)
                if v is not None
            ]
            per_run[f.name].append(np.asarray([v for v, _ in kept], dtype=np.float64))
            elapsed[f.name].append(np.asarray([t for _, t in kept], dtype=np.float64))
    return Group(str(path), [str(r) for r in runs], per_run, elapsed, problems)


def bootstrap_difference(
    a: np.ndarray[Any, Any],
    b: np.ndarray[Any, Any],
    *,
    relative: bool = True,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = SEED,
) -> tuple[float, float, float]:
    """One run against one run: the difference of medians and its moving-block bootstrap
    interval over steps (:func:`.compare_stats.hierarchical_difference` with one run a side)."""
    return hierarchical_difference(
        [a], [b], relative=relative, resamples=resamples, confidence=confidence, seed=seed
    )


@dataclass
class Judged:
    """One figure of one comparison: the point difference, its interval, the verdict and why."""

    point: float
    low: float
    high: float
    verdict: str
    reason: str | None = None
    interval_kind: str | None = None
    equal_time_s: float | None = None
    repeats_needed: int | None = None


NO_VERDICT = "no verdict"
NO_DIFFERENCE = "no difference"
NO_CLEAR = "no clear difference"


def _band(f: Figure, base_median: float) -> float:
    """The resolution in the difference's units (relative: a fraction of the baseline)."""
    if not f.relative:
        return f.resolution
    return max(f.resolution / abs(base_median) if base_median else 0.0, RELATIVE_RESOLUTION)


def _trend(f: Figure, groups: tuple[Group, Group]) -> tuple[float, str] | None:
    """The largest within-run move of ``f`` in either group and the run it is in (None: flat)."""
    found: tuple[float, str] | None = None
    for g in groups:
        for run, values, ends in zip(g.runs, g.per_run[f.name], g.elapsed[f.name], strict=True):
            change = trend_change(values, ends, f.resolution)
            if change is not None and (found is None or abs(change) > abs(found[0])):
                found = (change, run)
    return found


def _at_equal_time(f: Figure, groups: tuple[Group, Group]) -> tuple[float, list[list[np.ndarray[Any, Any]]]]:
    """Every run's values of ``f`` up to the time the shortest run lasted (s), per group."""
    spans = [float(e[-1]) for g in groups for e in g.elapsed[f.name] if e.size]
    limit = min(spans)
    return limit, [
        [v[e <= limit] for v, e in zip(g.per_run[f.name], g.elapsed[f.name], strict=True)] for g in groups
    ]


def judge(f: Figure, base: Group, other: Group, *, resamples: int = RESAMPLES, seed: int = SEED) -> Judged:
    """Compare ``f`` between two groups (docs/compare-energy.md, "What a verdict rests on")."""
    a_runs, b_runs = base.per_run[f.name], other.per_run[f.name]
    a, b = base.values[f.name], other.values[f.name]
    if a.size == 0 or b.size == 0:
        return Judged(math.nan, math.nan, math.nan, "not measured")
    reasons: list[str] = []
    equal_time = None
    trend = _trend(f, (base, other))
    if trend is not None:
        equal_time, (a_runs, b_runs) = _at_equal_time(f, (base, other))
        reasons.append(
            f"{f.name} trends within a run ({trend[0]:+.4g} {f.unit} through {printable(trend[1], 200)}): "
            f"compared over the first {equal_time:.4g} s of every run (equal time)"
        )
    ra = sum(1 for x in a_runs if x.size)
    rb = sum(1 for x in b_runs if x.size)
    point, low, high = hierarchical_difference(
        a_runs, b_runs, relative=f.relative, resamples=resamples, seed=seed
    )
    kind = "runs and steps" if min(ra, rb) >= 2 else "steps only (one run a side)"

    def no(reason: str, repeats: int | None = None) -> Judged:
        return Judged(point, low, high, NO_VERDICT, "; ".join([*reasons, reason]), kind, equal_time, repeats)

    steps_a, steps_b = sum(x.size for x in a_runs), sum(x.size for x in b_runs)
    if min(steps_a, steps_b) < MIN_STEPS:
        return no(
            f"{min(steps_a, steps_b)} measured step(s) on one side"
            + (" at equal time" if equal_time is not None else "")
            + ": one step has no spread to judge a difference by; train longer"
        )
    if math.isnan(point):
        return no("the baseline's median is 0: no relative difference")
    if min(ra, rb) < 2 and (f.time_like or trend is not None):
        side = "both sides" if max(ra, rb) < 2 else ("the baseline" if ra < 2 else "the compared side")
        if not f.time_like:  # trending: a time-like figure gets the repeats below instead
            return no(
                f"one run on {side}: where a figure trends, its level at a given time depends on how "
                "the run started (a warm device, the room), which one run cannot show; repeat each side "
                f"{MIN_REPEATS} or more times"
            )
        return no(
            f"one run on {side}: " + _repeats_text(f, a_runs, b_runs, point),
            _repeats(a_runs, b_runs, point, a),
        )
    if not (math.isfinite(low) and math.isfinite(high)):
        return no("no interval could be formed")
    band = _band(f, float(np.median(a)))
    if -band <= low and high <= band:
        why = f"the interval lies within the measurement's resolution ({f.resolution:g} {f.unit})"
        if f.relative:
            why = f"the interval lies within the measurement's resolution (±{band * 100:.2g} %)"
        return Judged(point, low, high, NO_DIFFERENCE, "; ".join([*reasons, why]), kind, equal_time)
    if low <= band and high >= -band:
        return Judged(point, low, high, NO_CLEAR, "; ".join(reasons) or None, kind, equal_time)
    up = low > 0
    verdict = "better" if up == f.higher_is_better else "worse"
    return Judged(point, low, high, verdict, "; ".join(reasons) or None, kind, equal_time)


def _spread(
    a_runs: list[np.ndarray[Any, Any]], b_runs: list[np.ndarray[Any, Any]], base: float
) -> float | None:
    """The runs' own drift (RMS over runs of :func:`segment_spread`), relative to ``base``."""
    got = [s for r in (*a_runs, *b_runs) if (s := segment_spread(r, SEGMENTS)) is not None]
    if not got or base == 0:
        return None
    return math.sqrt(sum(x * x for x in got) / len(got)) / abs(base)


def _repeats(
    a_runs: list[np.ndarray[Any, Any]],
    b_runs: list[np.ndarray[Any, Any]],
    point: float,
    a: np.ndarray[Any, Any],
) -> int | None:
    spread = _spread(a_runs, b_runs, float(np.median(a)))
    return None if spread is None else repeats_needed(spread, point)


def _repeats_text(
    f: Figure, a_runs: list[np.ndarray[Any, Any]], b_runs: list[np.ndarray[Any, Any]], point: float
) -> str:
    base = float(np.median(np.concatenate(a_runs)))
    spread = _spread(a_runs, b_runs, base)
    head = (
        f"its interval holds step-to-step variance only, not the run-to-run variance that decides "
        f"{f.name} on a shared host"
    )
    if spread is None:
        return head + f"; repeat each side {MIN_REPEATS} or more times (too few steps to size the repeats)"
    n = repeats_needed(spread, point)
    drift = (
        f"if runs vary between them as much as within them ({spread * 100:.2g} % between a run's "
        "quarters; more on a host whose load changes by the minute)"
    )
    if n is None:
        more = f"more than {MAX_REPEATS} runs a side would be needed"
        return head + f"; {drift}, {more} to tell {point * 100:+.2g} % from it"
    return head + f"; {drift}, about {n} runs a side would resolve a difference of {point * 100:+.2g} %"


def compare_groups(groups: list[Group], resamples: int = RESAMPLES) -> dict[str, Any]:
    """Every group against the first: per figure, the medians, steps and runs, the difference,
    its interval, the verdict and the reason for no verdict. JSON-ready."""
    if len(groups) < 2:
        raise StoreError("compare needs at least two runs (or sweep configurations): A B [C ...]")
    base = groups[0]
    out: dict[str, Any] = {
        "baseline": base.label,
        "confidence": CONFIDENCE,
        "resamples": resamples,
        "groups": [
            {
                "label": g.label,
                "runs": g.runs,
                "steps": {f.name: g.steps(f.name) for f in FIGURES},
                "runs_measured": {f.name: g.runs_with(f.name) for f in FIGURES},
            }
            for g in groups
        ],
        "comparisons": [],
        "problems": [p for g in groups for p in g.problems],
    }
    for g in groups[1:]:
        rows = []
        for f in FIGURES:
            a, b = base.values[f.name], g.values[f.name]
            j = judge(f, base, g, resamples=resamples)
            rows.append(
                {
                    "figure": f.name,
                    "unit": f.unit,
                    "baseline_median": float(np.median(a)) if a.size else None,
                    "median": float(np.median(b)) if b.size else None,
                    "difference": None if math.isnan(j.point) else j.point,
                    "difference_kind": "relative" if f.relative else "absolute",
                    "interval": None if math.isnan(j.low) else [j.low, j.high],
                    "interval_kind": j.interval_kind,
                    "verdict": j.verdict,
                    "reason": j.reason,
                    "equal_time_s": j.equal_time_s,
                    "repeats_needed": j.repeats_needed,
                }
            )
        out["comparisons"].append({"label": g.label, "figures": rows})
    return out


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4g}"


def render(result: dict[str, Any]) -> str:
    """The comparison as console text (every string from a run directory escaped)."""
    lines = [f"baseline: {printable(result['baseline'])}"]
    runs = {g["label"]: g["runs_measured"]["step_time_s"] for g in result["groups"]}
    for cmp in result["comparisons"]:
        lines.append(
            f"{printable(cmp['label'])} ({runs.get(cmp['label'], 0)} run(s)) against the baseline "
            f"({runs.get(result['baseline'], 0)} run(s); {int(result['confidence'] * 100)} % intervals):"
        )
        for row in cmp["figures"]:
            d = row["difference"]
            iv = row["interval"]
            unit = " %" if row["difference_kind"] == "relative" else " pp"  # percentage points
            diff = "n/a" if d is None else f"{d * 100:+.1f}{unit}"
            span = "" if iv is None else f" [{iv[0] * 100:+.1f}, {iv[1] * 100:+.1f}]"
            lines.append(
                f"  {row['figure']:<20} {_num(row['baseline_median']):>10} -> {_num(row['median']):<10} "
                f"{row['unit']:<9} {diff}{span}  {row['verdict']}"
            )
            if row["reason"]:
                lines.append(f"  {'':<20} why: {printable(row['reason'], 1000)}")
    for p in result["problems"]:
        lines.append(f"problem: {printable(p)}")
    return "\n".join(lines)


def cmd_compare(args: Any) -> int:
    """``charllm compare``: print the comparison (text or JSON); exit 2 when an argument holds no run."""
    import json
    import sys

    try:
        groups = [load_group(p) for p in args.paths]
        result = compare_groups(groups)
    except StoreError as exc:
        print(f"charllm compare: {printable(exc, limit=400)}", file=sys.stderr)
        return 2
    if args.format == "json":
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        print(render(result))
    return 0
