"""The one per-rank vector and what rank 0 makes of it (plain numbers, no torch)."""

from __future__ import annotations

import math

import pytest

from charllm_nemo.steps.observers import format_report
from charllm_nemo.steps.rates import StepRates
from charllm_nemo.steps.report import (
    VECTOR_WIDTH,
    StepReport,
    apply_rank_figures,
    combine_head,
    pack_rank_vector,
)


def test_the_loss_is_token_weighted_when_ranks_send_sums_else_the_mean_of_those_that_have_one() -> None:
    # Megatron's last pipeline stage has the loss terms; the other stages send zeros.
    rows = [pack_rank_vector(loss_sum=6.0, loss_tokens=2.0, step_time_s=0.2),
            pack_rank_vector(loss_sum=2.0, loss_tokens=2.0, step_time_s=0.3),
            pack_rank_vector(step_time_s=0.1)]  # fmt: skip
    head = combine_head(rows)
    assert head.loss == 2.0 and head.step_time_s == 0.3  # (6 + 2) / (2 + 2); the slowest rank
    # Frameworks that average already (NeMo, Megatron-LM): the mean over the ranks that have one;
    # a NaN or missing loss is no loss.
    rows = [pack_rank_vector(loss=2.0), pack_rank_vector(loss=4.0), pack_rank_vector(loss=math.nan),
            pack_rank_vector(loss=None)]  # fmt: skip
    assert combine_head(rows).loss == 3.0
    assert combine_head([pack_rank_vector()]).loss is None
    assert all(len(r) == VECTOR_WIDTH for r in rows)


def test_a_rank_with_several_devices_sends_their_combined_figures() -> None:
    devices = [{"energy_j": 3.0, "power_peak_w": 500.0, "temp_gpu_peak_c": 70.0},
               {"energy_j": 4.0, "power_peak_w": 650.0, "temp_gpu_peak_c": 65.0}]  # fmt: skip
    report = StepReport(step=0, loss=None, step_time_s=1.0)
    apply_rank_figures(report, [pack_rank_vector(step_time_s=1.0, figures=devices)])
    assert (report.energy_j, report.power_peak_w, report.temp_gpu_peak_c) == (7.0, 650.0, 70.0)
    assert report.per_rank[0]["energy_j"] == 7.0 and math.isnan(report.per_rank[0]["clock_sm_min_mhz"])


def test_mfu_says_how_it_counted_attention_on_the_console_and_in_the_rows() -> None:
    rates = StepRates(model_flops_per_step=4e12, global_batch_size=4, seq_length=1024, world_size=2,
                      peak_tflops_per_gpu=10.0, attention_flops="causal")  # fmt: skip
    r = StepReport(step=2, loss=1.25, step_time_s=0.5)
    rates.fill(r)
    assert r.mfu == pytest.approx(4e12 / 0.5 / 2 / 10e12) and r.mfu_attention == "causal"
    assert "| MFU 40.0% (causal attn) |" in format_report(r, 10, 2)
    assert r.to_dict()["mfu_attention"] == "causal"
    with pytest.raises(ValueError, match=r"telemetry\.attention_flops='half'"):
        StepRates(1.0, 1, 1, 1, attention_flops="half")
    unknown_peak = StepReport(step=0, loss=None, step_time_s=0.5)
    StepRates(4e12, 4, 1024, 2).fill(unknown_peak)
    assert unknown_peak.mfu is None and "MFU n/a" in format_report(unknown_peak, None, 2)


def test_the_console_numbers_steps_from_0_as_the_files_do() -> None:
    # steps.jsonl, windows, alerts and inspect say step 2; the console says it too, then the count done
    r = StepReport(step=2, loss=1.0, step_time_s=0.5)
    assert format_report(r, 5, 1).startswith("step 2 (3/5) | ")
    assert format_report(r, None, 1).startswith("step 2 | ")
    assert r.to_dict()["step"] == 2
