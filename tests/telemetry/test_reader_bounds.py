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


def test_all_null_columns_are_left_undecoded_and_read_as_the_same_nulls(tmp_path: Path) -> None:
    """A column whose footer statistics count only nulls is not decoded (``null_ok``); the reader
    gives the same all-null column as before, and one of the wrong type (strings where watts
    belong) is still read and reported."""
    import pyarrow.parquet as pq

    from charllm_nemo.telemetry.layout import read_parquet
    from charllm_nemo.telemetry.reader import read_segments
    from charllm_nemo.telemetry.sampler import SAMPLES_SCHEMA

    seg = tmp_path / "samples-000000.parquet"
    table = pa.table(
        {
            "t_mono_ns": pa.array([1, 2, 3], pa.int64()),
            "power_instant_w": pa.array([None, None, None], pa.float64()),
            "energy_mj": pa.array([None, None, None], pa.int64()),
            "temp_gpu_c": pa.array([None, None, None], pa.string()),
            "clock_sm_mhz": pa.array([1.0, None, 3.0], pa.float64()),
        }
    )
    pq.write_table(table, seg)
    cols = table.column_names
    assert read_parquet(seg, cols).column_names == cols
    left = read_parquet(seg, cols, null_ok=lambda name, typ: not pa.types.is_string(typ))
    assert left.column_names == ["t_mono_ns", "temp_gpu_c", "clock_sm_mhz"]
    problems: list[str] = []
    got = read_segments((seg,), "samples", SAMPLES_SCHEMA, problems, cols)
    assert got is not None and got.num_rows == 3
    for name in ("power_instant_w", "energy_mj", "temp_gpu_c"):
        assert got.column(name).null_count == 3 and got.column(name).type == SAMPLES_SCHEMA.field(name).type
    assert got.column("clock_sm_mhz").to_pylist() == [1.0, None, 3.0]
    assert len(problems) == 1 and "'temp_gpu_c'" in problems[0] and "read as null" in problems[0]
