"""The NVML backend, through the real nvidia-ml-py bindings loading the stand-in library.

In-process tests use the ``fake_nvml`` fixture (the stand-in installed as pynvml's library,
scripted through ctypes); the subprocess tests prove the LD_LIBRARY_PATH + FAKE_NVML_SCRIPT
path that the sampler, kill and benchmark tests use.
"""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

from charllm_nemo.devices.base import Backend, Device
from charllm_nemo.errors import BackendUnavailable, ConfigError, DeviceLost
from charllm_nemo.telemetry.schema import METRIC_INDEX, METRIC_NAMES, METRICS, VIOLATION_COUNTERS
from tests.devices.helpers import assert_unavailable_once, read_refused, value

pynvml = pytest.importorskip("pynvml")
nvml = pytest.importorskip("charllm_nemo.devices.nvml")

FI_POWER_INSTANT = 186
FI_POWER_AVERAGE = 185
FI_MEMORY_TEMP = 82
FI_PERF_POLICY_POWER = 74
FI_TOTAL_ENERGY = 83
FI_NVLINK_TX = 138
FI_NVLINK_RX = 139
ALL_LINKS = 0xFFFFFFFF


@pytest.fixture
def backend(fake_nvml: Any) -> Any:
    """A backend opened on the stand-in's defaults; closed afterwards."""
    b = nvml.open_backend()
    yield b
    b.close()


