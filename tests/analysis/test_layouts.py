"""Throttle-to-slowdown in every parallel layout, sampling gaps and the clamped bubble, on
hand-computed traces (docs/analysis.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from charllm_nemo.analysis.analyze import analyze
from charllm_nemo.analysis.figures_run import broken_at_gaps
from tests.analysis.helpers import phased_run


def _rows(table, run="run"):  # type: ignore[no-untyped-def]
    return {r["rank"]: r for r in table.to_pylist() if r["run"] == run}


PP2 = [{"pp_stage": 0, "tp_rank": 0, "dp_rank": 0}, {"pp_stage": 1, "tp_rank": 0, "dp_rank": 0}]
TP2 = [{"pp_stage": 0, "tp_rank": 0, "dp_rank": 0}, {"pp_stage": 0, "tp_rank": 1, "dp_rank": 0}]
DP2 = [{"pp_stage": 0, "tp_rank": 0, "dp_rank": 0}, {"pp_stage": 0, "tp_rank": 0, "dp_rank": 1}]


@pytest.mark.parametrize("layout", [PP2, TP2], ids=["pp2", "tp2"])
def test_a_hot_rank_without_data_parallel_peers_shows_by_its_clock(tmp_path: Path, layout) -> None:  # type: ignore[no-untyped-def]
    # Rank 1 computes at 1000 MHz, rank 0 at 2000: compute-bound work takes twice as long, +100 %.
    # In pp2 its stage has no peer; in tp2 its peer waits inside the same phases (equal times).
    phased_run(tmp_path / "run", layout, clocks=[2000.0, 1000.0])
    rows = _rows(analyze(tmp_path / "run").tables["throttle_slowdown"])
    assert rows[1]["slowdown_vs_fastest"] == pytest.approx(1.0)
    assert rows[1]["slowdown_baseline"] == "fastest_device_clock"
    assert rows[1]["slowdown_vs_dp_peers"] is None
    assert rows[1]["fastest_clock_mhz"] == pytest.approx(2000.0)
    assert rows[0]["slowdown_vs_fastest"] == pytest.approx(0.0)


def test_a_hot_data_parallel_rank_shows_by_its_clock_and_its_compute_time(tmp_path: Path) -> None:
    # Rank 1's forward and backward take 1.63x its replica's and its clock is 10 % lower: both
    # measures are there; the clock is the baseline (it names the slow rank in every layout).
    phased_run(tmp_path / "run", DP2, clocks=[2000.0, 1800.0], busy_scale=[1.0, 1.63])
    rows = _rows(analyze(tmp_path / "run").tables["throttle_slowdown"])
    assert rows[1]["slowdown_vs_dp_peers"] == pytest.approx(0.63)
    assert rows[1]["slowdown_vs_fastest_clock"] == pytest.approx(2000 / 1800 - 1)
    assert rows[1]["slowdown_vs_fastest"] == pytest.approx(2000 / 1800 - 1)
    assert rows[1]["slowdown_baseline"] == "fastest_device_clock"
    assert rows[0]["slowdown_vs_fastest"] == pytest.approx(0.0)


def test_the_cool_replica_held_back_by_its_host_gets_no_slowdown(tmp_path: Path) -> None:
    # Issue #41: rank 0 (cool, 2000 MHz) was held back by its host's CPUs (its forward and
    # backward 2.74x its replica's), rank 1 is hot (1800 MHz). Compute time alone gave the cool
    # rank +174 %; its device runs at its replicas' highest clock, so its slowdown is 0, as the
    # alerts say (host contention, not its device); the time as measured stays in busy_vs_dp_peers.
    phased_run(tmp_path / "run", DP2, clocks=[2000.0, 1800.0], busy_scale=[2.74, 1.0])
    rows = _rows(analyze(tmp_path / "run").tables["throttle_slowdown"])
    assert rows[0]["busy_vs_dp_peers"] == pytest.approx(1.74)
    assert rows[0]["slowdown_vs_dp_peers"] == 0.0 and rows[0]["slowdown_vs_fastest"] == pytest.approx(0.0)
    assert rows[1]["slowdown_vs_dp_peers"] == pytest.approx(0.0)  # the fastest busy time of the two
    assert rows[1]["slowdown_vs_fastest"] == pytest.approx(2000 / 1800 - 1)


def test_without_clock_readings_the_data_parallel_replicas_are_the_baseline(tmp_path: Path) -> None:
    phased_run(tmp_path / "run", DP2, clocks=[float("nan")] * 2, busy_scale=[1.0, 1.63])
    rows = _rows(analyze(tmp_path / "run").tables["throttle_slowdown"])
    assert rows[1]["slowdown_vs_fastest_clock"] is None
    assert rows[1]["slowdown_vs_fastest"] == pytest.approx(0.63)
    assert rows[1]["slowdown_baseline"] == "dp_peers_compute_time"
    assert rows[0]["slowdown_vs_fastest"] == pytest.approx(0.0)
    # A pipeline stage alone and no clock: no baseline, said so.
    phased_run(tmp_path / "pp", PP2, clocks=[float("nan")] * 2, busy_scale=[1.0, 1.63])
    rows = _rows(analyze(tmp_path / "pp").tables["throttle_slowdown"], run="pp")
    assert rows[1]["slowdown_baseline"] == "none" and rows[1]["slowdown_vs_fastest"] == 0.0


def test_an_even_pipeline_without_a_hot_device_has_no_slowdown(tmp_path: Path) -> None:
    # Stage 1 does twice the work by design (an uneven layout) at the same clock: no slowdown.
    phased_run(tmp_path / "run", PP2, clocks=[2000.0, 2000.0], busy_scale=[0.5, 1.0])
    rows = _rows(analyze(tmp_path / "run").tables["throttle_slowdown"])
    assert [rows[r]["slowdown_vs_fastest"] for r in (0, 1)] == pytest.approx([0.0, 0.0])


def test_a_sampling_gap_is_flagged_per_rank_and_step(tmp_path: Path) -> None:
    # Rank 1 has no sample in (2.0 s, 3.0 s): step 1 [1.5, 2.4] loses 0.4 s of 0.9 s, step 2
    # [2.5, 3.4] loses 0.5 s; the longest interval without a sample inside is 0.5 s in both.
    phased_run(tmp_path / "run", DP2, clocks=[2000.0, 2000.0], hole=(1, 2.0, 3.0))
    a = analyze(tmp_path / "run")
    ranks = _rows(a.tables["sampling_ranks"])
    assert not ranks[0]["flagged"] and ranks[0]["coverage_min"] == pytest.approx(1.0)
    assert ranks[1]["flagged"] and ranks[1]["steps_with_gaps"] == 2
    assert ranks[1]["coverage_min"] == pytest.approx(0.4 / 0.9)
    assert ranks[1]["gap_max_s"] == pytest.approx(0.5)
    steps = a.tables["sampling_steps"].to_pylist()
    assert [(s["step"], s["ranks"]) for s in steps] == [(1, "1"), (2, "1")]
    assert steps[0]["coverage"] == pytest.approx(0.5 / 0.9)
    per_rank = _rows(a.tables["ranks"])
    assert per_rank[1]["coverage"] == pytest.approx(4.0 / 5.0)  # the 1 s hole in a 5 s span
    assert per_rank[1]["gap_max_s"] == pytest.approx(1.0)
    assert per_rank[0]["coverage"] == pytest.approx(1.0)


def test_bubble_energy_is_never_negative(tmp_path: Path) -> None:
    # A grad-sync phase overlaps the backward by 0.1 s: the phases hold 0.1 s x 400 W = 40 J more
    # than each step (3 measured steps). The bubble is clamped at 0 and the excess shown.
    phased_run(tmp_path / "run", DP2, clocks=[2000.0, 2000.0], overlap_s=0.1)
    rows = _rows(analyze(tmp_path / "run").tables["phase_energy"])
    for r in rows.values():
        assert r["bubble_j"] == pytest.approx(0.0) and r["bubble_share"] == pytest.approx(0.0)
        assert r["phases_over_step_j"] == pytest.approx(3 * 40.0)
    # Without the overlap the step's 0.2 s outside any phase is the bubble: 80 J per step.
    phased_run(tmp_path / "run2", DP2, clocks=[2000.0, 2000.0])
    rows = _rows(analyze(tmp_path / "run2").tables["phase_energy"], run="run2")
    assert rows[0]["bubble_j"] == pytest.approx(3 * 80.0) and rows[0]["phases_over_step_j"] == 0.0


def test_the_timeline_breaks_at_a_sampling_gap_and_nowhere_else() -> None:
    # Samples every 10 ms with none in (0.5 s, 1.5 s): one NaN point mid-gap, at 1.0 s; the
    # 20 ms step of a single missed deadline is drawn as a line.
    t = np.arange(0, 2_000_000_001, 10_000_000, dtype=np.int64)
    t = np.delete(t[(t <= 500_000_000) | (t >= 1_500_000_000)], 10)
    p = np.arange(t.size, dtype=np.float64)
    tb, (pb,) = broken_at_gaps(t, p)
    assert tb.size == t.size + 1
    (nan,) = np.flatnonzero(np.isnan(pb))
    assert tb[nan] == 1_000_000_000.0
    assert np.array_equal(pb[~np.isnan(pb)], p) and np.all(np.diff(tb) > 0)
    # Evenly sampled: nothing inserted.
    tb, (pb,) = broken_at_gaps(t[:40], p[:40])
    assert tb.size == 40 and not np.isnan(pb).any()
