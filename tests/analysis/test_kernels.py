"""Profiler traces of chosen steps, and the kernel breakdown made from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from charllm_nemo.analysis.kernels import categorise, kernel_table, trace_breakdown
from charllm_nemo.train.profile import StepProfiler, trace_path


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)", "send/recv"),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "all-gather"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "reduce-scatter"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "all-reduce"),
        ("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "compute GEMM"),
        ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float>", "normalisation"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "memory / elementwise"),  # noqa: E501
        ("Memcpy DtoD (Device -> Device)", "memory / elementwise"),
        ("aten::mm", "compute GEMM"),
        ("some_custom_thing", "other"),
    ],
)  # fmt: skip
def test_categories(name: str, category: str) -> None:
    assert categorise(name) == category


def test_gpu_kernels_are_preferred_and_durations_in_us() -> None:
    events = [
        {"ph": "X", "cat": "kernel", "name": "ampere_sgemm_128x64_tn", "dur": 1500},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum", "dur": 500},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 9999},  # host side: not counted
    ]
    seconds, source = trace_breakdown(events)
    assert source == "kernel"
    assert seconds == {"compute GEMM": 0.0015, "all-reduce": 0.0005}


def test_profiled_steps_only_and_their_breakdown(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    prof = StepProfiler(tmp_path, rank=1, steps=[1])
    a = torch.randn(64, 64)
    for step in range(3):
        with prof.step(step):
            for _ in range(3):
                a = torch.nn.functional.layer_norm(a @ a, (64,))
    assert prof.written == [trace_path(tmp_path, 1, 1)]
    assert sorted(p.name for p in (tmp_path / "traces" / "rank=1").iterdir()) == ["step-000001.json"]
    (tmp_path / "traces" / "rank=1" / "step-000002.json").write_text("{not json")  # a damaged one
    problems: list[str] = []
    table = kernel_table([("run", tmp_path, {1: 0})], problems).to_pylist()
    cats = {r["category"]: r for r in table}
    assert {"compute GEMM", "normalisation"} <= set(cats)
    assert all(r["source"] == "cpu_op" and r["pp_stage"] == 0 for r in table)
    assert sum(r["share"] for r in table) == pytest.approx(1.0)
    assert any("step-000002.json: unreadable trace skipped" in p for p in problems)
    json.loads(trace_path(tmp_path, 1, 1).read_text())  # a whole file, not a temporary


def test_analyze_draws_the_kernel_breakdown_of_a_traced_run(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from charllm_nemo.analysis.analyze import analyze
    from charllm_nemo.analysis.figures import write_figures
    from tests.analysis.helpers import constant_run

    constant_run(tmp_path / "run")
    for rank in (0, 1):
        prof = StepProfiler(tmp_path / "run", rank, [2])
        with prof.step(2):
            torch.randn(32, 32) @ torch.randn(32, 32)
    a = analyze(tmp_path / "run")
    # Found from above too: the traces/rank=N folders inside the run are not taken for a run.
    assert [r.key for r in analyze(tmp_path).runs] == ["run"]
    files = write_figures(a, tmp_path / "fig")
    assert {p.name for p in files} >= {
        "kernels_run.png",
        "kernels_run.pdf",
        "configs.png",
        "timeline_run.png",
    }
    assert sorted(set(a.tables["kernels"].column("rank").to_pylist())) == [0, 1]


def test_charllm_train_records_the_chosen_steps(tmp_path: Path) -> None:
    # The real path: telemetry.profile_steps=[1] makes charllm train write rank 0's trace of
    # step 1 (and no other), which charllm analyze turns into the kernel table.
    pytest.importorskip("megatron.core")
    from charllm_nemo.analysis.analyze import analyze

    run = tmp_path / "run"
    argv = [
        "train", "model=tiny_gpt", "telemetry.backend=synthetic", "launch.nproc=1", "batch.train_steps=2",
        "batch.global_batch_size=2", "telemetry.profile_steps=[1]", f"telemetry.out_dir={run}",
    ]  # fmt: skip
    from charllm_nemo.cli import main

    assert main(argv) == 0
    assert [p.name for p in (run / "traces" / "rank=0").iterdir()] == ["step-000001.json"]
    kernels = analyze(run).tables["kernels"].to_pylist()
    assert {r["category"] for r in kernels} >= {"compute GEMM"} and {r["rank"] for r in kernels} == {0}


def test_profile_steps_are_validated() -> None:
    from charllm_nemo.telemetry.config import TelemetryConfig, telemetry_problems

    problems = telemetry_problems(TelemetryConfig(profile_steps=[2, -1]), check_out_dir=False)
    assert any("telemetry.profile_steps=[2, -1]" in p and ">= 0" in p for p in problems)
    assert telemetry_problems(TelemetryConfig(profile_steps=[0, 5]), check_out_dir=False) == []
