"""The job power in ``charllm analyze`` and ``charllm report``: the tables and their documented
columns, the figures, the report's comparison of a microbatch sweep (stand-in runs whose swing
and period differ by micro batch size, as bursty larger microbatches would), and a real CPU
microbatch sweep (slow)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from charllm_nemo.analysis.grid_power import GRID_POWER_COLUMNS, WHATIF_COLUMNS
from charllm_nemo.cli import main
from tests.deadline import deadline

from .test_grid_power import HIGH, LOW, RANKS, stand_in

ROOT = Path(__file__).resolve().parents[2]
SWEEP = {1: (400.0, 0.5), 2: (500.0, 0.8), 4: (HIGH, 1.25)}
"""Micro batch size -> (per-GPU peak W, iteration period s) of each stand-in run."""


def _sweep(root: Path) -> Path:
    sweep = root / "sweep=mb"
    for micro, (high, period) in SWEEP.items():
        stand_in(sweep / f"run=micro_batch_size-{micro}", high=high, period=period, micro=micro)
    return sweep


def test_report_compares_the_sweeps_swing_and_frequency(tmp_path: Path) -> None:
    _sweep(tmp_path)
    racks = tmp_path / "racks.txt"
    racks.write_text("node0 r1\nnode1 r1\nnode2 r2\nnode3 r2\n")
    out, page = tmp_path / "out", tmp_path / "report.html"
    args = ["report", str(tmp_path), "--out", str(out), "--html", str(page), "--fleet-gpus", "100000",
            "--rack-map", str(racks), "--power-floor", "300", "450"]  # fmt: skip
    assert main(args) == 0
    rows = pq.read_table(out / "grid_power.parquet").to_pylist()
    assert (out / "grid_power.csv").is_file() and (out / "grid_whatif.csv").is_file()
    jobs = {r["run"].split("-")[-1]: r for r in rows if r["scope"] == "job"}
    assert sorted(jobs) == ["1", "2", "4"]
    for micro, (high, period) in SWEEP.items():
        job = jobs[str(micro)]
        assert job["swing_p50_w"] == pytest.approx(RANKS * (high - LOW), rel=0.02)
        assert abs(job["dominant_hz"] - 1 / period) <= 0.05
        assert job["fleet_gpus"] == 100_000
    assert sorted(r["name"] for r in rows if r["scope"] == "group") == ["r1", "r1", "r1", "r2", "r2", "r2"]
    whatif = pq.read_table(out / "grid_whatif.parquet").to_pylist()
    assert sorted({r["floor_w"] for r in whatif}) == [300.0, 450.0] and len(whatif) == 6
    text = page.read_text()
    section = text[text.index("Job power as the grid sees it") :]
    order = [m for m in re.findall(r"micro_batch_size-(\d)", section[: section.index("</table>")])]
    assert order == ["1", "2", "4"]  # the least swing first
    figures = {p.name for p in (out / "figures").glob("*.png")}
    assert "gridsweep.png" in figures
    assert {f"powerwave_sweep_mb_run_micro_batch_size-{m}.png" for m in SWEEP} <= figures
    assert "GPU-visible power" in text


def test_every_table_column_is_documented() -> None:
    doc = (ROOT / "docs" / "analysis.md").read_text()
    for table, columns in (("grid_power", GRID_POWER_COLUMNS), ("grid_whatif", WHATIF_COLUMNS)):
        part = doc[doc.index(f"### `{table}`") :]
        part = part[: part.index("\n### ", 5)]
        documented = set(re.findall(r"`(\w+)`", part))
        assert set(columns) - {"run"} <= documented, set(columns) - documented


def test_analyze_prints_the_job_power_and_refuses_a_bad_band(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stand_in(tmp_path / "run=a")
    assert main(["analyze", str(tmp_path), "--no-figures", "--critical-band", "5", "1"]) == 2
    assert "critical band" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path), "--no-figures"]) == 0
    out = capsys.readouterr().out
    assert "run=a: job power (GPU-visible): swing 1800 W (75 % of peak) per iteration" in out
    assert "dominant 1.7 Hz (iterations 1.7 Hz)" in out


@pytest.mark.slow
def test_a_cpu_microbatch_sweep_reports_swing_and_frequency_per_configuration(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    cmd = [sys.executable, "-m", "charllm_nemo.cli", "train", "-m", "+sweep=cpu_microbatch",
           f"sweep.dir={tmp_path}", "batch.micro_batch_size=1,4", "batch.train_steps=4"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=deadline(600), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    out = tmp_path / "out"
    assert main(["report", str(tmp_path), "--out", str(out), "--html", str(tmp_path / "r.html")]) == 0
    jobs = [r for r in pq.read_table(out / "grid_power.parquet").to_pylist() if r["scope"] == "job"]
    assert len(jobs) == 2
    for job in jobs:  # which configuration wins awaits the synthetic device's per-phase waveform
        for col in ("swing_p50_w", "swing_pct_of_peak", "dominant_hz", "iteration_hz", "ramp_up_max_w_per_s"):
            assert job[col] is not None and math.isfinite(job[col]), (job["run"], col)
    assert "Job power as the grid sees it" in (tmp_path / "r.html").read_text()


def test_the_wave_figure_draws_its_four_panels_with_plain_labels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib

    from charllm_nemo.analysis import grid_figures
    from charllm_nemo.analysis.analyze import analyze

    stand_in(tmp_path / "run=a")
    a = analyze(tmp_path)
    kept: list[Any] = []
    monkeypatch.setattr(grid_figures, "save", lambda fig, stem: kept.append(fig) or [stem])
    with matplotlib.rc_context({"text.parse_math": False}):  # as write_figures draws
        grid_figures.wave_figure(a.runs[0], a.tables["grid_power"], a.tables["grid_whatif"], tmp_path / "w")
        (fig,) = kept
        fig.canvas.draw()
    wave, zoom, spectrum, whatif = fig.axes[:4]
    assert [line.get_label() for line in wave.lines] == ["job, 10 ms grid", "1 s average"]
    assert len(zoom.patches) == 4  # the zoomed iterations, shaded
    assert (
        "GPU-visible power" in fig._suptitle.get_text()
        and "alignment error 0.0022 ms" in fig._suptitle.get_text()
    )
    labels = [t.get_text() for ax in fig.axes for t in ax.get_xticklabels() + ax.get_yticklabels()]
    assert labels and not [t for t in labels if "$" in t or "mathdefault" in t]
    band = [p for p in spectrum.patches if p.get_label() == "critical band"]
    assert len(band) == 1 and band[0].get_x() == pytest.approx(0.1)
    assert any("dominant 1.7" in t.get_text() for t in spectrum.get_legend().get_texts())
    assert len(whatif.lines[0].get_xdata()) == 6  # the auto floors
