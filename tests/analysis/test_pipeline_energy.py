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

from charllm_nemo.analysis.pipeline_energy import PP_BLOAT_COLUMNS, PP_PROFILE_COLUMNS, inside_sums
from charllm_nemo.devices.synthetic import SyntheticParams
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
           f"batch.global_batch_size={batch}", "logger=none"]  # fmt: skip
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
            assert r["power_w"] == pytest.approx(p.peak_w, rel=0.05)  # compute draws the peak
            assert r["p2p_power"] == pytest.approx(wait_level, rel=0.05)
    assert pq.read_table(out / "pp_profile.parquet").num_rows == len(profile)


def test_inside_sums_counts_the_samples_in_each_window_edges_included():
    t = np.array([0, 10, 20, 30, 40], np.int64)
    v = np.array([1.0, 2.0, np.nan, 4.0, 8.0])
    s, n = inside_sums(t, v, np.array([0, 15, 31, 10]), np.array([10, 30, 39, 40]))
    assert s.tolist() == [3.0, 4.0, 0.0, 14.0]  # NaN is no sample
    assert n.tolist() == [2, 1, 0, 3]
