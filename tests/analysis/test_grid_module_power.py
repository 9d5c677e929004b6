"""The job power waveform on Grace modules (issue #46): where every sampled GPU reports its
module's power (``power_module_w``, NVML power scope MODULE), that is summed and labelled as
module power; a run where only some do sums the GPUs' own power, with a problem line; and the
whole path from the stand-in NVML (module scope served, or NOT_SUPPORTED as on an H100) through
the sampler's samples and manifest to the table's label and the GPU check's line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from charllm_nemo.analysis.grid_power import MODULE_POWER_SCOPE, POWER_SCOPE, GridOptions, grid_tables
from charllm_nemo.analysis.load import open_run
from charllm_nemo.analysis.run_info import run_info
from charllm_nemo.cli import main
from charllm_nemo.telemetry.reader import load_run
from tests.deadline import deadline
from tests.fakes import nvml_stub

from .test_grid_power import HIGH, LOW, RANKS, _tables, stand_in

EXTRA_W = 95.0  # a Grace CPU and its memory beside each GPU


def test_module_power_is_summed_and_labelled_where_every_gpu_has_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stand_in(tmp_path / "run=a", module_extra_w=[EXTRA_W] * RANKS)
    job, whatif, problems = _tables(tmp_path / "run=a")
    assert problems == []
    assert job["power_scope"] == MODULE_POWER_SCOPE and job["power_column"] == "power_module_w"
    assert job["power_scope"].startswith("module power (GPU+CPU+memory of the Grace module")
    assert job["peak_w"] == pytest.approx(RANKS * (HIGH + EXTRA_W), rel=1e-3)  # not the GPUs' 2400 W
    assert job["trough_w"] == pytest.approx(RANKS * (LOW + EXTRA_W), rel=1e-3)
    assert job["swing_p50_w"] == pytest.approx(RANKS * (HIGH - LOW), rel=0.02)  # a constant adds none
    assert {r["floor_w"] for r in whatif} and all(r["gpus"] == RANKS for r in whatif)
    assert main(["analyze", str(tmp_path), "--no-figures"]) == 0
    assert "run=a: job power (module): swing 1800 W" in capsys.readouterr().out


def test_a_mixed_run_sums_the_gpus_own_power_and_says_which_lack_module_power(tmp_path: Path) -> None:
    stand_in(tmp_path, module_extra_w=[EXTRA_W, EXTRA_W, None, EXTRA_W])
    job, _, problems = _tables(tmp_path)
    assert job["power_scope"] == POWER_SCOPE and job["power_column"] == "power_instant_w"
    assert job["peak_w"] == pytest.approx(RANKS * HIGH, rel=1e-3)
    (line,) = problems
    assert "3 GPU(s) report module power" in line and "rank 2 device 0 do(es) not" in line


@pytest.mark.parametrize("served", [True, False], ids=["grace_module", "not_supported"])
def test_module_scope_from_the_stand_in_nvml_to_the_table(tmp_path: Path, served: bool) -> None:
    script = ["0 power_instant_mw 300000"]
    if served:
        script.append(f"0 power_module_extra_mw {round(EXTRA_W * 1000)}")
    try:
        env = nvml_stub.subprocess_env(script, tmp_dir=tmp_path)
    except nvml_stub.StubUnavailable as exc:
        pytest.skip(str(exc))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "charllm_nemo.cli", "telemetry", "--backend", "nvml", "--hz", "100",
           "--seconds", "2", "--step-s", "0.1", "--out", str(out), "--sampler", "thread"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=deadline(120))
    assert done.returncode == 0, done.stderr
    assert "while sampling" not in done.stderr  # NOT_SUPPORTED is settled at open: no per-sample error
    run = load_run(out)
    scopes = run.manifests[0]["devices"][0]["extra"]["power_scopes"]
    assert scopes["power_instant_w"] == "gpu"
    assert scopes["power_module_w"] == ("module" if served else None)
    assert "power_module_w" not in run.manifests[0]["sampler"].get("nulls", {})
    gpu = np.asarray(run.samples.column("power_instant_w").to_pylist(), dtype=float)
    module = run.samples.column("power_module_w")
    assert len(gpu) > 50 and np.all(gpu == 300.0)
    if served:
        assert module.null_count == 0
        assert np.all(np.asarray(module.to_pylist()) == 300.0 + EXTRA_W)
    else:
        assert module.null_count == len(module)
    r = open_run(out, out)
    problems: list[str] = []
    table = grid_tables([r], pa.Table.from_pylist([run_info(r)]), GridOptions(), problems)["grid_power"]
    job: dict[str, Any] = next(row for row in table.to_pylist() if row["scope"] == "job")
    assert job["power_scope"] == (MODULE_POWER_SCOPE if served else POWER_SCOPE)
    assert job["power_column"] == ("power_module_w" if served else "power_instant_w")
    assert job["mean_w"] == pytest.approx(300.0 + (EXTRA_W if served else 0.0))
    assert not [p for p in problems if "module" in p]
    # what the GPU check (bench/gpu_run.sh -> bench/gpu_counters.py) reports of the same run
    from bench.gpu_counters import counter_check, summary_lines

    result = counter_check(out)
    assert result["module_power"]["supported"] is served
    (line,) = [x for x in summary_lines(result) if "module power scope" in x]
    if served:
        assert "supported, median 395.0000 W beside the GPU's 300.0000 W" in line
        assert "NVML_FI_DEV_POWER_INSTANT[scope=0x1]" in line
    else:
        assert line.endswith("not supported on this device")
