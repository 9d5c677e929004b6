"""The dry run against a named device: does each plan fit its memory, and the energy estimate
(fitted, else a prior from published figures) that depends on the layout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from charllm_nemo.metrics.energy_model import Calibration, estimate_stages
from charllm_nemo.metrics.energy_prior import PRIORS, prior_estimate, prior_for
from charllm_nemo.metrics.flops import ModelShape, hardware_flops_per_step
from charllm_nemo.metrics.stage_flops import stage_hardware_flops
from charllm_nemo.train import app
from charllm_nemo.train.plan_energy import energy_lines
from charllm_nemo.train.validate import validate

# The README's command, with the device named (docs/config.md, Dry run).
README_70B = [
    "model=llama3_70b",
    "parallel=llama3_70b_tp4pp4",
    "nproc=512",
    "launch.device=cuda",
    "batch.global_batch_size=512",
    "dry_run=true",
]


@pytest.fixture
def login_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(k)
    return tmp_path


def test_each_plan_says_whether_it_fits_and_a_loud_warning_when_the_config_does_not(
    login_node: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # llama3_70b tp4pp4 on 512 H100s: without recomputation no plan fits 80 GB (before: "valid");
    # full recomputation does, so the dry run warns and exits 0 (one setting away).
    assert app.main([*README_70B, "launch.platform=NVIDIA H100"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert "as configured it does NOT fit NVIDIA H100 SXM (80 GB)'s memory (other plans do)" in first
    assert "as configured, local layers: peak 660.7 GiB (stage 0): DOES NOT FIT" in out
    assert "optim=recompute, local layers: peak 37.0 GiB (stage 0): fits" in out
    assert "WARNING: the configuration as given does not fit NVIDIA H100 SXM (80 GB)" in out
    # The same on an H200 (141 GB): set from the command line (before: not in struct).
    assert app.main([*README_70B, "launch.platform=NVIDIA H200", "optim=recompute"]) == 0
    out = capsys.readouterr().out
    assert "fits NVIDIA H200 SXM (141 GB)'s memory" in out.splitlines()[0]
    assert "UNCALIBRATED PRIOR for NVIDIA H200 SXM (141 GB)" in out and "WARNING" not in out
    assert list(login_node.iterdir()) == []  # nothing written


def test_no_plan_fits_exits_1(login_node: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 70 B parameters with only data parallelism over 8 ranks: the weights, gradients and
    # optimizer state alone exceed 80 GB whatever is recomputed.
    argv = ["model=llama3_70b", "nproc=8", "launch.device=cuda", "batch.global_batch_size=8", "dry_run=true"]
    assert app.main([*argv, "launch.platform=H100"]) == 1
    out = capsys.readouterr().out
    assert "NO PLAN FITS NVIDIA H100 SXM (80 GB)" in out
    # A device whose memory is not known: said, not guessed, and not an error.
    assert app.main([*argv, "launch.platform=TPU v5p"]) == 0
    assert "memory fit: not checked: launch.platform=TPU v5p" in capsys.readouterr().out


def test_stage_flops_add_up_to_the_step_and_put_the_output_layer_last() -> None:
    cfg = app.load(
        [
            "model=gpt3_175b",
            "parallel=gpt3_175b_tp4pp8_vpp6",
            "optim=recompute",
            "batch.global_batch_size=1536",
        ]
    )
    cfg.launch.device = "cuda"
    layout = validate(cfg, world_size=1024, device="cuda")
    shape = ModelShape.from_model_config(cfg.model)
    o = cfg.optim
    stages = stage_hardware_flops(
        shape, 1536, layout.layers_per_virtual_stage, layout.pp,
        o.recompute_granularity, o.recompute_method, o.recompute_num_layers,
    )  # fmt: skip
    total = hardware_flops_per_step(
        shape, 1536, o.recompute_granularity, o.recompute_method, o.recompute_num_layers,
        pipeline_parallel=layout.pp, virtual_pipeline=layout.vpp,
    ).total  # fmt: skip
    assert sum(stages) == pytest.approx(total, rel=1e-12)
    assert stages[-1] > stages[0] == pytest.approx(stages[1], rel=1e-12)  # the logits GEMM


def test_an_uneven_pipeline_costs_what_its_slowest_stage_makes_it() -> None:
    # The same work split [3, 1] instead of [2, 2]: the heavy stage sets the step, the light one
    # idles at idle power, so the step is longer and the energy higher (before: the same figure,
    # the layout was averaged away).
    cal = Calibration("x", 1e-12, 0.0, 100.0, 500.0, 1.2, 700.0, 3, None, None)
    even = estimate_stages(cal, [2e12, 2e12], 1, microbatches=4)
    uneven = estimate_stages(cal, [3e12, 1e12], 1, microbatches=4)
    assert even.step_s == pytest.approx(2.0 * (4 + 1) / 4)  # the bubble factor
    assert uneven.step_s == pytest.approx(3.0 + 1.0 / 4)
    assert uneven.energy_step_j > even.energy_step_j


def test_the_dry_run_energy_depends_on_the_layout_fitted_or_prior() -> None:
    def line(parallel: str, platform: str | None) -> str:
        cfg = app.load(["model=tiny_gpt", f"parallel={parallel}"])
        cfg.launch.device, cfg.launch.platform = ("cpu", None) if platform is None else ("cuda", platform)
        layout = validate(cfg, world_size=2, device=cfg.launch.device)
        return energy_lines(cfg, layout)[0].split("):", 1)[1]

    for platform in (None, "NVIDIA B200", "AMD Instinct MI300X"):
        figures = {line(p, platform) for p in ("pp2", "pp2_uneven", "dp2")}
        assert len(figures) == 3, (platform, figures)


def test_every_prior_has_a_source_a_range_and_the_published_board_limit() -> None:
    limits = {"h100_sxm": 700.0, "h200_sxm": 700.0, "b200": 1000.0, "mi300x": 750.0}
    for key, prior in PRIORS.items():
        assert prior.power_limit_w == limits[key]
        for f in (prior.idle_w, prior.busy_w, prior.mfu):
            assert f.low <= f.value <= f.high and f.source
        assert prior.busy_w.high <= prior.power_limit_w
    for name, key in (("NVIDIA H100 80GB HBM3", "h100_sxm"), ("NVIDIA H200", "h200_sxm"),
                      ("NVIDIA B200", "b200"), ("AMD Instinct MI300X", "mi300x")):  # fmt: skip
        assert prior_for(name) is PRIORS[key]
    assert prior_for("NVIDIA H100 PCIe") is None and prior_for("NVIDIA GB200") is None
    p = prior_estimate(PRIORS["h100_sxm"], "bf16", [1e15, 1e15], 8, 16)
    assert p.energy_low_j < p.central.energy_step_j < p.energy_high_j
