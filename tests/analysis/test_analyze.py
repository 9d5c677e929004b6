"""charllm analyze end to end on run directories with hand-computed traces, and on bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from charllm_nemo.analysis.analyze import analyze, write_tables
from charllm_nemo.analysis.store_writer import write_rank
from charllm_nemo.cli import main
from charllm_nemo.errors import StoreError
from tests.analysis.helpers import MS, constant_run


def _row(table, **match):  # type: ignore[no-untyped-def]
    rows = [r for r in table.to_pylist() if all(r.get(k) == v for k, v in match.items())]
    assert len(rows) == 1, rows
    return rows[0]


def test_efficiency_metric_of_a_constant_run(tmp_path: Path) -> None:
    # 2 ranks at 400 W. Steps 1-3 are measured (step 0 is warm-up): [1.5 s, 4.4 s], 2.9 s.
    # Energy: 400 W x 2.9 s x 2 GPUs = 2320 J (the counter agrees exactly).
    # Throughput: 8 samples x 3 steps / 2.9 s; efficiency = that / 0.00232 MJ.
    constant_run(tmp_path / "run")
    a = analyze(tmp_path / "run")
    r = _row(a.tables["runs"], run="run")
    assert r["measured_steps"] == 3
    assert r["execution_time_s"] == pytest.approx(2.9)
    assert r["energy_j"] == pytest.approx(2320.0)
    assert r["energy_methods"] == "counter"
    assert r["samples_per_s"] == pytest.approx(24 / 2.9)
    assert r["efficiency_samples_per_s_per_mj"] == pytest.approx((24 / 2.9) / 0.00232)
    assert r["tokens_per_j"] == pytest.approx(8 * 16 * 3 / 2320)
    assert r["energy_per_sample_j"] == pytest.approx(2320 / 24)
    rank = _row(a.tables["ranks"], run="run", rank=1)
    assert rank["power_avg_w"] == pytest.approx(400.0)
    assert rank["energy_counter_j"] == pytest.approx(2000.0)  # 5 s x 400 W
    assert rank["energy_trapezoid_j"] == pytest.approx(2000.0)
    assert rank["energy_disagreement"] == pytest.approx(0.0, abs=1e-12)
    assert rank["pcie_tx_bytes"] == 500_000.0
    assert rank["temp_gpu_avg_c"] == pytest.approx(51.0)
    assert a.problems == []


def test_excursions_of_a_power_step(tmp_path: Path) -> None:
    # One rank, 10 ms samples, 300 W until 0.49 s, 700 W (the limit) from 0.50 s. Microbatch
    # [0.2, 0.8] s of step 1: mean = (0.29 x 300 + 0.01 x 500 + 0.30 x 700) / 0.6 = 503.33 W,
    # peak 700 W; at the limit for 0.3 s; largest rise within 100 ms: 400 W.
    n = 201
    t = (np.arange(n) * 10 * MS).astype(np.int64)
    p = np.where(np.arange(n) >= 50, 700.0, 300.0)
    windows = {
        "window_id": np.arange(3, dtype=np.int64),
        "kind": ["step", "step", "microbatch"],
        "name": ["step", "step", "microbatch"],
        "step": np.array([0, 1, 1]),
        "microbatch": np.array([-1, -1, 0]),
        "t_begin_mono_ns": np.array([0, 200, 200]) * MS,
        "t_end_mono_ns": np.array([150, 900, 800]) * MS,
    }
    samples = {"t_mono_ns": t, "power_instant_w": p, "power_limit_w": np.full(n, 700.0)}
    write_rank(tmp_path / "run", 0, samples, windows, {"config": {"batch": {"micro_batch_size": 4}}})
    a = analyze(tmp_path / "run", tmp_path / "out" / "windows.parquet")
    x = _row(a.tables["excursions"], run="run")
    assert x["micro_batch_size"] == 4 and x["microbatches"] == 1
    assert x["peak_to_avg_max"] == pytest.approx(700 / (302 / 0.6))
    assert x["time_above_limit_max_s"] == pytest.approx(0.3)
    assert x["time_above_limit_share"] == pytest.approx(0.5)
    assert x["rise_100ms_max_w"] == pytest.approx(400.0)
    w = pq.read_table(tmp_path / "out" / "windows.parquet").to_pylist()
    mb = next(r for r in w if r["kind"] == "microbatch")
    assert mb["energy_method"] == "power_trapezoid" and mb["energy_j"] == pytest.approx(302.0)


def test_sweep_thermal_imbalance_platforms_and_gaps(tmp_path: Path) -> None:
    # Two configurations of one sweep; rank temperatures 50/53 on node a, 60/51 on node b:
    # imbalance 10 degC overall, 9 within node b. An out-of-memory configuration in sweep.json
    # without a run directory still appears, as a gap.
    sweep = tmp_path / "sweep=s"
    constant_run(sweep / "run=a" / "attempt=1", ranks=4, hosts=["a", "a", "b", "b"], temps=[50, 53, 60, 51])
    constant_run(sweep / "run=a" / "attempt=2", ranks=4, hosts=["a", "a", "b", "b"], temps=[50, 53, 60, 51])
    constant_run(sweep / "run=b", ranks=2, power_w=600.0)
    (sweep / "sweep.json").write_text(json.dumps({"runs": [
        {"key": "a", "state": "done", "overrides": []},
        {"key": "c", "state": "out_of_memory_predicted", "overrides": ["model=toy", "layout=big"]},
    ]}))  # fmt: skip
    a = analyze(tmp_path)
    runs = {r["run"]: r for r in a.tables["runs"].to_pylist()}
    assert set(runs) == {"sweep=s/run=a/attempt=2", "sweep=s/run=b", "sweep=s/run=c"}
    assert runs["sweep=s/run=c"]["status"] == "out_of_memory_predicted"
    assert runs["sweep=s/run=c"]["energy_j"] is None
    th = _row(a.tables["thermal"], run="sweep=s/run=a/attempt=2")
    assert th["imbalance_max_c"] == pytest.approx(10.0)
    assert th["node_imbalance_max_c"] == pytest.approx(9.0)
    assert th["corr_temp_clock"] == pytest.approx(-1.0)  # clock = 1800 - 10 x temp
    plat = {r["run"]: r for r in a.tables["platforms"].to_pylist()}
    # Same samples/s; 600 W on 2 GPUs (1200 W) against 400 W on 4 (1600 W): b is the more efficient.
    assert plat["sweep=s/run=b"]["efficiency_vs_best"] == pytest.approx(1.0)
    assert plat["sweep=s/run=a/attempt=2"]["efficiency_vs_best"] == pytest.approx(1200 / 1600)


def test_no_runs_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match="holds no charllm run"):
        analyze(tmp_path / "empty")
    assert main(["analyze", str(tmp_path / "empty")]) == 2
    assert "holds no charllm run" in capsys.readouterr().err


def test_bad_input_is_reported_and_the_rest_analysed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    constant_run(run, ranks=3, manifest={"world_size": 4})  # rank 3 missing
    # A truncated segment on rank 1: half of a second segment file.
    seg = run / "rank=1" / "samples-000000.parquet"
    (run / "rank=1" / "samples-000001.parquet").write_bytes(seg.read_bytes()[:300])
    # Mixed sampling rates: rank 2 says 10 Hz.
    m = json.loads((run / "rank=2" / "manifest.json").read_text())
    (run / "rank=2" / "manifest.json").write_text(json.dumps({**m, "sampling_hz": 10.0}))
    # A hostile file: a segment that is a link to something outside the run.
    os.symlink("/etc/hostname", run / "rank=0" / "samples-000001.parquet")
    a = analyze(run)
    text = "\n".join(a.problems)
    assert "rank folder(s) [3] are missing" in text
    assert "samples-000001.parquet: unreadable samples segment skipped" in text
    assert "different rates ([10.0, 100.0] Hz)" in text
    assert "symbolic link" in text
    r = _row(a.tables["runs"], run="run")
    assert r["devices_sampled"] == 3
    assert r["energy_j"] == pytest.approx(3 * 1160.0)


def test_tables_files_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    constant_run(tmp_path / "run")
    assert (
        main(
            [
                "analyze",
                str(tmp_path / "run"),
                "--no-figures",
                "--format",
                "json",
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["tables"]["runs"][0]["energy_j"] == pytest.approx(2320.0)
    assert {
        "runs",
        "ranks",
        "platforms",
        "excursions",
        "thermal",
        "throttle_slowdown",
        "phase_energy",
    } <= set(doc["tables"])
    for name in ("runs", "ranks", "windows", "phase_energy"):
        assert (tmp_path / "o" / f"{name}.parquet").is_file() and (tmp_path / "o" / f"{name}.csv").is_file()
    a = analyze(tmp_path / "run")
    assert len(write_tables(a, tmp_path / "o2")) >= 2 * 8


def test_this_process_and_its_workers_give_the_tables_of_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 5 ranks over 3 processes: this one reduces ranks 0 and 3 between taking the workers'
    # results (analysis/analyze.py, _reduced); every table, its rows in rank order, and the
    # window table equal those of one process; a rank without samples is reported either way.
    constant_run(tmp_path / "run", ranks=5, temps=[40.0, 41.0, 42.0, 43.0, 44.0])
    for f in (tmp_path / "run" / "rank=2").glob("samples*.parquet"):
        f.unlink()
    got = {}
    for workers in ("1", "3"):
        monkeypatch.setenv("CHARLLM_ANALYZE_WORKERS", workers)
        a = analyze(tmp_path / "run", tmp_path / f"windows-{workers}.parquet")
        got[workers] = (a, pq.read_table(tmp_path / f"windows-{workers}.parquet"))
    (one, w1), (three, w3) = got["1"], got["3"]
    assert one.tables.keys() == three.tables.keys()
    for name, table in [*one.tables.items(), ("windows", w1)]:
        other = w3 if name == "windows" else three.tables[name]
        assert other.schema == table.schema and other.num_rows == table.num_rows, name
        for c in table.column_names:  # NaN equal to NaN (Arrow's own equals says not)
            x, y = table.column(c).to_pylist(), other.column(c).to_pylist()
            assert [v if v == v else "NaN" for v in x] == [v if v == v else "NaN" for v in y], (name, c)
    assert w1.column("rank").to_pylist() == sorted(w1.column("rank").to_pylist())
    assert [r["rank"] for r in one.tables["ranks"].to_pylist()] == [0, 1, 3, 4]
    assert three.problems == one.problems and any("rank=2" in p for p in one.problems)
