"""Coverage of charllm compare's hierarchical interval on synthetic runs with a known truth.

Each trial draws two groups of ``runs`` runs of ``steps`` steps: a run's level is
``1 + N(0, run_sd)`` (the host's minute), its steps ``1 + AR(1)`` noise of sd ``step_sd`` (rho
0.5: a hot device stays hot); the second group is ``1 + delta`` times the first, so the true
relative difference of the medians is ``delta``. Coverage is the share of trials whose 95 %
interval holds ``delta``; the same trials with the step-only (unwidened) interval beside it.

    .venv/bin/python bench/bench_compare_coverage.py            # the table of docs/compare-energy.md
"""

from __future__ import annotations

import sys
import time

import numpy as np

from charllm_nemo.analysis.compare_stats import hierarchical_difference


def _group(
    rng: np.random.Generator, runs: int, steps: int, run_sd: float, step_sd: float, scale: float
) -> list[np.ndarray]:
    out = []
    for _ in range(runs):
        e = rng.normal(0, step_sd, steps)
        for i in range(1, steps):  # AR(1), rho 0.5, stationary sd step_sd
            e[i] = 0.5 * e[i - 1] + np.sqrt(0.75) * e[i]
        out.append(scale * (1 + rng.normal(0, run_sd)) * (1 + e))
    return out


def coverage(
    *,
    runs: int,
    steps: int,
    run_sd: float,
    step_sd: float,
    trials: int,
    resamples: int = 1000,
    delta: float = 0.05,
    widen: bool = True,
    seed: int = 1,
) -> float:
    """The share of ``trials`` whose interval holds the true ``delta``."""
    rng = np.random.default_rng(seed)
    hits = 0
    for t in range(trials):
        a = _group(rng, runs, steps, run_sd, step_sd, 1.0)
        b = _group(rng, runs, steps, run_sd, step_sd, 1.0 + delta)
        _, low, high = hierarchical_difference(a, b, resamples=resamples, seed=t, widen=widen)
        hits += low <= delta <= high
    return hits / trials


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    print(f"95 % interval, true difference +5 %, {trials} trials each, 1000 resamples")
    print(f"{'runs':>4} {'steps':>5} {'run sd':>6} {'step sd':>7}  {'hierarchical':>12}  {'unwidened':>9}  s")
    for runs, steps, run_sd, step_sd in [
        (3, 30, 0.05, 0.05), (3, 30, 0.0, 0.05), (3, 60, 0.10, 0.02), (5, 30, 0.05, 0.05),
        (10, 20, 0.05, 0.05), (3, 12, 0.06, 0.05),
    ]:  # fmt: skip
        t0 = time.perf_counter()
        got = coverage(runs=runs, steps=steps, run_sd=run_sd, step_sd=step_sd, trials=trials)
        raw = coverage(runs=runs, steps=steps, run_sd=run_sd, step_sd=step_sd, trials=trials, widen=False)
        took = time.perf_counter() - t0
        cells = f"{got * 100:>11.1f}%  {raw * 100:>8.1f}%"
        print(f"{runs:>4} {steps:>5} {run_sd:>6.2f} {step_sd:>7.2f}  {cells}  {took:.0f}")


if __name__ == "__main__":
    main()
