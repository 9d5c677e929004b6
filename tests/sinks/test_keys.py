"""The metric key layout and the gather vector: plain functions over numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from charllm_nemo.sinks.keys import (
    STEP_FIGURE_KEYS,
    STEP_KEY,
    StepKeys,
    aggregate_keys,
    combine_devices,
    pack_step_figures,
    rank_keys,
    step_metrics,
    summary_keys,
    throughput_keys,
    unpack_gathered,
    unpack_step_figures,
)
from charllm_nemo.telemetry.attribution import (
    ATTRIBUTION_COLUMN_NAMES,
    ATTRIBUTION_COLUMNS,
    attribute_windows,
)
from charllm_nemo.telemetry.figures import RANK_FIGURES
from charllm_nemo.telemetry.schema import THROTTLE_REASONS

NAN = math.nan


def test_every_step_figure_reads_an_attribution_column_of_the_same_unit():
    units = {name: unit.replace("degC", "°C") for name, unit, _ in ATTRIBUTION_COLUMNS}
    assert len(set(STEP_FIGURE_KEYS)) == len(STEP_FIGURE_KEYS)
    for fig in RANK_FIGURES:
        assert fig.source in ATTRIBUTION_COLUMN_NAMES, fig.name
        assert units[fig.source] == fig.unit, fig.name
    for reason, _ in THROTTLE_REASONS:
        assert f"throttle_{reason}_s" in STEP_FIGURE_KEYS


def test_a_real_attribution_row_packs_and_unpacks_unchanged():
    # 200 W flat for 1 s sampled at 10 Hz: 200 J, 200 W average, whatever else is null.
    t = np.arange(0, 11) * 100_000_000
    figures = attribute_windows({"t_mono_ns": t, "power_instant_w": np.full(11, 200.0)}, [(0, 1_000_000_000)])
    row = {k: v[0].item() for k, v in figures.items()}
    vec = pack_step_figures([row])
    assert len(vec) == len(STEP_FIGURE_KEYS)
    back = unpack_step_figures(vec)
    assert back["energy_j"] == pytest.approx(200.0)
    assert back["power_avg_w"] == pytest.approx(200.0)
    assert math.isnan(back["temp_gpu_peak_c"])  # not sampled: NaN, not 0


def test_a_rank_with_two_devices_adds_energy_and_power_and_takes_the_worst_peak():
    a = {
        "energy_j": 10.0,
        "power_avg_w": 100.0,
        "power_peak_w": 150.0,
        "temp_gpu_peak_c": 60.0,
        "clock_sm_avg_mhz": 1000.0,
        "clock_sm_min_mhz": 900.0,
        "throttle_any_limiting_s": 0.0,
        "pcie_tx_bytes": 5.0,
    }
    b = {
        "energy_j": 30.0,
        "power_avg_w": 300.0,
        "power_peak_w": 350.0,
        "temp_gpu_peak_c": NAN,
        "clock_sm_avg_mhz": 2000.0,
        "clock_sm_min_mhz": 800.0,
        "throttle_any_limiting_s": 0.25,
        "pcie_tx_bytes": None,
    }
    f = combine_devices([a, b])
    assert f["energy_j"] == 40.0
    assert f["power_avg_w"] == 400.0
    assert f["power_peak_w"] == 350.0
    assert f["temp_gpu_peak_c"] == 60.0  # the one device that knows
    assert f["clock_sm_avg_mhz"] == 1500.0
    assert f["clock_sm_min_mhz"] == 800.0
    assert f["throttle_any_limiting_s"] == 0.25
    assert f["pcie_tx_bytes"] == 5.0
    assert math.isnan(f["nvlink_tx_bytes"])
    assert all(math.isnan(v) for v in combine_devices(None).values())
    assert combine_devices(a)["energy_j"] == 10.0  # one row as a mapping
    few = ("temp_gpu_peak_c", "energy_j")  # what the console asks for: those, combined alike
    assert combine_devices([a, b], few) == {name: f[name] for name in few}
    # One device takes a shortcut; it gives what combining it with a device that knows nothing gives.
    for row in (a, b, {"energy_j": True, "power_peak_w": "x", "temp_gpu_peak_c": math.inf}, {}):
        alone, with_blank = combine_devices([row]), combine_devices([row, {}])
        assert alone.keys() == with_blank.keys()
        for k, v in alone.items():
            assert v == with_blank[k] or (math.isnan(v) and math.isnan(with_blank[k])), k


def test_rank_keys_omit_what_is_not_known_instead_of_logging_zero():
    keys = rank_keys(
        3,
        {
            "energy_j": 12.5,
            "power_avg_w": NAN,
            "power_peak_w": None,
            "temp_gpu_peak_c": 0.0,
            "clock_sm_avg_mhz": math.inf,
        },
    )
    assert keys == {"rank/3/energy_j": 12.5, "rank/3/temp_gpu_peak_c": 0.0}


def test_aggregates_over_three_ranks():
    per_rank = [
        {
            "duration_s": 2.0,
            "energy_j": 100.0,
            "power_avg_w": 50.0,
            "power_peak_w": 80.0,
            "temp_gpu_peak_c": 60.0,
            "temp_hbm_peak_c": 70.0,
            "throttle_any_limiting_s": 0.0,
            "pcie_tx_bytes": 10.0,
        },
        {
            "duration_s": 2.0,
            "energy_j": 300.0,
            "power_avg_w": 150.0,
            "power_peak_w": 200.0,
            "temp_gpu_peak_c": 75.0,
            "temp_hbm_peak_c": NAN,
            "throttle_any_limiting_s": 0.5,
            "pcie_tx_bytes": 30.0,
        },
        {
            "duration_s": 2.0,
            "energy_j": NAN,
            "power_avg_w": NAN,
            "power_peak_w": NAN,
            "temp_gpu_peak_c": 66.0,
            "throttle_any_limiting_s": 1.0,
        },
    ]
    agg = aggregate_keys(per_rank)
    assert agg["all/ranks_reporting"] == 2
    assert agg["all/energy_j"] == 400.0
    assert agg["all/power_mean_w"] == 100.0
    assert agg["all/power_max_w"] == 150.0
    assert agg["all/power_min_w"] == 50.0
    assert agg["all/power_peak_w"] == 200.0
    assert agg["all/temp_max_c"] == 75.0
    assert agg["all/temp_spread_c"] == 15.0  # hottest (75) - coolest (60)
    assert agg["all/temp_hbm_max_c"] == 70.0
    assert agg["all/ranks_throttled"] == 2
    assert agg["all/throttle_max_s"] == 1.0
    assert agg["all/throttle_share"] == 0.5
    assert agg["all/pcie_tx_bytes"] == 40.0
    assert "all/nvlink_tx_bytes" not in agg
    assert "all/clock_sm_mean_mhz" not in agg


def test_no_rank_reporting_gives_only_the_count():
    assert aggregate_keys([{}, {"energy_j": NAN}]) == {"all/ranks_reporting": 0}


def test_throughput_keys_and_a_step_summary_map_to_the_same_names():
    from charllm_nemo.steps.report import StepReport as StepSummary

    s = StepSummary(
        step=4,
        loss=2.5,
        step_time_s=0.1,
        tokens_per_s=1000.0,
        samples_per_s=10.0,
        model_tflops_per_gpu=1.5,
        hardware_tflops_per_gpu=2.0,
        mfu=None,
    )
    keys = summary_keys(s.to_dict())
    assert keys == {
        "train/loss": 2.5,
        "perf/step_time_s": 0.1,
        "perf/tokens_per_s": 1000.0,
        "perf/samples_per_s": 10.0,
        "perf/tflops_per_gpu": 1.5,
        "perf/hw_tflops_per_gpu": 2.0,
    }
    assert "perf/mfu" not in keys  # unknown peak: no MFU, not MFU 0
    assert (
        throughput_keys(
            loss=2.5,
            step_time_s=0.1,
            tokens_per_s=1000.0,
            samples_per_s=10.0,
            tflops_per_gpu=1.5,
            hw_tflops_per_gpu=2.0,
        )
        == keys
    )


def test_step_metrics_has_the_step_axis_every_rank_and_the_aggregates():
    gathered = [pack_step_figures({"energy_j": 1.0, "power_avg_w": 10.0}), pack_step_figures(None)]
    m = step_metrics(7, summary={"loss": 1.25, "step_time_s": 0.5}, per_rank=unpack_gathered(gathered))
    assert m[STEP_KEY] == 7
    assert m["train/loss"] == 1.25
    assert m["rank/0/energy_j"] == 1.0
    assert not any(k.startswith("rank/1/") for k in m)  # rank 1 knew nothing
    assert m["all/ranks_reporting"] == 1
    assert m["all/energy_j"] == 1.0


def test_a_short_vector_is_an_error():
    with pytest.raises(ValueError, match="STEP_FIGURE_KEYS"):
        unpack_step_figures([1.0, 2.0])


def test_step_keys_can_log_fewer_rank_figures_and_skip_steps_for_them():
    gathered = [pack_step_figures({"energy_j": 1.0, "power_avg_w": 10.0, "temp_gpu_peak_c": 50.0})] * 2
    full = StepKeys()
    assert full(0, {"loss": 1.0}, gathered) == step_metrics(
        0, summary={"loss": 1.0}, per_rank=unpack_gathered(gathered)
    )
    few = StepKeys(rank_figures=["power_avg_w"], rank_every=10)
    m0 = few(10, None, gathered)
    assert {k for k in m0 if k.startswith("rank/")} == {"rank/0/power_avg_w", "rank/1/power_avg_w"}
    m1 = few(11, None, gathered)
    assert not any(k.startswith("rank/") for k in m1)
    assert m1["all/energy_j"] == 2.0 and m1["all/temp_max_c"] == 50.0  # aggregates every step
    assert StepKeys()(3, None, None) == {STEP_KEY: 3}
    with pytest.raises(ValueError, match="power_w"):
        StepKeys(rank_figures=["power_w"])
