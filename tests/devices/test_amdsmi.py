"""The AMD SMI backend against a fake ``amdsmi`` module that mirrors the 7.0.2 API."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

try:
    from tests.fakes import fake_amdsmi as fa
except ImportError:  # tests/devices is not a package, so the repository root may not be on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.fakes import fake_amdsmi as fa
from charllm_nemo.devices import amdsmi as amd
from charllm_nemo.devices import factory
from charllm_nemo.devices.base import Backend, Device
from charllm_nemo.errors import BackendUnavailable, ConfigError, DeviceLost
from charllm_nemo.telemetry.schema import METRICS, THROTTLE_BITS, VIOLATION_COUNTERS
from tests.devices.helpers import value

MIB = 2**20
GIB = 2**30


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch) -> Callable[[Sequence[fa.FakeGpu]], fa.FakeAmdSmi]:
    """install(gpus) -> the FakeAmdSmi now answering ``import amdsmi``."""
    return lambda gpus: fa.install(monkeypatch, gpus)


@pytest.fixture
def opened() -> Iterator[Callable[..., amd.AmdSmiBackend]]:
    """open(indices=None, **options) -> an AmdSmiBackend closed at teardown."""
    backends: list[amd.AmdSmiBackend] = []

    def open_(indices: Sequence[int] | None = None, **options: Any) -> amd.AmdSmiBackend:
        backend = amd.open_backend(indices, **options)
        backends.append(backend)
        return backend

    yield open_
    for backend in backends:
        backend.close()


def energy_mj(ticks: int, resolution_uj: float) -> int:
    return int(ticks * Fraction(resolution_uj) / 1000)


# -- identity and the reading ----------------------------------------------------------------


def test_identity_of_an_mi300x(install, opened) -> None:
    install([fa.mi300x(0)])
    dev = opened().devices[0]
    ident = dev.identity
    assert (ident.index, ident.name, ident.vendor, ident.backend) == (
        0,
        "AMD Instinct MI300X",
        "amd",
        "amdsmi",
    )
    assert ident.uuid == "81ff74a1-0000-1000-8089-a3c2b3e12f00"
    assert ident.driver_version == "6.12.12"
    x = ident.extra
    assert x["bdf"] == "0000:05:00.0"
    assert x["energy_counter_resolution_uj"] == 15.2587890625
    assert (x["hip_id"], x["drm_card"], x["drm_render"]) == (0, 0, 128)
    assert (x["gfx_target"], x["compute_units"], x["compute_partition"]) == ("gfx942", 304, "SPX")
    assert x["vram_total_bytes"] == 192 * GIB
    assert x["xgmi_hive_id"] == "0x2a3b4c5d6e7f8091"
    assert x["power_instant_source"] == "current_socket_power"
    assert (x["power_scope"], x["package_power_die"], x["package_dies"]) == ("device", 0, [0])
    assert x["throttle_source"] == "gpu_metrics residency counters"
    assert (x["amdsmi_version"], x["amdsmi_lib_version"]) == ("7.0.2", "25.5.1")
    json.dumps(ident.to_dict())  # the manifest must be able to hold it


def test_backend_and_device_follow_the_protocol(install, opened) -> None:
    install([fa.mi300x(0), fa.mi300x(1)])
    backend = opened()
    assert backend.name == "amdsmi"
    assert isinstance(backend, Backend)
    assert all(isinstance(d, Device) for d in backend.devices)
    assert [d.identity.index for d in backend.devices] == [0, 1]


def test_each_metric_in_schema_units_on_an_mi300x(install, opened) -> None:
    fake = install([fa.mi300x(0)])
    reading = opened().devices[0].read()
    assert len(reading) == len(METRICS)
    expected = {
        "power_instant_w": 550.0,  # current_socket_power, W
        "power_avg_w": None,  # MI300X: average_socket_power is N/A
        "power_memory_w": None,
        "energy_mj": energy_mj(3_000_000_000, 15.2587890625),  # ticks x µJ/tick -> mJ
        "temp_gpu_c": None,  # MI300X has no edge sensor
        "temp_hbm_c": 48.0,
        "temp_hotspot_c": 62.0,
        "clock_sm_mhz": 2100.0,
        "clock_mem_mhz": 1300.0,
        "throttle_reasons": 0,
        "violation_power_ns": 0,
        "violation_thermal_ns": 0,
        "util_gpu_pct": 97.0,
        "util_mem_pct": 41.0,
        "mem_used_bytes": 150 * GIB,
        "power_limit_w": 750.0,
        "pcie_tx_bytes": None,
        "pcie_rx_bytes": None,
        "nvlink_tx_bytes": 4_000_000 * 1024,  # xgmi_write_data_acc, KB summed over links
        "nvlink_rx_bytes": 10_000_000 * 1024,  # xgmi_read_data_acc
        # NVML's other per-reason counters and the driver timestamps: none on AMD
        **{f"violation_{n}_ns": None for n, _ in VIOLATION_COUNTERS if n not in ("power", "thermal")},
        **{f"violation_{n}_ts_us": None for n, _ in VIOLATION_COUNTERS},
        "power_module_w": None,  # NVML's module power scope: amdsmi has none
        "power_module_avg_w": None,
    }
    assert dict(zip((m.name for m in METRICS), reading, strict=True)) == expected
    for metric, v in zip(METRICS, reading, strict=True):
        if v is not None:
            assert type(v) is (float if metric.kind == "float" else int), metric.name
    assert fake.calls["amdsmi_get_violation_status"] == 0  # it sleeps 100 ms per call


def test_supported_metrics_reflect_the_probe(install, opened) -> None:
    install([fa.mi300x(0)])
    supported = opened().devices[0].supported_metrics()
    assert supported["power_instant_w"] and supported["temp_hotspot_c"] and supported["nvlink_rx_bytes"]
    assert not supported["temp_gpu_c"] and not supported["power_avg_w"] and not supported["pcie_tx_bytes"]


def test_energy_counter_is_exact_over_the_full_64_bits(install, opened) -> None:
    gpu = fa.mi300x(0)
    install([gpu])
    dev = opened().devices[0]
    gpu.energy_accumulator = 2**64 - 1
    got = value(dev.read(), "energy_mj")
    exact = (2**64 - 1) * 15625 // 1_024_000  # 15.2587890625 µJ = 15625/1024 µJ
    assert got == exact
    assert int((2**64 - 1) * 15.2587890625 / 1000) != exact  # what a float product would give


def test_energy_uses_the_reported_resolution(install, opened) -> None:
    gpu = fa.mi300x(0, counter_resolution=1.0, energy_accumulator=5_000_000)  # 1 µJ per tick
    install([gpu])
    assert value(opened().devices[0].read(), "energy_mj") == 5_000
    gpu2 = fa.mi300x(0, counter_resolution=0.0)
    install([gpu2])
    assert value(opened().devices[0].read(), "energy_mj") is None  # no resolution, no energy


def test_instant_power_falls_back_to_average_when_current_is_missing(install, opened) -> None:
    gpu = fa.mi300x(0)
    gpu.power.update(current_socket_power="N/A", average_socket_power=480)
    install([gpu])
    dev = opened().devices[0]
    r = dev.read()
    assert value(r, "power_instant_w") == 480.0
    assert value(r, "power_avg_w") == 480.0
    assert dev.identity.extra["power_instant_source"] == "average_socket_power"


def test_na_after_the_probe_is_null_for_that_sample(install, opened) -> None:
    gpu = fa.mi300x(0)
    install([gpu])
    dev = opened().devices[0]
    gpu.activity["gfx_activity"] = "N/A"
    gpu.power["current_socket_power"] = "N/A"
    r = dev.read()
    assert value(r, "util_gpu_pct") is None
    assert value(r, "power_instant_w") is None  # no switch to another source mid-run
    assert value(r, "util_mem_pct") == 41.0
    gpu.activity["gfx_activity"] = 55
    gpu.power["current_socket_power"] = 0xFFFFFFFF  # a uint32 sentinel the wrapper lets through
    r = dev.read()
    assert value(r, "util_gpu_pct") == 55.0
    assert value(r, "power_instant_w") is None


@pytest.mark.parametrize(
    ("power_info_limit", "cap", "expected"),
    [
        (750, 750_000_000, 750.0),  # power_info in W
        (700_000_000, 750_000_000, 700.0),  # power_info from the raw hwmon file, µW
        ("N/A", 650_000_000, 650.0),  # power_cap_info, µW (Linux bare metal)
        ("N/A", 600, 600.0),  # power_cap_info in W (virtualization host)
        ("N/A", 0, None),
    ],
)
def test_power_limit_in_watts_whatever_unit_amdsmi_uses(
    install, opened, power_info_limit, cap, expected
) -> None:
    gpu = fa.mi300x(0)
    gpu.power["power_limit"] = power_info_limit
    gpu.power_cap["power_cap"] = cap
    install([gpu])
    assert value(opened().devices[0].read(), "power_limit_w") == expected


def test_vram_usage_falls_back_to_megabytes(install, opened) -> None:
    gpu = fa.mi300x(0, errors={"amdsmi_get_gpu_memory_usage": fa.AMDSMI_STATUS_NOT_SUPPORTED})
    install([gpu])
    assert value(opened().devices[0].read(), "mem_used_bytes") == 150 * 1024 * MIB


def test_prefer_gpu_metrics_reads_the_table_first(install, opened) -> None:
    fake = install(fa.mi250_package(0))
    dev = opened(prefer="gpu_metrics").devices[0]
    before = dict(fake.calls)
    r = dev.read()
    assert (value(r, "temp_gpu_c"), value(r, "temp_hotspot_c"), value(r, "temp_hbm_c")) == (38.0, 45.0, 50.0)
    assert value(r, "util_gpu_pct") == 88.0
    assert fake.calls["amdsmi_get_temp_metric"] == before.get("amdsmi_get_temp_metric", 0)
    assert fake.calls["amdsmi_get_gpu_activity"] == before.get("amdsmi_get_gpu_activity", 0)
    assert fake.calls["amdsmi_get_gpu_metrics_info"] == before["amdsmi_get_gpu_metrics_info"] + 1


# -- throttle and violation time -------------------------------------------------------------


def test_residency_counters_become_throttle_bits_and_violation_time(install, opened) -> None:
    gpu = fa.mi300x(0)
    install([gpu])
    dev = opened().devices[0]
    m = gpu.gpu_metrics

    def advance(ns: int, cycles: int, **held: int) -> tuple[Any, ...]:
        m["accumulation_counter"] += cycles
        m["system_clock_counter"] += ns
        for key, n in held.items():
            m[key] += n
        return dev.read()

    # 1 ms of firmware time, power cap held the clock for half of it
    r = advance(1_000_000, 1000, ppt_residency_acc=500)
    assert value(r, "throttle_reasons") == THROTTLE_BITS["sw_power_cap"]
    assert value(r, "violation_power_ns") == 500_000
    assert value(r, "violation_thermal_ns") == 0
    # a quarter of the next 2 ms on the socket thermal limit, all of it on HBM thermal
    r = advance(2_000_000, 1000, socket_thm_residency_acc=250, hbm_thm_residency_acc=1000)
    assert value(r, "throttle_reasons") == THROTTLE_BITS["sw_thermal"] | THROTTLE_BITS["hw_thermal"]
    assert value(r, "violation_power_ns") == 500_000  # cumulative since open
    assert value(r, "violation_thermal_ns") == 500_000
    # the firmware has not published a new snapshot: keep the bits, add nothing
    r = dev.read()
    assert value(r, "throttle_reasons") == THROTTLE_BITS["sw_thermal"] | THROTTLE_BITS["hw_thermal"]
    assert value(r, "violation_thermal_ns") == 500_000
    r = advance(1_000_000, 1000, prochot_residency_acc=10)
    assert value(r, "throttle_reasons") == THROTTLE_BITS["hw_slowdown"]
    r = advance(1_000_000, 1000)
    assert value(r, "throttle_reasons") == 0
    # counters reset (driver reload): start again from the new values, keep the totals
    m["accumulation_counter"] = 10
    r = dev.read()
    assert value(r, "violation_power_ns") == 500_000
    assert value(r, "throttle_reasons") == 0
    # a snapshot that says nothing ("N/A"): no bits, no times for it; the totals go on after it
    m["accumulation_counter"] = "N/A"
    r = dev.read()
    assert value(r, "throttle_reasons") is None and value(r, "violation_power_ns") is None
    m["accumulation_counter"] = 20
    r = dev.read()
    assert value(r, "violation_power_ns") == 500_000  # re-baselined, not back to 0
    r = advance(1_000_000, 1000, ppt_residency_acc=1000)
    assert value(r, "violation_power_ns") == 1_500_000


def test_bool_only_throttle_status_is_not_reported_as_bits(install, opened) -> None:
    gpus = fa.mi250_package(0)
    gpus[0].gpu_metrics["throttle_status"] = True  # 7.0.2 gives a bool: which limiter is unknown
    install(gpus)
    dev = opened().devices[0]
    r = dev.read()
    assert value(r, "throttle_reasons") is None
    assert value(r, "violation_power_ns") is None
    assert dev.identity.extra["throttle_source"] is None


# -- multi-die packages ----------------------------------------------------------------------


@pytest.mark.parametrize("secondary_power", ["N/A", 0])
@pytest.mark.parametrize("secondary_energy", [0, 9_000_000_000])
def test_mi250_only_the_reporting_die_has_package_power(
    install, opened, secondary_power, secondary_energy
) -> None:
    install(fa.mi250_package(0, secondary_power=secondary_power, secondary_energy=secondary_energy))
    die0, die1 = opened().devices
    r0, r1 = die0.read(), die1.read()
    assert value(r0, "power_instant_w") == 290.0  # the package (both dies), from average power
    assert value(r0, "power_avg_w") == 290.0
    assert value(r0, "energy_mj") == energy_mj(9_000_000_000, 15.2587890625)
    for name in ("power_instant_w", "power_avg_w", "energy_mj"):
        assert value(r1, name) is None, name  # never 0, never a copy of die 0
        assert not die1.supported_metrics()[name]
    # the rest of die 1 is its own
    assert (value(r1, "temp_gpu_c"), value(r1, "clock_sm_mhz"), value(r1, "util_gpu_pct")) == (
        39.0,
        1700.0,
        88.0,
    )
    x0, x1 = die0.identity.extra, die1.identity.extra
    assert x0["power_scope"] == "package" and x1["power_scope"] == "none"
    assert x0["package_power_die"] == x1["package_power_die"] == 0
    assert x0["package_dies"] == x1["package_dies"] == [0, 1]
    assert x0["package_id"] == x1["package_id"] == "PCB0469820000"
    assert x0["power_instant_source"] == "average_socket_power"
    assert x1["power_instant_source"] is None
    assert value(r1, "power_limit_w") is None and value(r0, "power_limit_w") == 560.0


def test_mi250_die_opened_alone_still_names_its_partner(install, opened) -> None:
    install(fa.mi250_package(0) + fa.mi250_package(1))
    dev = opened([3]).devices[0]
    assert dev.identity.index == 3
    assert dev.identity.extra["package_power_die"] == 2
    assert dev.identity.extra["package_dies"] == [2, 3]
    assert value(dev.read(), "power_instant_w") is None


def test_unsupported_metrics_are_logged_once_and_never_called_again(install, opened, caplog) -> None:
    fake = install([fa.mi300x(0)])
    with caplog.at_level(logging.INFO, logger="charllm_nemo.devices"):
        dev = opened().devices[0]
        at_open = [r for r in caplog.records if "temp_gpu_c" in r.getMessage()]
        assert len(at_open) == 1
        assert "AMDSMI_STATUS_NOT_SUPPORTED" in at_open[0].getMessage()
        probes = fake.calls["amdsmi_get_temp_metric:EDGE"]
        assert probes == 1
        caplog.clear()
        for _ in range(5):
            dev.read()
        assert caplog.records == []
    assert fake.calls["amdsmi_get_temp_metric:EDGE"] == probes
    assert fake.calls["amdsmi_get_temp_metric:HOTSPOT"] == 1 + 5


# -- errors in the sampling loop -------------------------------------------------------------


def test_a_failing_call_is_null_for_that_sample_and_logged_once(install, opened, caplog) -> None:
    gpu = fa.mi300x(0)
    install([gpu])
    dev = opened().devices[0]
    gpu.errors["amdsmi_get_gpu_activity"] = fa.AMDSMI_STATUS_UNEXPECTED_DATA
    with caplog.at_level(logging.WARNING, logger="charllm_nemo.devices"):
        for _ in range(3):
            r = dev.read()
            assert value(r, "util_gpu_pct") is None and value(r, "util_mem_pct") is None
            assert value(r, "power_instant_w") == 550.0
    assert len([x for x in caplog.records if "amdsmi_get_gpu_activity" in x.getMessage()]) == 1
    del gpu.errors["amdsmi_get_gpu_activity"]
    assert value(dev.read(), "util_gpu_pct") == 97.0


@pytest.mark.parametrize(
    "code", [fa.AMDSMI_STATUS_NOT_FOUND, fa.AMDSMI_STATUS_DRIVER_NOT_LOADED, fa.AMDSMI_STATUS_NOT_INIT]
)
def test_a_lost_device_raises_device_lost(install, opened, code) -> None:
    gpu = fa.mi300x(0)
    install([gpu])
    dev = opened().devices[0]
    dev.read()
    gpu.lost, gpu.lost_code = True, code
    with pytest.raises(DeviceLost, match=r"0000:05:00\.0"):
        dev.read()


def test_reading_after_close_raises_device_lost(install) -> None:
    install([fa.mi300x(0)])
    backend = amd.open_backend()
    backend.close()
    with pytest.raises(DeviceLost, match="AMDSMI_STATUS_NOT_INIT"):
        backend.devices[0].read()


def test_a_device_whose_every_call_fails_is_lost_after_a_few_reads(install, opened) -> None:
    # A GPU whose sysfs vanished: amdsmi maps ENOENT to NOT_SUPPORTED on every call.
    gpu = fa.mi300x(0)
    install([gpu])
    dev = opened(lost_after=3).devices[0]
    gpu.lost, gpu.lost_code = True, fa.AMDSMI_STATUS_NOT_SUPPORTED
    assert all(v is None for v in dev.read())
    assert all(v is None for v in dev.read())
    with pytest.raises(DeviceLost, match="3 reads in a row"):
        dev.read()


def test_busy_everywhere_is_never_a_loss(install, opened) -> None:
    gpu = fa.mi300x(0)
    install([gpu])
    dev = opened(lost_after=2).devices[0]
    gpu.lost, gpu.lost_code = True, fa.AMDSMI_STATUS_BUSY
    for _ in range(5):
        assert all(v is None for v in dev.read())
    gpu.lost = False
    assert value(dev.read(), "power_instant_w") == 550.0


def test_one_good_read_resets_the_loss_count(install, opened) -> None:
    gpu = fa.mi300x(0)
    install([gpu])
    dev = opened(lost_after=2).devices[0]
    gpu.lost, gpu.lost_code = True, fa.AMDSMI_STATUS_NOT_SUPPORTED
    dev.read()
    gpu.lost = False
    dev.read()
    gpu.lost = True
    dev.read()  # one failed read again, not two in a row
    with pytest.raises(DeviceLost):
        dev.read()


# -- setup errors ----------------------------------------------------------------------------


def test_import_raising_key_error_is_backend_unavailable(monkeypatch, capsys) -> None:
    fa.install_failing_import(monkeypatch)  # what amdsmi 7.0.2 does without ROCm
    with pytest.raises(BackendUnavailable) as err:
        amd.open_backend()
    msg = str(err.value)
    assert "libamd_smi.so" in msg and "amd-smi-lib" in msg and "ROCM_PATH" in msg
    assert "Unable to find libamd_smi.so" in msg  # what the wrapper printed, kept in the message
    assert capsys.readouterr().out == ""  # ... and not on the training's stdout
    with pytest.raises(BackendUnavailable):
        factory.open_backend("amdsmi")


def test_import_error_says_how_to_install(monkeypatch) -> None:
    fa.install_missing_package(monkeypatch)
    with pytest.raises(BackendUnavailable, match=r"pip install 'charllm-nemo\[amd\]'"):
        amd.open_backend()


def test_other_import_failures_are_backend_unavailable(monkeypatch) -> None:
    fa.install_failing_import(monkeypatch, AttributeError("undefined symbol: amdsmi_get_gpu_revision"), "")
    with pytest.raises(BackendUnavailable, match="different releases"):
        amd.open_backend()


def test_the_real_pypi_package_without_rocm_is_backend_unavailable(monkeypatch) -> None:
    import importlib.util

    fa._forget_amdsmi(monkeypatch)
    if importlib.util.find_spec("amdsmi") is None:
        pytest.skip("the amdsmi package is not installed")
    rocm = Path(os.environ.get("ROCM_PATH", "/opt/rocm")) / "lib" / "libamd_smi.so"
    if rocm.exists():
        pytest.skip("ROCm is installed here; the real library may load")
    with pytest.raises(BackendUnavailable, match=r"libamd_smi\.so"):
        amd.open_backend()


def test_init_failure_points_at_the_driver(install) -> None:
    fake = install([fa.mi300x(0)])
    fake.init_error = fa.AMDSMI_STATUS_DRIVER_NOT_LOADED
    with pytest.raises(BackendUnavailable, match="amdgpu"):
        amd.open_backend()


def test_init_asks_for_gpus_only(install, opened) -> None:
    fake = install([fa.mi300x(0)])
    opened()
    assert fake.init_flags == [fa.AmdSmiInitFlags.INIT_AMD_GPUS]


def test_no_gpu_is_backend_unavailable_and_shuts_down(install) -> None:
    fake = install([])
    with pytest.raises(BackendUnavailable, match="no AMD GPU"):
        amd.open_backend()
    assert fake.shut_down_calls == 1 and not fake.initialized


@pytest.mark.parametrize("indices", [[2], [-1], [0, 5]])
def test_a_bad_index_names_the_valid_range(install, indices) -> None:
    fake = install([fa.mi300x(0), fa.mi300x(1)])
    with pytest.raises(ConfigError, match=r"valid indices are 0\.\.1"):
        amd.open_backend(indices)
    assert fake.shut_down_calls == 1 and not fake.initialized


def test_integer_like_indices_are_accepted_and_bools_are_not(install, opened) -> None:
    import numpy as np

    install([fa.mi300x(0), fa.mi300x(1)])
    assert [d.identity.index for d in opened([np.int64(1)]).devices] == [1]
    with pytest.raises(ConfigError, match="True"):
        amd.open_backend([True])
    with pytest.raises(ConfigError, match="'0'"):
        amd.open_backend(["0"])


def test_a_repeated_index_is_a_config_error(install) -> None:
    install([fa.mi300x(0), fa.mi300x(1)])
    with pytest.raises(ConfigError, match="more than once"):
        amd.open_backend([1, 1])


@pytest.mark.parametrize("options", [{"prefer": "sysfs"}, {"lost_after": 0}, {"count": 2}])
def test_bad_options_are_config_errors(options) -> None:
    with pytest.raises(ConfigError):
        amd.open_backend(None, **options)


def test_close_is_idempotent(install) -> None:
    fake = install([fa.mi300x(0)])
    backend = amd.open_backend()
    backend.close()
    backend.close()
    assert fake.shut_down_calls == 1


def test_the_factory_opens_it_by_name(install) -> None:
    install([fa.mi300x(0), fa.mi300x(1)])
    backend = factory.open_backend("amdsmi", [1])
    try:
        assert backend.name == "amdsmi"
        assert [d.identity.index for d in backend.devices] == [1]
    finally:
        backend.close()
