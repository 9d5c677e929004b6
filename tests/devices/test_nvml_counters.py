"""The driver's per-reason throttle counters (violation fields and nvmlDeviceGetViolationStatus),
their values' own timestamps, the reason bits 0x200 / 0x400 and the power-smoothing /
workload-profile state in the identity (manifest), through the stand-in NVML."""

from __future__ import annotations

from typing import Any

import pytest

from charllm_nemo.telemetry.schema import VIOLATION_COUNTERS, decode_throttle
from tests.devices.helpers import assert_unavailable_once, read_refused, value

pynvml = pytest.importorskip("pynvml")
nvml = pytest.importorskip("charllm_nemo.devices.nvml")

FI_SYNC_BOOST, FI_BOARD_LIMIT, FI_SW_THERM = 76, 77, 269


def test_the_ids_this_code_falls_back_to_are_the_bindings() -> None:
    # The defaults in nvml_sources stand in for an older binding; they must equal the names.
    from charllm_nemo.devices.nvml_sources import _FIELD_DEFAULTS, VIOLATION_SOURCES

    for name, fid in _FIELD_DEFAULTS.items():
        if hasattr(pynvml, name):
            assert getattr(pynvml, name) == fid, name
    for field_name, policy in VIOLATION_SOURCES.values():
        assert field_name in _FIELD_DEFAULTS
        if policy is not None and hasattr(pynvml, policy[0]):
            assert getattr(pynvml, policy[0]) == policy[1], policy
    assert pynvml.nvmlClocksThrottleReasonBoardLimit == 0x200
    assert pynvml.nvmlClocksThrottleReasonReliability == 0x400


def test_every_counter_and_its_timestamp_from_one_field_entry(fake_nvml: Any) -> None:
    fake_nvml.script("0 violation_ts_us 1700000000000042\n0 violation_reliability_ns 77")
    with nvml.open_backend() as b:
        dev = b.devices[0]
        sources = dev.identity.extra["metric_sources"]
        fake_nvml.reset_counts()
        reading = dev.read()
        gauges = dev.read_gauges()
    for name, _ in VIOLATION_COUNTERS:
        assert isinstance(value(reading, f"violation_{name}_ns"), int), name
        assert value(reading, f"violation_{name}_ts_us") == 1700000000000042, name
        assert sources[f"violation_{name}_ts_us"] == sources[f"violation_{name}_ns"] + ".timestamp"
        assert value(gauges, f"violation_{name}_ns") is None  # read with the counters only
        assert value(gauges, f"violation_{name}_ts_us") is None
    assert value(reading, "violation_reliability_ns") == 77
    # a counter and its timestamp share one entry of the batch: each field asked once per read
    for fid in (74, 75, FI_SYNC_BOOST, FI_BOARD_LIMIT, 78, 79, 80, 81, FI_SW_THERM, 270, 271):
        assert fake_nvml.field_calls(fid) == 1, fid
    assert fake_nvml.calls("nvmlDeviceGetViolationStatus") == 0


def test_a_field_not_supported_falls_back_to_the_policy_call_with_its_reference_time(
    fake_nvml: Any,
) -> None:
    fake_nvml.script(
        """
        0 field:77 NOT_SUPPORTED
        0 violation_board_limit_ns 123456789012
        0 violation_ts_us 1700000000000777
        """
    )
    with nvml.open_backend() as b:
        dev = b.devices[0]
        sources = dev.identity.extra["metric_sources"]
        fake_nvml.reset_counts()
        reading = dev.read()
    label = "nvmlDeviceGetViolationStatus(NVML_PERF_POLICY_BOARD_LIMIT)"
    assert sources["violation_board_limit_ns"] == sources["violation_board_limit_ts_us"] == label
    assert value(reading, "violation_board_limit_ns") == 123456789012
    assert value(reading, "violation_board_limit_ts_us") == 1700000000000777  # referenceTime
    assert fake_nvml.calls("nvmlDeviceGetViolationStatus") == 1  # one call fills both metrics
    assert fake_nvml.field_calls(FI_BOARD_LIMIT) == 0


