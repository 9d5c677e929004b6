"""The reader's bounds on sample values (telemetry/reader.py, ``_bounded_values``): the quick
min/max check that lets an in-bounds column through untouched agrees with the value-by-value
check it skips, for floats and ints, with and without nulls."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from charllm_nemo.telemetry.reader import MAX_ABS_FLOAT, MAX_ABS_INT, _all_in_bounds, _bounded_values
from charllm_nemo.telemetry.schema import INT_NULL

CASES = [
    (pa.array([1.0, None, -MAX_ABS_FLOAT, MAX_ABS_FLOAT], pa.float64()), True, []),
    (pa.array([1.0, None, float("nan")], pa.float64()), False, [1.0, None, None]),
    (pa.array([1.0, None, -2 * MAX_ABS_FLOAT], pa.float64()), False, [1.0, None, None]),
    (pa.array([float("inf"), 2.0], pa.float64()), False, [None, 2.0]),
    (pa.array([5, None, -(2**61)], pa.int64()), True, []),
    (pa.array([5, None, -MAX_ABS_INT - 1], pa.int64()), False, [5, None, None]),
    (pa.array([5, INT_NULL], pa.int64()), True, []),  # the null marker is kept as it is
    (pa.array([None, None], pa.int64()), True, []),
]


@pytest.mark.parametrize(("values", "quick", "after"), CASES)
def test_quick_bounds_check_agrees_with_the_value_by_value_one(
    tmp_path: Path, values: pa.Array, quick: bool, after: list[object]
) -> None:
    col = pa.chunked_array([values[:1], values[1:]])  # two chunks, as concatenated segments give
    assert _all_in_bounds(col) is quick
    problems: list[str] = []
    got = _bounded_values(col, "x", tmp_path, problems)
    if quick:
        assert got is col and not problems
    else:
        assert got.to_pylist() == after
        assert bool(problems) == (after != values.to_pylist())