def run_child(code: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# --- identity and protocol --------------------------------------------------------------------


def test_identity_and_protocol(fake_nvml: Any) -> None:
    fake_nvml.script(
        """
        device_count 2
        driver_version 560.35.03
        nvml_version 12.560.35.03
        1 name NVIDIA H100 80GB HBM3
        1 uuid GPU-12345678-abcd-ef01-2345-6789abcdef01
        1 pci_bus_id 00000000:9A:00.0
        1 power_default_limit_mw 650000
        """
    )
    with nvml.open_backend() as b:
        assert isinstance(b, Backend)
        assert b.name == "nvml"
        assert [d.identity.index for d in b.devices] == [0, 1]
        dev = b.devices[1]
        assert isinstance(dev, Device)
        ident = dev.identity
        assert ident.name == "NVIDIA H100 80GB HBM3"
        assert ident.uuid == "GPU-12345678-abcd-ef01-2345-6789abcdef01"
        assert ident.driver_version == "560.35.03"
        assert (ident.vendor, ident.backend) == ("nvidia", "nvml")
        assert ident.extra["pci_bus_id"] == "00000000:9A:00.0"
        assert ident.extra["nvml_version"] == "12.560.35.03"
        assert ident.extra["power_limit_default_w"] == 650.0
        assert ident.extra["compute_capability"] == "9.0"
        assert ident.extra["metric_sources"]["power_instant_w"] == "NVML_FI_DEV_POWER_INSTANT"
        json.dumps(ident.to_dict())  # the manifest must be able to hold it
    assert fake_nvml.refcount == 0


def test_selected_indices(fake_nvml: Any) -> None:
    fake_nvml.set_global("device_count", 3)
    with nvml.open_backend([2]) as b:
        assert [d.identity.index for d in b.devices] == [2]
        assert b.devices[0].identity.uuid.endswith("000000000002")


# --- values and units -------------------------------------------------------------------------


def test_every_metric_in_schema_units(fake_nvml: Any) -> None:
    fake_nvml.script(
        """
        0 power_instant_mw 312345
        0 power_average_mw 298765
        0 power_memory_mw 45678
        0 power_module_extra_mw 150000
        0 energy_mj 987654321
        0 temp_gpu_c 61
        0 temp_memory_c 52
        0 temp_gpu_max_c 70
        0 clock_sm_mhz 1755
        0 clock_mem_mhz 2619
        0 clocks_event_reasons 0x24
        0 violation_power_ns 111222333
        0 violation_thermal_ns 444555
        0 violation_board_limit_ns 7000
        0 violation_hw_power_brake_ns 8000
        0 violation_ts_us 1700000000123456
        0 util_gpu_pct 88
        0 util_mem_pct 33
        0 mem_used_bytes 12884901888
        0 mem_reserved_bytes 536870912
        0 power_limit_mw 650000
        0 pcie_tx_bytes 123456789
        0 pcie_rx_bytes 987654321
        0 nvlink_tx_kib 1000
        0 nvlink_rx_kib 2000
        """
    )
    with nvml.open_backend() as b:
        reading = b.devices[0].read()
    expected = {
        "power_instant_w": 312.345,  # mW -> W
        "power_avg_w": 298.765,
        "power_memory_w": 45.678,
        "power_module_w": 462.345,  # the Grace module: the GPU's 312.345 W and the rest, 150 W
        "power_module_avg_w": 448.765,
        "energy_mj": 987654321,  # mJ stays mJ
        "temp_gpu_c": 61.0,
        "temp_hbm_c": 52.0,
        "temp_hotspot_c": 70.0,
        "clock_sm_mhz": 1755.0,
        "clock_mem_mhz": 2619.0,
        "throttle_reasons": 0x24,  # sw_power_cap | sw_thermal, NVML's bits unchanged
        "violation_power_ns": 111222333,
        "violation_thermal_ns": 444555,
        "util_gpu_pct": 88.0,
        "util_mem_pct": 33.0,
        "mem_used_bytes": 12884901888,  # v2: excludes the driver's reservation
        "power_limit_w": 650.0,
        "pcie_tx_bytes": 123456789,
        "pcie_rx_bytes": 987654321,
        "nvlink_tx_bytes": 1000 * 1024,  # KiB -> B
        "nvlink_rx_bytes": 2000 * 1024,
        "violation_sync_boost_ns": 1001,  # the stand-in's defaults, ns as NVML keeps them
        "violation_board_limit_ns": 7000,
        "violation_low_util_ns": 1003,
        "violation_reliability_ns": 1004,
        "violation_total_app_clocks_ns": 1005,
        "violation_total_base_clocks_ns": 1006,
        "violation_sw_thermal_ns": 1007,
        "violation_hw_thermal_ns": 1008,
        "violation_hw_power_brake_ns": 8000,
        # each counter's value carries the driver's own timestamp (us), kept as the driver gave it
        **{f"violation_{name}_ts_us": 1700000000123456 for name, _ in VIOLATION_COUNTERS},
    }
    assert len(reading) == len(METRICS)
    assert dict(zip(METRIC_NAMES, reading, strict=True)) == expected
    for metric in METRICS:
        v = value(reading, metric.name)
        assert isinstance(v, float if metric.kind == "float" else int), metric.name
    assert value(reading, "power_avg_w") == pytest.approx(298.765, abs=0)


def test_64bit_counters_survive_exactly(fake_nvml: Any) -> None:
    big = 2**40 + 123457  # far above 2**32: a 32-bit read would wrap
    fake_nvml.script(
        f"""
        0 pcie_tx_bytes {big}
        0 pcie_rx_bytes {2**63 + 5}
        0 nvlink_tx_kib {2**33 + 7}
        0 energy_mj {2**41 + 9}
        0 violation_power_ns {2**50 + 11}
        """
    )
    with nvml.open_backend() as b:
        reading = b.devices[0].read()
    assert value(reading, "pcie_tx_bytes") == big
    assert value(reading, "pcie_rx_bytes") == 2**63 + 5
    assert value(reading, "nvlink_tx_bytes") == (2**33 + 7) * 1024
    assert value(reading, "energy_mj") == 2**41 + 9
    assert value(reading, "violation_power_ns") == 2**50 + 11


def test_value_union_member_follows_value_type(fake_nvml: Any) -> None:
    # the driver says which member of the union it filled: a double, a 32-bit uint, ...
    fake_nvml.script(
        f"""
        0 ftype:{FI_POWER_INSTANT} DOUBLE
        0 power_instant_mw 275500
        0 ftype:197 UINT
        0 pcie_tx_bytes {2**32 + 5}
        0 ftype:{FI_MEMORY_TEMP} USHORT
        0 temp_memory_c 51
        """
    )
    with nvml.open_backend() as b:
        reading = b.devices[0].read()
    assert value(reading, "power_instant_w") == 275.5
    assert value(reading, "pcie_tx_bytes") == 5  # only the low 32 bits are the uint member
    assert value(reading, "temp_hbm_c") == 51.0


def test_nvlink_falls_back_to_summing_links(fake_nvml: Any) -> None:
    fake_nvml.script(
        f"""
        0 field:{FI_NVLINK_TX}:{ALL_LINKS} NOT_SUPPORTED
        0 field:{FI_NVLINK_RX}:{ALL_LINKS} NOT_SUPPORTED
        0 nvlink_links 18
        0 nvlink_tx_kib 1000003
        0 nvlink_rx_kib 17
        """
    )
    with nvml.open_backend() as b:
        dev = b.devices[0]
        fake_nvml.reset_counts()
        reading = dev.read()
        assert fake_nvml.calls("nvmlDeviceGetFieldValues") == 2  # the gauges' batch, the counters'
        assert fake_nvml.field_calls(FI_NVLINK_TX) == 18  # one entry per link, in the counters' batch
        assert value(reading, "nvlink_tx_bytes") == 1000003 * 1024
        assert value(reading, "nvlink_rx_bytes") == 17 * 1024
        assert "links=0,1,2" in dev.identity.extra["metric_sources"]["nvlink_tx_bytes"]


def test_square_wave_energy_is_its_area(fake_nvml: Any) -> None:
    # 100 W and 300 W alternating every 10 ms: 200 W on average, so ~200 J per second
    fake_nvml.script(
        """
        0 power_instant_mw 100000
        0 power_square_mw 300000
        0 power_period_ms 20
        0 energy_update_ms 0
        0 energy_mode dynamic
        """
    )
    with nvml.open_backend() as b:
        dev = b.devices[0]
        e0, t0 = value(dev.read(), "energy_mj"), time.monotonic()
        time.sleep(0.3)
        e1, t1 = value(dev.read(), "energy_mj"), time.monotonic()
    joules = (e1 - e0) / 1000
    # at most one half-period at the wrong power at each end: 2 * 10 ms * 200 W = 4 J
    assert joules == pytest.approx(200.0 * (t1 - t0), abs=4.0 + 0.01 * 200 * (t1 - t0))


# --- unsupported metrics ----------------------------------------------------------------------


def test_not_supported_is_none_logged_once_and_not_called_again(
    fake_nvml: Any, caplog: pytest.LogCaptureFixture
) -> None:
    readings, supported = read_refused(
        fake_nvml,
        caplog,
        """
        0 clocks_event_reasons NOT_SUPPORTED
        0 power_limit_mw NOT_SUPPORTED
        0 temp_memory_c NOT_SUPPORTED
        0 power_memory_mw NOT_SUPPORTED
        """,
        reads=5,
    )
    assert_unavailable_once(
        ("throttle_reasons", "power_limit_w", "temp_hbm_c", "power_memory_w"), readings, supported, caplog
    )
    assert supported["power_instant_w"] is True
    # and the module scope, which the stand-in (as an H100 / H200) does not serve by default
    assert not supported["power_module_w"] and not supported["power_module_avg_w"]
    assert sum(supported.values()) == len(METRICS) - 6
    # skipped after the probe: no call, no field entry
    assert fake_nvml.calls("nvmlDeviceGetCurrentClocksEventReasons") == 0
    assert fake_nvml.calls("nvmlDeviceGetCurrentClocksThrottleReasons") == 0
    assert fake_nvml.calls("nvmlDeviceGetEnforcedPowerLimit") == 0
    assert fake_nvml.field_calls(FI_MEMORY_TEMP) == 0
    assert fake_nvml.field_calls(FI_POWER_INSTANT) == 5  # the GPU scope is still read
    assert all(value(r, "power_instant_w") == 250.0 for r in readings)


def test_reasons_logged_name_the_sources_tried(fake_nvml: Any, caplog: pytest.LogCaptureFixture) -> None:
    fake_nvml.set(0, "power_memory_mw", "NOT_SUPPORTED")
    caplog.set_level(logging.INFO, logger="charllm_nemo.devices")
    with nvml.open_backend():
        pass
    (line,) = [r.getMessage() for r in caplog.records if "power_memory_w" in r.getMessage()]
    assert "NVML_FI_DEV_POWER_INSTANT[scope=0x2]" in line
    assert "NVML_FI_DEV_POWER_AVERAGE[scope=0x2]" in line
    assert "Not Supported" in line


# --- call pattern -----------------------------------------------------------------------------


def test_two_batched_field_calls_per_read(backend: Any, fake_nvml: Any) -> None:
    dev = backend.devices[0]
    fake_nvml.reset_counts()
    n = 7
    for _ in range(n):
        dev.read()
    assert fake_nvml.calls("nvmlDeviceGetFieldValues") == 2 * n  # gauges, then cumulative counters
    # the other sources: one call each per read; utilization feeds two metrics with one call
    for fn in (
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetCurrentClocksEventReasons",
    ):
        assert fake_nvml.calls(fn) == n, fn
    assert fake_nvml.calls("nvmlDeviceGetClockInfo") == 2 * n  # SM and memory
    assert fake_nvml.calls("nvmlDeviceGetTemperatureV") == 2 * n  # GPU and hottest point
    # sources that lost the probe to a preferred one are never called
    for fn in (
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetViolationStatus",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetTemperature",
    ):
        assert fake_nvml.calls(fn) == 0, fn
    for fid in (FI_POWER_INSTANT, FI_POWER_AVERAGE, FI_TOTAL_ENERGY, FI_PERF_POLICY_POWER, 197, 198):
        assert fake_nvml.field_calls(fid) >= n, fid


@pytest.mark.parametrize("how", ["error_code", "missing_symbol"])
def test_clocks_event_reasons_fall_back_to_throttle_reasons(
    fake_nvml: Any, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    newer = "nvmlDeviceGetCurrentClocksEventReasons"
    if how == "error_code":
        fake_nvml.set(0, f"fn:{newer}", "FUNCTION_NOT_FOUND")
    else:  # what pynvml does when libnvidia-ml lacks the symbol (drivers before 535)
        real = pynvml._nvmlGetFunctionPointer

        def lookup(name: str) -> Any:
            if name == newer:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return real(name)

        monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", lookup)
    fake_nvml.set(0, "clocks_event_reasons", 0x84)
    with nvml.open_backend() as b:
        dev = b.devices[0]
        fake_nvml.reset_counts()
        assert value(dev.read(), "throttle_reasons") == 0x84
        assert value(dev.read(), "throttle_reasons") == 0x84
        assert dev.identity.extra["metric_sources"]["throttle_reasons"] == (
            "nvmlDeviceGetCurrentClocksThrottleReasons"
        )
    assert fake_nvml.calls("nvmlDeviceGetCurrentClocksThrottleReasons") == 2
    assert fake_nvml.calls(newer) == 0


@pytest.mark.parametrize(
    ("script", "metric", "source", "expected"),
    [
        (f"0 field:{FI_POWER_AVERAGE}:0 NOT_SUPPORTED", "power_avg_w", "nvmlDeviceGetPowerUsage", 245.0),
        (
            f"0 field:{FI_TOTAL_ENERGY} NOT_SUPPORTED",
            "energy_mj",
            "nvmlDeviceGetTotalEnergyConsumption",
            1_000_000_000,
        ),
        (
            f"0 field:{FI_PERF_POLICY_POWER} NOT_SUPPORTED",
            "violation_power_ns",
            "nvmlDeviceGetViolationStatus(NVML_PERF_POLICY_POWER)",
            123456789,
        ),
        (
            "0 fn:nvmlDeviceGetMemoryInfo_v2 FUNCTION_NOT_FOUND",
            "mem_used_bytes",
            "nvmlDeviceGetMemoryInfo",
            42949672960 + 536870912,  # v1 counts the reservation as used
        ),
        (
            "0 fn:nvmlDeviceGetTemperatureV FUNCTION_NOT_FOUND",
            "temp_gpu_c",
            "nvmlDeviceGetTemperature(sensor=0)",
            55.0,
        ),
        (
            f"0 field:{FI_POWER_INSTANT}:2 NOT_SUPPORTED",
            "power_memory_w",
            "NVML_FI_DEV_POWER_AVERAGE[scope=0x2]",
            40.0,
        ),
    ],
)
def test_fallback_sources(fake_nvml: Any, script: str, metric: str, source: str, expected: Any) -> None:
    fake_nvml.command(script)
    with nvml.open_backend() as b:
        dev = b.devices[0]
        assert dev.identity.extra["metric_sources"][metric] == source
        assert value(dev.read(), metric) == expected


# --- errors while sampling --------------------------------------------------------------------


@pytest.mark.parametrize(
    "trigger",
    [
        "0 lost 1",
        "0 lose_after_calls 0",
        "0 fn:nvmlDeviceGetClockInfo GPU_IS_LOST",
        f"0 field:{FI_POWER_INSTANT} GPU_IS_LOST",
    ],
)
def test_gpu_lost_during_read_raises_device_lost(backend: Any, fake_nvml: Any, trigger: str) -> None:
    dev = backend.devices[0]
    assert value(dev.read(), "power_instant_w") == 250.0
    fake_nvml.command(trigger)
    with pytest.raises(DeviceLost, match="GPU is lost"):
        dev.read()


def test_lose_after_n_calls_in_a_running_loop(backend: Any, fake_nvml: Any) -> None:
    dev = backend.devices[0]
    fake_nvml.set(0, "lose_after_calls", 50)  # ~9 calls per read: lost within a few reads
    reads = 0
    with pytest.raises(DeviceLost):
        for _ in range(100):
            dev.read()
            reads += 1
    assert 1 <= reads < 10


def test_shutdown_underneath_is_device_lost(backend: Any, fake_nvml: Any) -> None:
    dev = backend.devices[0]
    pynvml.nvmlShutdown()  # someone else shut NVML down: NVML_ERROR_UNINITIALIZED
    with pytest.raises(DeviceLost):
        dev.read()


def test_other_errors_make_a_null_sample_logged_once(
    backend: Any, fake_nvml: Any, caplog: pytest.LogCaptureFixture
) -> None:
    dev = backend.devices[0]
    caplog.set_level(logging.INFO, logger="charllm_nemo.devices")
    fake_nvml.set(0, "temp_gpu_c", "UNKNOWN")
    fake_nvml.set(0, f"field:{FI_POWER_INSTANT}:0", "NOT_SUPPORTED")  # NVML does this at high rates
    for _ in range(3):
        r = dev.read()
        assert value(r, "temp_gpu_c") is None
        assert value(r, "power_instant_w") is None
        assert value(r, "power_avg_w") == 245.0  # the rest of the batch is fine
    logged = [rec.getMessage() for rec in caplog.records if "while sampling" in rec.getMessage()]
    assert len(logged) == 2, logged
    # transient: the source is still called and recovers
    fake_nvml.set(0, "temp_gpu_c", 57)
    fake_nvml.set(0, f"field:{FI_POWER_INSTANT}:0", "OK")
    r = dev.read()
    assert value(r, "temp_gpu_c") == 57.0
    assert value(r, "power_instant_w") == 250.0
    assert dev.supported_metrics()["temp_gpu_c"] is True


def test_close_is_idempotent_and_ends_reads(fake_nvml: Any) -> None:
    b = nvml.open_backend()
    dev = b.devices[0]
    assert fake_nvml.refcount == 1
    b.close()
    b.close()
    assert fake_nvml.refcount == 0
    assert fake_nvml.calls("nvmlShutdown") == 1
    with pytest.raises(DeviceLost):
        dev.read()


# --- setup errors -----------------------------------------------------------------------------


def test_bad_index_is_a_config_error(fake_nvml: Any) -> None:
    fake_nvml.set_global("device_count", 2)
    with pytest.raises(ConfigError, match=r"device index 2 .*2 NVIDIA GPU.*0\.\.1"):
        nvml.open_backend([0, 2])
    with pytest.raises(ConfigError, match="-1"):
        nvml.open_backend([-1])
    with pytest.raises(ConfigError, match="twice"):
        nvml.open_backend([1, 1])
    with pytest.raises(ConfigError, match="takes no options"):
        nvml.open_backend(None, count=2)
    assert fake_nvml.refcount == 0  # every failed open shut NVML down again


def test_no_gpu_is_backend_unavailable(fake_nvml: Any) -> None:
    fake_nvml.set_global("device_count", 0)
    with pytest.raises(BackendUnavailable, match="no NVIDIA GPU"):
        nvml.open_backend()
    assert fake_nvml.refcount == 0


def test_driver_not_loaded_is_backend_unavailable(fake_nvml: Any) -> None:
    fake_nvml.set_global("init_error", "DRIVER_NOT_LOADED")
    with pytest.raises(BackendUnavailable, match="not loaded"):
        nvml.open_backend()


def test_lost_at_open_is_backend_unavailable(fake_nvml: Any) -> None:
    fake_nvml.set(0, "lose_after_calls", 0)
    with pytest.raises(BackendUnavailable, match="GPU 0"):
        nvml.open_backend()
    assert fake_nvml.refcount == 0


def test_missing_binding_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with pytest.raises(BackendUnavailable, match=r"pip install 'charllm-nemo\[nvidia\]'"):
        nvml.open_backend()


def test_factory_opens_nvml(fake_nvml: Any) -> None:
    from charllm_nemo.devices import factory

    b = factory.open_backend("nvml")
    try:
        assert b.name == "nvml"
        assert value(b.devices[0].read(), "power_instant_w") == 250.0
    finally:
        b.close()


# --- the dynamic energy counter ---------------------------------------------------------------


def test_dynamic_energy_counter_ticks_at_its_update_period(fake_nvml: Any) -> None:
    # 250 W, published every 50 ms: each visible step is a whole number of 12.5 J ticks
    period_s, tick_mj = 0.05, 250 * 50
    fake_nvml.script(["0 power_instant_mw 250000", "0 energy_update_ms 50", "0 energy_mode dynamic"])
    with nvml.open_backend() as b:
        dev = b.devices[0]
        values = [value(dev.read(), "energy_mj")]
        t_start = time.monotonic()
        changes = 0
        while time.monotonic() - t_start < 3.0 and (changes < 4 or time.monotonic() - t_start < 0.3):
            time.sleep(0.002)
            v = value(dev.read(), "energy_mj")
            if v != values[-1]:
                changes += 1
            values.append(v)
        elapsed = time.monotonic() - t_start
    steps = [b - a for a, b in itertools.pairwise(values) if b != a]
    assert steps, "the counter never moved"
    assert all(step > 0 and step % tick_mj == 0 for step in steps), steps
    # it cannot publish more often than its period, however the reads were scheduled
    assert len(steps) <= elapsed / period_s + 1
    # and what it publishes is the energy: 250 W over the time, within one period each end
    total_j = (values[-1] - values[0]) / 1000
    assert abs(total_j - 250 * elapsed) <= 250 * 2 * period_s + 1e-9


# --- subprocesses: the environment-variable path ----------------------------------------------

CHILD_OPEN = """
    import json
    from charllm_nemo.devices import nvml
    from charllm_nemo.telemetry.schema import METRIC_NAMES
    with nvml.open_backend() as b:
        out = [
            {
                "identity": d.identity.to_dict(),
                "reading": dict(zip(METRIC_NAMES, d.read())),
                "supported": d.supported_metrics(),
            }
            for d in b.devices
        ]
    print(json.dumps(out))
"""


def test_env_var_script_in_a_child_process(fake_nvml_env: Any) -> None:
    env = fake_nvml_env(
        [
            "device_count 2",
            "* call_delay_us 5",
            "0 power_instant_mw 123456",
            "1 temp_gpu_c NOT_SUPPORTED",
            f"1 pcie_tx_bytes {2**45 + 1}",
            "1 name NVIDIA H200",
        ]
    )
    proc = run_child(CHILD_OPEN, env)
    assert proc.returncode == 0, proc.stderr
    devices = json.loads(proc.stdout)
    assert [d["identity"]["index"] for d in devices] == [0, 1]
    assert devices[0]["reading"]["power_instant_w"] == 123.456
    assert devices[1]["identity"]["name"] == "NVIDIA H200"
    assert devices[1]["reading"]["temp_gpu_c"] is None
    assert devices[1]["supported"]["temp_gpu_c"] is False
    assert devices[0]["supported"]["temp_gpu_c"] is True
    assert devices[1]["reading"]["pcie_tx_bytes"] == 2**45 + 1


def test_library_not_loadable_in_a_child_process(fake_nvml_env: Any) -> None:
    env = fake_nvml_env(None)
    env["LD_LIBRARY_PATH"] = ""  # the stand-in is not on the path; no driver on this machine
    code = """
        import ctypes, sys
        try:
            ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            pass
        else:
            print("SKIP: a real libnvidia-ml.so.1 is installed here")
            sys.exit(0)
        from charllm_nemo.devices import nvml
        from charllm_nemo.errors import BackendUnavailable
        try:
            nvml.open_backend()
        except BackendUnavailable as exc:
            print("MESSAGE:", exc)
        else:
            print("OPENED")
    """
    proc = run_child(code, env)
    assert proc.returncode == 0, proc.stderr
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.stdout.startswith("MESSAGE:"), proc.stdout
    assert "no NVIDIA driver found" in proc.stdout
    assert "libnvidia-ml.so.1" in proc.stdout


def test_a_rank_beyond_the_gpus_samples_the_one_it_maps_to_not_all_of_them(
    fake_nvml: Any, tmp_path: Any
) -> None:
    # auto backend, local rank 4 on a host with 3 GPUs and no CUDA_VISIBLE_DEVICES: torch drives
    # GPU 4 % 3 = 1 (train/dist.py); telemetry samples that one, not every GPU (each rank would
    # count all of their energy as its own).
    from charllm_nemo.telemetry.session import TelemetrySession
    from charllm_nemo.telemetry.session_options import Placement, SessionOptions

    fake_nvml.set_global("device_count", 3)
    tel = TelemetrySession(
        tmp_path,
        SessionOptions(backend="auto", sampler="thread"),
        placement=Placement(rank=4, local_rank=4, world_size=5, local_world_size=5),
        handle_signals=False,
    )
    try:
        assert [d.identity.index for d in tel.backend.devices] == [1]
    finally:
        tel.close()


def test_a_rank_samples_the_gpu_its_cuda_visible_devices_uuid_names(
    fake_nvml: Any, tmp_path: Any, monkeypatch: Any, caplog: Any
) -> None:
    # CUDA_VISIBLE_DEVICES by UUID (abbreviated, as CUDA accepts): local rank 1 drives the GPU
    # the second entry names, physically 0 here, not GPU 1.
    from charllm_nemo.telemetry.session import TelemetrySession
    from charllm_nemo.telemetry.session_options import Placement, SessionOptions

    fake_nvml.set_global("device_count", 3)
    fake_nvml.set(0, "uuid", "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-fa4e0000-0000-4000-8000-000000000002,GPU-8932F937")

    runs = iter(range(10))

    def own_device(local_rank: int) -> list[int]:
        tel = TelemetrySession(
            tmp_path / str(next(runs)),
            SessionOptions(backend="nvml", sampler="thread"),
            placement=Placement(local_rank, local_rank, 2, 2),
            handle_signals=False,
        )
        try:
            return [d.identity.index for d in tel.backend.devices]
        finally:
            tel.close()

    assert own_device(0) == [2]
    assert own_device(1) == [0]
    # A MIG instance is not mapped to its GPU: the local rank's device, with a warning naming the fix.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-8932f937-d72c-4106-c12f-20bd9faed9f6,GPU-8932f937")
    with caplog.at_level("WARNING"):
        assert own_device(0) == [0]
    assert "matches no single device UUID" in caplog.text and "MIG" in caplog.text


def test_read_gauges_leaves_every_counter_out(backend: Any, fake_nvml: Any) -> None:
    """read_gauges() is read() without the cumulative metrics: one field batch (no counter field
    in it) and no dedicated call that serves only a counter; the gauges' values are read()'s."""
    dev = backend.devices[0]
    full = dev.read()
    fake_nvml.reset_counts()
    gauges = dev.read_gauges()
    assert fake_nvml.calls("nvmlDeviceGetFieldValues") == 1
    for fid in (FI_TOTAL_ENERGY, FI_PERF_POLICY_POWER, FI_NVLINK_TX, 197, 198):  # 197/198: PCIe bytes
        assert fake_nvml.field_calls(fid) == 0, fid
    for m in METRICS:
        if m.cumulative:
            assert gauges[METRIC_INDEX[m.name]] is None, m.name
            assert full[METRIC_INDEX[m.name]] is not None, m.name
        elif m.name not in ("power_instant_w", "power_memory_w", "util_gpu_pct"):  # these move
            assert gauges[METRIC_INDEX[m.name]] == full[METRIC_INDEX[m.name]], m.name
    assert value(gauges, "power_instant_w") is not None
