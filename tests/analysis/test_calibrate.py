"""charllm calibrate-energy: points from measured runs, the fit written, the dry run reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from charllm_nemo.analysis.analyze import analyze
from charllm_nemo.analysis.calibrate import points
from charllm_nemo.analysis.store_writer import write_summary
from charllm_nemo.cli import main
from charllm_nemo.metrics import energy_model
from charllm_nemo.train.config import TrainConfig
from charllm_nemo.train.plan_energy import energy_lines
from charllm_nemo.train.validate import validate

from .helpers import constant_run

SYNTH = "Synthetic accelerator (model, not hardware)"


def sweep(root: Path) -> Path:
    # Three runs at 200, 300, 400 W with 1, 2, 3 TFLOP per rank a step (steps of 0.9 s + 0.1 s gap).
    for i, watts in enumerate((200.0, 300.0, 400.0)):
        run = root / f"run={i}"
        constant_run(run, ranks=2, power_w=watts)
        write_summary(
            run,
            {
                "status": "complete",
                "model": "toy",
                "world_size": 2,
                "layout": {"pp": 1, "num_microbatches": 2},
                "num_microbatches": 2,
                "hardware_tflops_per_gpu_median": (i + 1) / 0.9,
                "step_time_s_median": 0.9,
            },
        )
    return root


def test_points_from_measured_runs(tmp_path: Path) -> None:
    per, _, skipped = points(analyze(sweep(tmp_path)))
    assert not skipped
    pts = sorted(per[SYNTH], key=lambda p: p.flops_per_rank)
    assert [round(p.flops_per_rank / 1e12, 6) for p in pts] == [1.0, 2.0, 3.0]
    p = pts[2]
    # Steps 1-3 span 2.9 s: a period of 2.9/3 s; 2 ranks at 400 W -> 400 W per device.
    assert p.step_s == pytest.approx(2.9 / 3)
    assert p.power_avg_w == pytest.approx(400.0, rel=1e-6)
    assert p.energy_step_j == pytest.approx(800.0 * 2.9 / 3, rel=1e-6)


def test_calibrate_writes_a_table_the_dry_run_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    table_file = tmp_path / "table.json"
    assert main(["calibrate-energy", str(sweep(tmp_path / "sweep")), "--write", str(table_file)]) == 0
    out = capsys.readouterr().out
    assert "3 runs" in out and "held-out error" in out
    table = energy_model.load_table(table_file.read_text())
    cal = table[SYNTH]
    assert cal.runs == 3 and cal.held_out_error_median is not None
    monkeypatch.setattr(energy_model, "load_table", lambda text=None: table)
    cfg = TrainConfig()
    cfg.launch.device = "cpu"
    layout = validate(cfg, world_size=1, device="cpu")
    (line,) = energy_lines(cfg, layout)
    assert line.startswith(
        f"energy (estimate, {SYNTH} model fitted on 3 runs; error on held-out runs: median"
    )
    assert "J per step" in line and "kWh for" in line
    cfg.launch.device, cfg.launch.platform = "cuda", "TPU v5p"
    (line,) = energy_lines(cfg, layout)
    assert "no estimate for launch.platform=TPU v5p" in line and SYNTH in line and "MI300X" in line


def test_calibrate_refuses_a_linked_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "mine.json"
    target.write_text(json.dumps({"keep": True}))
    link = tmp_path / "table.json"
    link.symlink_to(target)
    assert main(["calibrate-energy", str(sweep(tmp_path / "sweep")), "--write", str(link)]) == 2
    assert json.loads(target.read_text()) == {"keep": True}


def test_calibrate_changes_the_package_table_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from charllm_nemo.analysis import calibrate

    # The real path is recognised (a source checkout's tracked file) ...
    real = calibrate.package_table_path()
    assert real.name == "energy_calibration.json" and calibrate._is_package_table(real)
    # ... and a stand-in for it is left alone without --update-package-table.
    own = tmp_path / "pkg" / "energy_calibration.json"
    own.parent.mkdir()
    own.write_text(json.dumps({"platforms": {}}))
    monkeypatch.setattr(calibrate, "package_table_path", lambda: own)
    runs = str(sweep(tmp_path / "sweep"))
    assert main(["calibrate-energy", runs, "--write", str(own)]) == 2
    assert "--update-package-table" in capsys.readouterr().err
    assert json.loads(own.read_text()) == {"platforms": {}}
    assert main(["calibrate-energy", runs, "--write", str(own), "--update-package-table"]) == 0
    assert SYNTH in energy_model.load_table(own.read_text())
