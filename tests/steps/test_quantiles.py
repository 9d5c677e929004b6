"""summary.json's medians in bounded memory: exact while few, within the stated error after."""

from __future__ import annotations

import random
import statistics

import pytest

from charllm_nemo.steps.quantiles import EXACT_VALUES, MAX_BUCKETS, RELATIVE_ERROR, MedianSketch
from charllm_nemo.steps.summary import PER_STEP_KEPT, RunSummary, run_summary


def _median_of(values: list[float]) -> MedianSketch:
    sketch = MedianSketch()
    for v in values:
        sketch.add(v)
    return sketch


def test_up_to_the_exact_limit_the_median_is_the_exact_one() -> None:
    rng = random.Random(1)
    for n in (1, 2, 3, 10, EXACT_VALUES):  # odd and even counts: the mean of the two middle ones
        values = [rng.lognormvariate(0, 1) for _ in range(n)]
        m = _median_of(values).median()
        assert m is not None and m.exact and m.value == statistics.median(values)
    assert MedianSketch().median() is None


@pytest.mark.parametrize("n", [EXACT_VALUES + 1, 5 * EXACT_VALUES + 2])
def test_past_it_the_median_is_within_the_stated_relative_error(n: int) -> None:
    rng = random.Random(n)
    # step times with a slow tail, a share of exact zeros (throttle_share), and of negatives
    for values in (
        [rng.lognormvariate(-3, 0.5) for _ in range(n)],
        [0.0 if rng.random() < 0.4 else rng.uniform(0.001, 1.0) for _ in range(n)],
        [rng.gauss(-5.0, 1.0) for _ in range(n)],
    ):
        m = _median_of(values).median()
        exact = statistics.median(values)
        assert m is not None and not m.exact and m.bounded
        assert abs(m.value - exact) <= RELATIVE_ERROR * abs(exact) + 1e-300


def test_memory_is_bounded_and_a_median_among_merged_buckets_says_it_has_no_bound() -> None:
    sketch = MedianSketch()
    # 60 decades, most values tiny: the smallest buckets are merged past MAX_BUCKETS
    for k in range(20 * MAX_BUCKETS):
        sketch.add(10.0 ** (-30 + 60 * (k % 997) / 997))
    assert len(sketch._pos) <= MAX_BUCKETS and sketch._exact is None
    m = sketch.median()
    assert m is not None and m.bounded  # the middle lies above what was merged
    low = MedianSketch()
    for k in range(3 * MAX_BUCKETS):  # each in its own bucket: two thirds of them merged
        low.add(10.0 ** (-30 + k * 0.01))
    assert len(low._pos) <= MAX_BUCKETS
    m = low.median()
    assert m is not None and not m.bounded  # the middle fell into merged buckets: said, not hidden


def test_the_run_summary_keeps_the_last_steps_and_says_how_the_medians_were_made() -> None:
    acc = RunSummary(world_size=2)
    n = PER_STEP_KEPT + EXACT_VALUES + 10
    for step in range(n):
        acc.add_row({"step": step, "step_time_s": 1.0 + step % 7, "energy_j": 50.0, "ranks_reporting": 1})
    s = acc.summary()
    assert s["steps"] == n and s["steps_in_medians"] == n - 1
    assert [r["step"] for r in s["per_step"]] == list(range(n - PER_STEP_KEPT, n))
    assert s["per_step_dropped"] == n - PER_STEP_KEPT
    assert s["medians"] == {"method": "sketch", "relative_error": RELATIVE_ERROR, "exact_up_to": EXACT_VALUES}
    assert s["step_time_s_median"] == pytest.approx(4.0, rel=RELATIVE_ERROR)
    assert s["energy_j_median"] is None  # only 1 of 2 ranks reported it: no partial sums
    short = run_summary([{"step_time_s": 9.0}, {"step_time_s": 1.0}, {"step_time_s": 3.0}])
    assert (
        short["medians"] == {"method": "exact", "relative_error": 0.0} and short["step_time_s_median"] == 2.0
    )
