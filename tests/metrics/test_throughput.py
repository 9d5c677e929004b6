"""Tokens/s, TFLOP/s per GPU, MFU and HFU from step times."""

from __future__ import annotations

import pytest

from charllm_nemo.errors import ConfigError
from charllm_nemo.metrics.throughput import step_throughput, window_throughput


def test_hand_computed_step() -> None:
    # 8 sequences of 1024 tokens in 2 s on 4 GPUs: 4096 tokens/s, 1024 per GPU.
    # 8e15 model FLOPs / (2 s x 4 GPUs) = 1e15 FLOP/s = 1000 TFLOP/s per GPU; 2000 peak -> 50 %.
    r = step_throughput(2.0, 8, 1024, 8e15, 1e16, 4, 2000.0)
    assert r.step_time_s == 2.0
    assert r.tokens_per_s == 4096.0
    assert r.samples_per_s == 4.0
    assert r.tokens_per_s_per_gpu == 1024.0
    assert r.model_tflops_per_gpu == pytest.approx(1000.0)
    assert r.hardware_tflops_per_gpu == pytest.approx(1250.0)
    assert r.peak_tflops_per_gpu == 2000.0
    assert r.mfu == pytest.approx(0.5)
    assert r.hfu == pytest.approx(0.625)


def test_unknown_peak_leaves_mfu_empty() -> None:
    r = step_throughput(1.0, 1, 16, 1e12, 1e12, 1, None)
    assert r.mfu is None and r.hfu is None and r.peak_tflops_per_gpu is None
    assert r.model_tflops_per_gpu == pytest.approx(1.0)


def test_no_hardware_flops_means_no_recompute() -> None:
    r = step_throughput(1.0, 1, 16, 3e12, None, 1, 10.0)
    assert r.hardware_tflops_per_gpu == r.model_tflops_per_gpu == pytest.approx(3.0)
    assert r.hfu == r.mfu


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((0.0, 8, 1024, 1e15, None, 4, None), "step_time_s"),
        ((-1.0, 8, 1024, 1e15, None, 4, None), "step_time_s"),
        ((float("nan"), 8, 1024, 1e15, None, 4, None), "step_time_s"),
        ((float("inf"), 8, 1024, 1e15, None, 4, None), "step_time_s"),
        ((1.0, 0, 1024, 1e15, None, 4, None), "global_batch_size"),
        ((1.0, 2.5, 1024, 1e15, None, 4, None), "global_batch_size"),
        ((1.0, 8, 0, 1e15, None, 4, None), "seq_length"),
        ((1.0, 8, 1024, -1.0, None, 4, None), "model_flops_per_step"),
        ((1.0, 8, 1024, float("nan"), None, 4, None), "model_flops_per_step"),
        ((1.0, 8, 1024, 1e15, -1.0, 4, None), "hardware_flops_per_step"),
        ((1.0, 8, 1024, 1e15, 1e14, 4, None), "hardware_flops_per_step"),  # below model
        ((1.0, 8, 1024, 1e15, None, 0, None), "world_size"),
        ((1.0, 8, 1024, 1e15, None, 4, 0.0), "peak_tflops_per_gpu"),
        ((1.0, 8, 1024, 1e15, None, 4, True), "peak_tflops_per_gpu"),
    ],
)
def test_invalid_arguments_are_named(args: tuple[object, ...], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        step_throughput(*args)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        step_throughput(*args)  # type: ignore[arg-type]


def test_window_rate_is_total_work_over_total_time() -> None:
    # Steps of 1 s and 3 s: 2 steps of work in 4 s is a 2 s mean step, not the mean of rates.
    r = window_throughput([1.0, 3.0], 8, 1024, 8e15, None, 4, 2000.0)
    assert r.step_time_s == 2.0
    assert r.mfu == pytest.approx(0.5)
    mean_of_rates = (
        step_throughput(1.0, 8, 1024, 8e15, None, 4, 2000.0).tokens_per_s
        + step_throughput(3.0, 8, 1024, 8e15, None, 4, 2000.0).tokens_per_s
    ) / 2
    assert r.tokens_per_s < mean_of_rates


def test_window_skips_warmup_steps() -> None:
    r = window_throughput([30.0, 2.0, 2.0], 8, 1024, 8e15, None, 4, None, skip_first=1)
    assert r.step_time_s == 2.0
    with pytest.raises(ConfigError, match="skip_first"):
        window_throughput([1.0], 8, 1024, 8e15, None, 4, None, skip_first=1)
    with pytest.raises(ConfigError, match="skip_first"):
        window_throughput([1.0], 8, 1024, 8e15, None, 4, None, skip_first=-1)
    with pytest.raises(ConfigError, match=r"step_times_s\[2\]"):
        window_throughput([1.0, 1.0, 0.0], 8, 1024, 8e15, None, 4, None)
