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

from charllm_nemo.analysis.load import find_runs
from charllm_nemo.errors import StoreError
from charllm_nemo.telemetry.figures import finite_or_none
from charllm_nemo.telemetry.filecheck import printable, validate_step, validate_summary
from charllm_nemo.telemetry.layout import SIZE_CAPS, iter_jsonl_numbered, read_json, scan_run


@dataclass(frozen=True)
class Figure:
    """One compared figure: its name, unit, which way is better, and whether the difference
    is relative to the baseline's median (a rate, a time) or absolute (a share, whose baseline
    is often 0)."""

    name: str
    unit: str
    higher_is_better: bool
    relative: bool = True


FIGURES: tuple[Figure, ...] = (
    Figure("step_time_s", "s", False),
    Figure("tokens_per_s", "tokens/s", True),
    Figure("energy_per_token_j", "J/token", False),
    Figure("tokens_per_j", "tokens/J", True),
    Figure("power_peak_w", "W", False),
    Figure("temp_gpu_peak_c", "°C", False),
    Figure("throttle_share", "fraction", False, relative=False),
)
"""What ``compare`` reports, in order. Energy per token and tokens per joule use only the steps
every rank reported energy for (a partial sum would flatter the run)."""

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 20250917
"""The bootstrap's fixed seed (reproducible intervals)."""


@dataclass
class Group:
    """One argument's runs and their pooled per-step figures (one array per figure name)."""

    label: str
    runs: list[str]
    values: dict[str, np.ndarray[Any, Any]]
    problems: list[str] = field(default_factory=list)

    def steps(self, name: str) -> int:
        return int(self.values[name].size)


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
    steps pooled. StoreError when ``path`` holds no run."""
    problems: list[str] = []
    pooled: dict[str, list[float]] = {f.name: [] for f in FIGURES}
    runs = find_runs(path)
    for run_dir in runs:
        rows, world = run_steps(run_dir, problems)
        if not rows:
            problems.append(f"{printable(run_dir)}: no step figures (no steps.jsonl, no summary per_step)")
            continue
        measured = rows[skip_first:] if len(rows) > skip_first else rows
        for row in measured:
            for name, v in step_figures(row, world).items():
                if v is not None:
                    pooled[name].append(v)
    values = {k: np.asarray(v, dtype=np.float64) for k, v in pooled.items()}
    return Group(str(path), [str(r) for r in runs], values, problems)


def _block_indices(n: int, rng: np.random.Generator, resamples: int) -> np.ndarray[Any, Any]:
    """``resamples`` rows of ``n`` step indices, each row made of moving blocks (wrapping)."""
    block = max(1, math.ceil(n ** (1 / 3)))
    blocks = math.ceil(n / block)
    starts = rng.integers(0, n, size=(resamples, blocks))
    idx = (starts[:, :, None] + np.arange(block)[None, None, :]) % n
    return idx.reshape(resamples, blocks * block)[:, :n]


def bootstrap_difference(
    a: np.ndarray[Any, Any],
    b: np.ndarray[Any, Any],
    *,
    relative: bool = True,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = SEED,
) -> tuple[float, float, float]:
    """The difference of medians, relative ``(med(b) - med(a)) / |med(a)|`` or absolute
    ``med(b) - med(a)``, and its bootstrap interval ``(low, high)`` at ``confidence``; NaNs when
    either side is empty (or, relative, med(a) is 0)."""
    if a.size == 0 or b.size == 0:
        return math.nan, math.nan, math.nan
    med_a = float(np.median(a))
    if relative and med_a == 0:
        return math.nan, math.nan, math.nan
    point = (float(np.median(b)) - med_a) / (abs(med_a) if relative else 1.0)
    rng = np.random.default_rng(seed)
    diffs = np.empty(resamples)
    chunk = max(1, 4_000_000 // max(a.size, b.size))  # bounds the index matrices (~32 MB each)
    for lo in range(0, resamples, chunk):
        k = min(chunk, resamples - lo)
        ma = np.median(a[_block_indices(a.size, rng, k)], axis=1)
        mb = np.median(b[_block_indices(b.size, rng, k)], axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            diffs[lo : lo + k] = (mb - ma) / np.abs(ma) if relative else mb - ma
    diffs = diffs[np.isfinite(diffs)]
    if diffs.size == 0:
        return point, math.nan, math.nan
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(diffs, [tail, 100 - tail])
    return point, float(low), float(high)


def verdict(figure: Figure, low: float, high: float) -> str:
    """``better`` / ``worse`` when the interval excludes zero, else ``no clear difference``."""
    if not (math.isfinite(low) and math.isfinite(high)) or low <= 0 <= high:
        return "no clear difference"
    up = low > 0
    return "better" if up == figure.higher_is_better else "worse"


def compare_groups(groups: list[Group]) -> dict[str, Any]:
    """Every group against the first: per figure, the medians, steps, the relative difference,
    its interval and the verdict. JSON-ready."""
    if len(groups) < 2:
        raise StoreError("compare needs at least two runs (or sweep configurations): A B [C ...]")
    base = groups[0]
    out: dict[str, Any] = {
        "baseline": base.label,
        "confidence": CONFIDENCE,
        "resamples": RESAMPLES,
        "groups": [
            {"label": g.label, "runs": g.runs, "steps": {f.name: g.steps(f.name) for f in FIGURES}}
            for g in groups
        ],
        "comparisons": [],
        "problems": [p for g in groups for p in g.problems],
    }
    for g in groups[1:]:
        rows = []
        for f in FIGURES:
            a, b = base.values[f.name], g.values[f.name]
            point, low, high = bootstrap_difference(a, b, relative=f.relative)
            rows.append(
                {
                    "figure": f.name,
                    "unit": f.unit,
                    "baseline_median": float(np.median(a)) if a.size else None,
                    "median": float(np.median(b)) if b.size else None,
                    "difference": None if math.isnan(point) else point,
                    "difference_kind": "relative" if f.relative else "absolute",
                    "interval": None if math.isnan(low) else [low, high],
                    "verdict": verdict(f, low, high) if a.size and b.size else "not measured",
                }
            )
        out["comparisons"].append({"label": g.label, "figures": rows})
    return out


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4g}"


def render(result: dict[str, Any]) -> str:
    """The comparison as console text (every string from a run directory escaped)."""
    lines = [f"baseline: {printable(result['baseline'])}"]
    for cmp in result["comparisons"]:
        lines.append(
            f"{printable(cmp['label'])} against the baseline ({int(result['confidence'] * 100)} % intervals):"
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
