"""charllm energy: energy to train with its bound, carbon, and the MLPerf power-rule statement."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest

from charllm_nemo.analysis.analyze import analyze
from charllm_nemo.analysis.energy import GridIntensity, energy_reports, read_grid_csv
from charllm_nemo.analysis.metrics import counter_update_period_s
from charllm_nemo.cli import main
from charllm_nemo.errors import ConfigError

from .helpers import constant_run

WALL = {"started_wall_ns": 1_000 * 10**9, "ended_wall_ns": 1_010 * 10**9}


def test_energy_of_a_constant_run_and_its_bound(tmp_path: Path) -> None:
    # 2 ranks at 400 W for 5 s: 2000 J each, 4000 J in all. The counter is read every 10 ms, so
    # a tick is placed within 10 ms: the delta between the first and the last tick is off by at
    # most 0.01 s x 400 W = 4 J (the two ends err in opposite directions: the larger, not the
    # sum), plus 1 mJ of resolution; the edges are flat power, exact. Before: 2 x 0.01 x 400 a
    # device, twice that.
    constant_run(tmp_path, ranks=2, power_w=400.0, seconds=5.0, manifest=WALL)
    (r,) = energy_reports(analyze(tmp_path))
    assert r["energy_j"] == pytest.approx(4000.0, rel=1e-9)
    assert r["uncertainty_j"] == pytest.approx(2 * (4.0 + 1e-3), rel=1e-6)
    assert r["unbounded_devices"] == []
    # The run's mean power is over the same span as its energy and time (the measured steps).
    (row,) = analyze(tmp_path).tables["runs"].to_pylist()
    assert row["power_avg_w"] * row["execution_time_s"] * 2 == pytest.approx(row["energy_j"], rel=1e-12)
    assert [d["method"] for d in r["per_device"]] == ["counter", "counter"]
    assert all(d["coverage"] == 1.0 for d in r["per_device"])
    assert all(d["counter_update_period_s"] == pytest.approx(0.01) for d in r["per_device"])
    assert r["ranks_missing"] == 0 and r["energy_scaled_to_world_j"] is None
    # Steps 1-3 (step 0, warm-up, left out) span 1.5 s to 4.4 s at 800 W (both ranks), gaps
    # between steps included: 2320 J over 3 steps.
    assert r["energy_per_step_j"] == pytest.approx(2.9 * 800 / 3, rel=1e-3)
    assert r["mlperf"]["meets"], r["mlperf"]


def test_a_slow_counter_widens_the_bound() -> None:
    t = (np.arange(1001) * 10_000_000).astype(np.int64)  # 100 Hz for 10 s
    ticks = (np.arange(1001) // 10 * 40_000).astype(np.int64)  # moves every 100 ms
    assert counter_update_period_s(t, ticks) == pytest.approx(0.1)
    assert np.isnan(counter_update_period_s(t[:2], ticks[:2]))


def test_missing_ranks_make_a_lower_bound_and_fail_mlperf(tmp_path: Path) -> None:
    constant_run(tmp_path, ranks=1, power_w=300.0, manifest={"world_size": 2, **WALL})
    (r,) = energy_reports(analyze(tmp_path))
    assert r["ranks_missing"] == 1
    assert r["energy_scaled_to_world_j"] == pytest.approx(2 * r["energy_j"])
    assert not r["mlperf"]["meets"]
    assert any("ranks without energy" in x for x in r["mlperf"]["reasons"])


def test_too_few_samples_fail_mlperf(tmp_path: Path) -> None:
    constant_run(tmp_path, ranks=1, seconds=0.5, steps=0, manifest=WALL)  # 51 samples
    (r,) = energy_reports(analyze(tmp_path))
    assert any("fewer than 60 samples" in x for x in r["mlperf"]["reasons"])


def test_carbon_constant_and_time_series(tmp_path: Path) -> None:
    constant_run(tmp_path, ranks=2, power_w=400.0, seconds=5.0, manifest=WALL)
    a = analyze(tmp_path)
    (r,) = energy_reports(a, grid=GridIntensity(((0.0, 400.0),)), pue=1.5)
    # 4000 J = 1/900 kWh; x 1.5 PUE x 400 g/kWh = 0.6667 g
    assert r["carbon"]["co2e_g"] == pytest.approx(4000 / 3.6e6 * 1.5 * 400)
    # Half the run's 10 s wall span at 100 g/kWh, half at 300: 200 on average.
    csv = tmp_path.parent / "grid.csv"
    csv.write_text("time,g_per_kwh\n1000,100\n1970-01-01T00:16:45+00:00,300\n")
    grid = read_grid_csv(csv)
    (r,) = energy_reports(a, grid=grid)
    assert r["carbon"]["grid_g_per_kwh"] == pytest.approx(200.0)
    assert r["carbon"]["weighting"].startswith("time")


def test_bad_grid_and_pue_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "grid.csv"
    bad.write_text("time,g_per_kwh\n1000,lots\n")
    with pytest.raises(ConfigError, match=r"grid.csv:2"):
        read_grid_csv(bad)
    link = tmp_path / "link.csv"
    link.symlink_to(bad)
    with pytest.raises(ConfigError, match="unreadable"):
        read_grid_csv(link)
    run = tmp_path / "run"
    constant_run(run, ranks=1)
    with pytest.raises(ConfigError, match="--pue"):
        energy_reports(analyze(run), pue=0.5)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    constant_run(tmp_path, ranks=2, manifest=WALL)
    assert main(["energy", str(tmp_path), "--grid-g-per-kwh", "350", "--pue", "1.2"]) == 0
    out = capsys.readouterr().out
    assert "MLPerf Training power rules" in out and "g CO2e" in out and "synthetic" in out
    assert main(["energy", str(tmp_path), "--format", "json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)
    assert r["energy_j"] > 0 and "carbon" not in r


def test_corrupt_counter_names_the_column_and_exits_nonzero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A counter that jumps back every 10 samples (a corrupt column): before, `0 J +- -0.196 J`,
    # negative tokens/J or "MLPerf: meets" could follow; now no figure and exit 1.
    n = 501
    sawtooth = (10**9 + (np.arange(n) % 10) * 4000).astype(np.int64)
    constant_run(tmp_path, ranks=1, manifest=WALL, energy_mj=sawtooth)
    assert main(["energy", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "energy_mj" in captured.err and "energy_counter_resets" in captured.err
    assert "MLPerf" not in captured.out and "tokens/J" not in captured.out
    # A counter that never moves while 400 W is drawn: the disagreement names both columns.
    stuck = np.full(n, 10**9, np.int64)
    constant_run(tmp_path / "stuck", ranks=1, manifest=WALL, energy_mj=stuck)
    assert main(["energy", str(tmp_path / "stuck")]) == 1
    assert "ranks.energy_counter_j" in capsys.readouterr().err


def test_the_report_gives_each_kind_of_window_its_bound(tmp_path: Path) -> None:
    # Steps of 0.9 s and microbatches of 0.4 s at 400 W, the counter read every 10 ms: each
    # window's bound is one read interval x 400 W + 1 mJ = 4.001 J, 1.1 % of a step's 360 J and
    # 2.5 % of a microbatch's 160 J; every window has one.
    from charllm_nemo.analysis.report import energy_bound_line

    constant_run(tmp_path, ranks=1, power_w=400.0, seconds=5.0, manifest=WALL)
    a = analyze(tmp_path)
    steps = a.windows.filter(pc.equal(a.windows["kind"], "step"))
    assert steps["energy_bound_j"].to_pylist() == pytest.approx([4.001] * 4)
    assert energy_bound_line(a.windows) == (
        "Energy bounds per window (docs/attribution.md): step median bound 1.1 % of the energy; "
        "microbatch median bound 2.5 % of the energy."
    )
