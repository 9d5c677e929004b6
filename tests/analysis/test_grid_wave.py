"""The job power waveform built from the ranks' own read (analysis/grid_wave.py: ``rank_wave`` in
the reduction's workers, ``WaveBuilder`` in rank order, issue #45) equals the one read again
rank by rank (``job_waveform``): the same ``grid_power`` and ``grid_whatif`` rows and the same
problems, on stores that take each branch of the waveform: clock records or none, module power
on every GPU or some, a clock years off, no step windows, two devices in one rank with a gap
and a null power."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from charllm_nemo.analysis.analyze import analyze
from charllm_nemo.analysis.grid_power import GridOptions, grid_tables
from charllm_nemo.analysis.load import find_runs, open_run
from charllm_nemo.analysis.run_info import run_info
from charllm_nemo.analysis.store_writer import write_rank

from .test_grid_power import SECONDS, stand_in, wave


def _years_off(run: Path) -> None:
    t_ns = np.arange(1000, dtype=np.int64) * 10_000_000 + 10**9
    years = 10 * 365 * 86400 * 10**9
    for r, shift in enumerate((0, years)):
        write_rank(run, r, {"t_mono_ns": t_ns + shift, "power_instant_w": np.full(1000, 300.0)},
                   {"t_begin_mono_ns": np.zeros(0, np.int64)}, {"world_size": 2})  # fmt: skip


def _no_steps(run: Path) -> None:
    n = int(SECONDS * 100)
    t_s = np.arange(n) * 0.01
    for r in range(2):
        empty = {"t_begin_mono_ns": np.zeros(0, np.int64)}
        write_rank(run, r, {"t_mono_ns": np.round(t_s * 1e9).astype(np.int64) + 10**9,
                            "power_instant_w": wave(t_s)}, empty, {"world_size": 2})  # fmt: skip


def _two_devices_with_a_gap(run: Path) -> None:
    n = 2000
    t = np.arange(n, dtype=np.int64) * 10_000_000 + 10**9
    keep = (t < 5 * 10**9) | (t > 7 * 10**9)  # a 2 s gap: uncovered points, never a low reading
    power = wave(np.arange(n) * 0.01)
    power[100] = np.nan
    for r in range(2):
        samples = {
            "t_mono_ns": np.concatenate((t[keep], t[keep] + 3_000_000)),
            "t_wall_ns": np.concatenate((t[keep], t[keep] + 3_000_000)) + 1_700_000_000 * 10**9,
            "device_index": np.repeat(np.array([0, 1], np.int64), int(keep.sum())),
            "power_instant_w": np.concatenate((power[keep], power[keep] + 50.0)),
        }
        b = t[::100][:-1] + 5_000_000
        windows = {"window_id": np.arange(b.size, dtype=np.int64), "kind": ["step"] * b.size,
                   "name": ["step"] * b.size, "step": np.arange(b.size, dtype=np.int64),
                   "t_begin_mono_ns": b, "t_end_mono_ns": b + 900_000_000}  # fmt: skip
        write_rank(run, r, samples, windows, {"world_size": 2, "host": "node0"})


STORES: dict[str, Callable[[Path], Any]] = {
    "clock_records": stand_in,
    "samples_clock": lambda p: stand_in(p, clock=False),
    "module_power": lambda p: stand_in(p, module_extra_w=[20.0] * 4),
    "module_power_on_some": lambda p: stand_in(p, module_extra_w=[20.0, None, 20.0, 20.0]),
    "clock_years_off": _years_off,
    "no_step_windows": _no_steps,
    "two_devices_gap_null": _two_devices_with_a_gap,
}


@pytest.mark.parametrize("store", sorted(STORES))
def test_waveform_from_the_ranks_own_read_equals_the_one_read_again(
    tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHARLLM_ANALYZE_WORKERS", "1")  # the same reduction, in this process
    STORES[store](tmp_path)
    options = GridOptions(fleet_gpus=1000)
    got = analyze(tmp_path, grid=options)
    (run,) = (open_run(p, tmp_path) for p in find_runs(tmp_path))
    problems: list[str] = []
    want = grid_tables([run], pa.Table.from_pylist([run_info(run)]), options, problems)
    assert want, "each store has a waveform"
    for name in ("grid_power", "grid_whatif"):
        assert got.tables[name].to_pylist() == want[name].to_pylist(), name
    assert [p for p in got.problems if p in problems] == problems  # the same lines, in order
    if store in ("clock_years_off", "module_power_on_some"):
        assert problems  # the branches that say something did