def test_not_supported_per_field_is_read_once_then_skipped(
    fake_nvml: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # The clock-event reason fields have no older call: NOT_SUPPORTED leaves them null, and the
    # policy counters whose field and call both refuse are null too; the rest go on.
    readings, supported = read_refused(
        fake_nvml,
        caplog,
        """
        0 field:269 NOT_SUPPORTED
        0 field:76 NOT_SUPPORTED
        0 violation_sync_boost_ns NOT_SUPPORTED
        """,
        reads=4,
    )
    assert_unavailable_once(
        ("violation_sw_thermal_ns", "violation_sw_thermal_ts_us", "violation_sync_boost_ns"),
        readings,
        supported,
        caplog,
    )
    assert fake_nvml.field_calls(FI_SW_THERM) == 0 and fake_nvml.field_calls(FI_SYNC_BOOST) == 0
    assert fake_nvml.calls("nvmlDeviceGetViolationStatus") == 0
    assert all(value(r, "violation_hw_thermal_ns") == 1008 for r in readings)


def test_a_counter_that_goes_back_is_reported_as_the_driver_gives_it(fake_nvml: Any) -> None:
    # A reset (driver reload) or a wrap is the analysis's business (a segment that goes down is
    # left out there); the backend reports the raw 64-bit value.
    fake_nvml.script(f"0 violation_hw_power_brake_ns {2**64 - 5}")
    with nvml.open_backend() as b:
        dev = b.devices[0]
        before = value(dev.read(), "violation_hw_power_brake_ns")
        fake_nvml.command("0 violation_hw_power_brake_ns 3")
        after = value(dev.read(), "violation_hw_power_brake_ns")
    assert (before, after) == (2**64 - 5, 3)


def test_board_limit_and_reliability_bits_are_read_and_named(fake_nvml: Any) -> None:
    fake_nvml.script("0 clocks_event_reasons 0x604")
    with nvml.open_backend() as b:
        mask = value(b.devices[0].read(), "throttle_reasons")
    assert mask == 0x604
    assert decode_throttle(mask) == ("sw_power_cap", "board_limit", "reliability")


def test_power_state_unavailable_by_default(fake_nvml: Any) -> None:
    with nvml.open_backend() as b:
        state = b.devices[0].identity.extra["power_state"]
    assert set(state["smoothing"]) == {
        "enabled",
        "privilege_level",
        "applied_tmp_ceiling",
        "applied_tmp_floor",
        "active_preset_profile",
    }
    assert all(v.startswith("unavailable: ") and "Not Supported" in v for v in state["smoothing"].values())
    assert (
        state["workload_profiles"].startswith("unavailable: ")
        and "Not Supported" in state["workload_profiles"]
    )


def test_power_state_recorded_where_the_driver_exposes_it(fake_nvml: Any) -> None:
    fake_nvml.script(
        f"""
        0 power_smoothing_enabled 1
        0 power_smoothing_profile 2
        0 workload_profiles_requested {1 << pynvml.NVML_POWER_PROFILE_LLM_TRAINING}
        0 workload_profiles_enforced {1 << pynvml.NVML_POWER_PROFILE_LLM_TRAINING | 1 << 31}
        """
    )
    with nvml.open_backend() as b:
        state = b.devices[0].identity.extra["power_state"]
    assert state["smoothing"]["enabled"] == 1
    assert state["smoothing"]["active_preset_profile"] == 2
    assert state["smoothing"]["applied_tmp_floor"].startswith("unavailable: ")
    assert state["workload_profiles"] == {
        "requested": ["llm_training"],
        "enforced": ["llm_training", "profile_31"],
    }


def test_power_state_without_the_entry_point(fake_nvml: Any) -> None:
    fake_nvml.script("* fn:nvmlDeviceWorkloadPowerProfileGetCurrentProfiles FUNCTION_NOT_FOUND")
    with nvml.open_backend() as b:
        state = b.devices[0].identity.extra["power_state"]
    assert state["workload_profiles"].startswith("unavailable: ")
