"""Issue #46's per-stage energy bloat on CPU: a real `charllm train` with 2 and 4 pipeline stages
on the synthetic device, then `charllm analyze`.

The reference is computed here from the raw files alone (each rank's ``samples-*.parquet`` and
``windows-*.parquet``, read with pyarrow, no code of the analysis): per rank, the waiting time
``T`` is the summed length of its ``pp-*`` phase windows in the measured steps (every step but
the first), and the power ``P`` is the mean ``power_instant_w`` of the samples that lie inside
one of those windows (a per-sample mask, window by window); the reference is the sum over ranks
of ``T x P``. The analysis's bloat (the sum of ``pp_bloat.wait_energy_j``) must lie within 5 % of
it. The same raw files show the waveform the synthetic device now draws: compute high, waits low.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from charllm_nemo.analysis.analyze import analyze
from charllm_nemo.analysis.pipeline_energy import PP_BLOAT_COLUMNS, PP_PROFILE_COLUMNS, inside_sums
from charllm_nemo.analysis.store_writer import write_rank, write_summary
from charllm_nemo.devices.synthetic import SyntheticParams
from tests.analysis.helpers import HZ, MS
from tests.deadline import deadline

STEPS = 4


def _raw(run: Path, rank: int) -> tuple[pa.Table, pa.Table]:
    folder = run / f"rank={rank}"
    samples = pa.concat_tables([pq.read_table(p) for p in sorted(folder.glob("samples-*.parquet"))])
    windows = pa.concat_tables([pq.read_table(p) for p in sorted(folder.glob("windows-*.parquet"))])
    return samples.to_pandas(), windows.to_pandas()


def _inside(t: np.ndarray, windows: pd.DataFrame) -> np.ndarray:
    mask = np.zeros(t.size, bool)
    for b, e in zip(windows["t_begin_mono_ns"], windows["t_end_mono_ns"], strict=True):
        mask |= (t >= b) & (t <= e)
    return mask


@pytest.mark.parametrize(("pp", "batch"), [(2, 8), (4, 8)])
def test_pipeline_bloat_matches_wait_time_x_sampled_power_and_the_profile_loads(tmp_path, pp, batch):
    pytest.importorskip("megatron.core")
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "charllm_nemo.cli", "train", "model=tiny_gpt", f"parallel.pp={pp}",
           f"nproc={pp}", "telemetry=synthetic", f"telemetry.out_dir={run}", f"batch.train_steps={STEPS}",
           f"batch.global_batch_size={batch}", "logger=none",
           # 500 Hz: a stage's waits in three CPU steps can total ~30 ms, three samples at 100 Hz
           # (one on a loaded machine); at 500 Hz ~15
           "telemetry.hz=500"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=deadline(400))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    out = tmp_path / "analysis"
    cmd = [sys.executable, "-m", "charllm_nemo.cli", "analyze", str(run), "--out", str(out), "--no-figures"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=deadline(300))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]

    p = SyntheticParams()
    wait_level = p.idle_w + 0.15 * (p.peak_w - p.idle_w)  # docs/devices.md: communication
    reference = 0.0
    for rank in range(pp):
        samples, windows = _raw(run, rank)
        first = windows.loc[windows["kind"] == "step", "step"].min()
        measured = windows[(windows["kind"] == "phase") & (windows["step"] > first)]
        waits = measured[measured["name"].str.startswith("pp-")]
        assert len(waits) > 0, f"rank {rank} has no pipeline wait windows"
        t = samples["t_mono_ns"].to_numpy()
        power = samples["power_instant_w"].to_numpy()
        in_wait = _inside(t, waits)
        in_compute = _inside(t, measured[measured["name"].isin(["forward", "backward"])])
        assert in_wait.sum() >= 3, f"rank {rank}: too few samples inside its waits to measure them"
        wait_s = float((waits["t_end_mono_ns"] - waits["t_begin_mono_ns"]).sum()) / 1e9
        reference += wait_s * float(power[in_wait].mean())
        # The per-phase waveform (#46): waits draw the communication level, compute the peak.
        assert np.median(power[in_wait]) == pytest.approx(wait_level)
        if in_compute.any():
            assert np.median(power[in_compute]) == pytest.approx(p.peak_w)

    bloat = pq.read_table(out / "pp_bloat.parquet").to_pandas()
    assert tuple(bloat.columns) == PP_BLOAT_COLUMNS
    assert sorted(bloat["pp_stage"].unique()) == list(range(pp))
    assert len(bloat) == pp * (STEPS - 1)  # one row per rank and measured step
    total = float(bloat["wait_energy_j"].sum())
    assert total == pytest.approx(reference, rel=0.05), (total, reference)
    assert (bloat["wait_energy_j"] >= 0).all() and (bloat["bloat_share"].dropna() <= 1.0).all()

    # The profile in the documented form: lowtime's columns, read as its examples/perseus.py does.
    profile = pd.read_csv(out / "pp_profile.csv")
    assert tuple(profile.columns) == PP_PROFILE_COLUMNS
    for stage in range(pp):
        for instruction in ("forward", "backward"):
            row = profile.query(f"stage == {stage} and instruction == '{instruction}'")
            assert len(row) == 1, (stage, instruction)
            r = row.iloc[0]
            assert r["frequency"] == int(p.clock_max_mhz) and r["time"] > 0
            assert r["energy"] == pytest.approx(r["time"] * r["power_w"])
            # compute draws more than a wait (the peak while the device is cool; a run stretched by
            # a loaded host heats it, and the synthetic thermal model then holds 90 C below the peak)
            assert r["p2p_power"] < r["power_w"] <= p.peak_w * 1.05
            assert r["p2p_power"] == pytest.approx(wait_level, rel=0.05)
    assert pq.read_table(out / "pp_profile.parquet").num_rows == len(profile)


def test_inside_sums_counts_the_samples_in_each_window_edges_included():
    t = np.array([0, 10, 20, 30, 40], np.int64)
    v = np.array([1.0, 2.0, np.nan, 4.0, 8.0])
    s, n = inside_sums(t, v, np.array([0, 15, 31, 10]), np.array([10, 30, 39, 40]))
    assert s.tolist() == [3.0, 4.0, 0.0, 14.0]  # NaN is no sample
    assert n.tolist() == [2, 1, 0, 3]


def _square_wave_run(run: Path, steps: int = 4, hole_step: int | None = None) -> None:
    """2 stages; step k spans [b, b + 0.9 s], b = 0.5 + k s: forward [b + 5 ms, b + 0.205 s],
    a pipeline wait [b + 0.205, b + 0.505 s], backward [b + 0.505, b + 0.805 s]; sampled every 10 ms
    at 500 W inside compute, 150 W inside the wait, 100 W elsewhere, clock 1500 MHz. Rank 1 has
    no sample inside the wait of ``hole_step``."""
    t_all = (np.arange(int((steps + 1) * HZ) + 1) * 10 * MS).astype(np.int64)
    for r in range(2):
        rows = []
        for s in range(steps):
            b = (500 + 1000 * s) * MS
            rows += [("step", "step", s, b, b + 900 * MS), ("phase", "forward", s, b + 5 * MS, b + 205 * MS),
                     ("phase", "pp-forward-send-backward-recv", s, b + 205 * MS, b + 505 * MS),
                     ("phase", "backward", s, b + 505 * MS, b + 805 * MS)]  # fmt: skip
        power = np.full(t_all.size, 100.0)
        keep = np.ones(t_all.size, bool)
        for kind, name, s, t0, t1 in rows:
            inside = (t_all > t0) & (t_all < t1)
            if kind == "phase":
                power[inside] = 150.0 if name.startswith("pp-") else 500.0
                if r == 1 and s == hole_step and name.startswith("pp-"):
                    keep &= ~inside
        t = t_all[keep]
        samples = {"t_mono_ns": t, "power_instant_w": power[keep], "clock_sm_mhz": np.full(t.size, 1500.0),
                   "temp_gpu_c": np.full(t.size, 50.0), "power_limit_w": np.full(t.size, 700.0),
                   "throttle_reasons": np.zeros(t.size, np.int64)}  # fmt: skip
        windows = {
            "window_id": np.arange(len(rows), dtype=np.int64),
            "kind": [x[0] for x in rows],
            "name": [x[1] for x in rows],
            "step": np.array([x[2] for x in rows], np.int64),
            "microbatch": np.full(len(rows), -1, np.int64),
            "t_begin_mono_ns": np.array([x[3] for x in rows], np.int64),
            "t_end_mono_ns": np.array([x[4] for x in rows], np.int64),
            "pp_stage": np.full(len(rows), r, np.int64),
        }
        man = {"world_size": 2, "host": "node0",
               "config": {"model": {"name": "toy", "seq_length": 16},
                          "batch": {"global_batch_size": 8, "micro_batch_size": 1},
                          "parallel": {"tp": 1, "pp": 2, "cp": 1, "ep": 1}}}  # fmt: skip
        write_rank(run, r, samples, windows, man)
    write_summary(run, {"status": "complete", "model": "toy", "world_size": 2})


def test_a_square_wave_gives_the_exact_wait_energy_and_profile(tmp_path):
    _square_wave_run(tmp_path / "run", hole_step=2)
    a = analyze(tmp_path / "run")
    bloat = a.tables["pp_bloat"].to_pandas().sort_values(["rank", "step"])
    assert len(bloat) == 2 * 3  # steps 1..3 are measured (the first is the warm-up)
    assert bloat["wait_s"].tolist() == pytest.approx([0.3] * 6)
    # 0.3 s x 150 W, the level sampled inside the waits, even where the attribution's straight
    # lines from the compute samples on either side read more
    assert bloat["wait_energy_j"].tolist() == pytest.approx([45.0] * 6)
    assert (bloat["wait_energy_attributed_j"] > 45.0 + 1e-6).all()
    src = dict(zip(zip(bloat["rank"], bloat["step"], strict=True), bloat["wait_power_from"], strict=True))
    assert src[(1, 2)] == "rank_samples" and src[(0, 2)] == "step_samples"  # no sample in its wait
    assert bloat["wait_share"].tolist() == pytest.approx([0.3 / 0.9] * 6)
    profile = a.tables["pp_profile"].to_pandas()
    assert tuple(profile.columns) == PP_PROFILE_COLUMNS
    assert sorted(zip(profile["stage"], profile["instruction"], strict=True)) == [
        (0, "backward"), (0, "forward"), (1, "backward"), (1, "forward")]  # fmt: skip
    for _, r in profile.iterrows():
        want_s = 0.2 if r["instruction"] == "forward" else 0.3
        assert r["time"] == pytest.approx(want_s) and r["power_w"] == pytest.approx(500.0)
        assert r["energy"] == pytest.approx(500.0 * want_s) and r["frequency"] == 1500
        assert r["p2p_power"] == pytest.approx(150.0) and r["windows"] == 3


def test_a_run_without_a_pipeline_has_no_bloat_tables(tmp_path):
    from tests.analysis.helpers import constant_run

    constant_run(tmp_path / "run")
    tables = analyze(tmp_path / "run").tables
    assert "pp_bloat" not in tables and "pp_profile" not in tables and "runs" in tables
