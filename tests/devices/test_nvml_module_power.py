"""The module power scope (NVML_POWER_SCOPE_MODULE: a Grace module's GPU + CPU + memory, on
GH200 / GB200) through the stand-in NVML: read in the one field batch where the driver serves it,
probed once and never read again where it answers NOT_SUPPORTED (every GPU that is not part of a
Grace module), and each power column's scope in the identity (the manifest)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from charllm_nemo.telemetry.schema import METRIC_INDEX

pynvml = pytest.importorskip("pynvml")
nvml = pytest.importorskip("charllm_nemo.devices.nvml")

FI_POWER_AVERAGE, FI_POWER_INSTANT = 185, 186
READS = 6


def value(reading: tuple[Any, ...], metric: str) -> Any:
    return reading[METRIC_INDEX[metric]]


def test_the_scope_ids_are_the_bindings() -> None:
    from charllm_nemo.devices import nvml_sources as s

    assert (s._POWER_SCOPE_GPU, s._POWER_SCOPE_MODULE, s._POWER_SCOPE_MEMORY) == (
        pynvml.NVML_POWER_SCOPE_GPU,
        pynvml.NVML_POWER_SCOPE_MODULE,
        pynvml.NVML_POWER_SCOPE_MEMORY,
    )
    assert (pynvml.NVML_FI_DEV_POWER_AVERAGE, pynvml.NVML_FI_DEV_POWER_INSTANT) == (185, 186)


def test_module_power_is_read_in_the_field_batch_where_the_driver_serves_it(fake_nvml: Any) -> None:
    fake_nvml.script("0 power_instant_mw 400000\n0 power_average_mw 380000\n0 power_module_extra_mw 180500")
    with nvml.open_backend() as b:
        dev = b.devices[0]
        extra = dev.identity.extra
        fake_nvml.reset_counts()
        readings = [dev.read_gauges() for _ in range(READS)]
        supported = dev.supported_metrics()
    assert supported["power_module_w"] and supported["power_module_avg_w"]
    for r in readings:
        assert value(r, "power_instant_w") == 400.0
        assert value(r, "power_module_w") == 580.5  # the GPU's 400 W and the rest of the module
        assert value(r, "power_module_avg_w") == 560.5
    assert extra["metric_sources"]["power_module_w"] == "NVML_FI_DEV_POWER_INSTANT[scope=0x1]"
    assert extra["metric_sources"]["power_module_avg_w"] == "NVML_FI_DEV_POWER_AVERAGE[scope=0x1]"
    assert extra["power_scopes"] == {
        "power_instant_w": "gpu",
        "power_avg_w": "gpu",
        "power_memory_w": "memory",
        "power_module_w": "module",
        "power_module_avg_w": "module",
    }
    # one batch a read, holding field 186 for the GPU, memory and module scopes, 185 for GPU and module
    assert fake_nvml.calls("nvmlDeviceGetFieldValues") == READS
    assert fake_nvml.field_calls(FI_POWER_INSTANT) == 3 * READS
    assert fake_nvml.field_calls(FI_POWER_AVERAGE) == 2 * READS


def test_not_supported_is_probed_once_and_never_read_again(
    fake_nvml: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # The stand-in's default, as an H100 / H200 answers: NOT_SUPPORTED for scope MODULE.
    caplog.set_level(logging.INFO, logger="charllm_nemo.devices")
    with nvml.open_backend() as b:
        dev = b.devices[0]
        extra = dev.identity.extra
        fake_nvml.reset_counts()
        readings = [dev.read() for _ in range(READS)]
        supported = dev.supported_metrics()
    for metric, field in (("power_module_w", "INSTANT"), ("power_module_avg_w", "AVERAGE")):
        assert supported[metric] is False
        assert all(value(r, metric) is None for r in readings)
        (line,) = [r.getMessage() for r in caplog.records if f" {metric} not available" in r.getMessage()]
        assert f"NVML_FI_DEV_POWER_{field}[scope=0x1]" in line and "Not Supported" in line
        assert extra["power_scopes"][metric] is None
        assert metric not in extra["metric_sources"]
    assert not [r for r in caplog.records if "while sampling" in r.getMessage()]  # no per-sample retry
    assert all(value(r, "power_instant_w") == 250.0 for r in readings)
    assert fake_nvml.field_calls(FI_POWER_INSTANT) == 2 * READS  # GPU and memory scope only
    assert fake_nvml.field_calls(FI_POWER_AVERAGE) == READS
    assert extra["power_scopes"]["power_instant_w"] == "gpu"


def test_the_average_falls_back_to_the_older_call_with_its_scope_still_gpu(fake_nvml: Any) -> None:
    fake_nvml.command(f"0 field:{FI_POWER_AVERAGE}:0 NOT_SUPPORTED")
    with nvml.open_backend() as b:
        extra = b.devices[0].identity.extra
    assert extra["metric_sources"]["power_avg_w"] == "nvmlDeviceGetPowerUsage"
    assert extra["power_scopes"]["power_avg_w"] == "gpu"
