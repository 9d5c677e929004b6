"""A stand-in for the ``amdsmi`` Python package: the amdsmi 7.0.2 surface the backend uses.

It mirrors the real package (``amdsmi/amdsmi_interface.py``, ``amdsmi_exception.py``):

* the same function names and argument order, with the real argument checks (a handle that is
  not a processor handle or an ``int`` where an enum is expected raises AmdSmiParameterException);
* the enum classes as IntEnums with the real member names and values (``AmdSmiClkType.GFX``
  is an alias of ``SYS``, ``AmdSmiTemperatureType.JUNCTION`` of ``HOTSPOT``);
* the exception classes: ``AmdSmiLibraryException(code)`` with ``get_error_code()``, and
  ``AmdSmiRetryException`` / ``AmdSmiTimeoutException`` for codes 9 and 8, as ``_check_res`` does;
* the returned dict keys and units (power in W, power cap in µW, energy in ticks of
  ``counter_resolution`` µJ, temperatures in °C, clocks in MHz, VRAM usage in MB, memory usage
  in bytes, XGMI data in KB per link) and the string ``"N/A"`` where 7.0.2 puts it
  (power_info and activity values of 0xFFFF, gpu_metrics all-ones fields; ``throttle_status``
  comes back as a bool, as in 7.0.2);
* calls made after ``amdsmi_shut_down`` raise AMDSMI_STATUS_NOT_INIT, as AMDSMI_CHECK_INIT does.

Each GPU is a scripted :class:`FakeGpu`: change its fields between reads. ``errors`` maps
``"function"`` or ``"function:ARG"`` (ARG an enum member name, e.g.
``"amdsmi_get_temp_metric:EDGE"``) to the status code that call raises; ``lost = True`` makes
every call on it raise ``lost_code``. ``FakeAmdSmi.calls`` counts calls by the same keys.

``install(monkeypatch, gpus)`` puts a fresh module in ``sys.modules["amdsmi"]``;
``install_failing_import`` and ``install_missing_package`` make ``import amdsmi`` fail the way the
real wrapper does without ROCm (KeyError) or when the package is absent (ImportError).
"""

from __future__ import annotations

import copy
import importlib.abc
import importlib.util
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from types import ModuleType
from typing import Any

import pytest

# -- amdsmi_wrapper: status codes (amdsmi_status_t) ------------------------------------------

AMDSMI_STATUS_SUCCESS = 0
AMDSMI_STATUS_INVAL = 1
AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_NOT_YET_IMPLEMENTED = 3
AMDSMI_STATUS_FAIL_LOAD_MODULE = 4
AMDSMI_STATUS_FAIL_LOAD_SYMBOL = 5
AMDSMI_STATUS_DRM_ERROR = 6
AMDSMI_STATUS_API_FAILED = 7
AMDSMI_STATUS_TIMEOUT = 8
AMDSMI_STATUS_RETRY = 9
AMDSMI_STATUS_NO_PERM = 10
AMDSMI_STATUS_INTERRUPT = 11
AMDSMI_STATUS_IO = 12
AMDSMI_STATUS_FILE_ERROR = 14
AMDSMI_STATUS_INIT_ERROR = 18
AMDSMI_STATUS_BUSY = 30
AMDSMI_STATUS_NOT_FOUND = 31
AMDSMI_STATUS_NOT_INIT = 32
AMDSMI_STATUS_DRIVER_NOT_LOADED = 34
AMDSMI_STATUS_NO_DATA = 40
AMDSMI_STATUS_UNEXPECTED_SIZE = 42
AMDSMI_STATUS_UNEXPECTED_DATA = 43
AMDSMI_STATUS_UNKNOWN_ERROR = 0xFFFFFFFF

_STATUS_TEXT = {value: name for name, value in globals().items() if name.startswith("AMDSMI_STATUS_")}

# What the real wrapper prints to stdout before raising KeyError('libamd_smi.so').
NO_ROCM_PRINTOUT = (
    "/opt/rocm/lib/libamd_smi.so: cannot open shared object file: No such file or directory\n"
    "Unable to find libamd_smi.so library try installing amd-smi-lib from your package manager"
)

# -- amdsmi_exception ------------------------------------------------------------------------


class AmdSmiException(Exception):
    """Base smi exception class"""


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int) -> None:
        err_code = abs(err_code)
        super().__init__(err_code)
        self.err_code = err_code
        self.err_info = _STATUS_TEXT.get(err_code, "AMDSMI_STATUS_UNKNOWN_ERROR")

    def __str__(self) -> str:
        return f"Error code:\n\t{self.err_code} | {self.err_info}"

    def get_error_info(self, detailed: bool = True) -> str:
        return self.err_info

    def get_error_code(self) -> int:
        return self.err_code


class AmdSmiRetryException(AmdSmiLibraryException):
    def __init__(self) -> None:
        super().__init__(AMDSMI_STATUS_RETRY)


class AmdSmiTimeoutException(AmdSmiLibraryException):
    def __init__(self) -> None:
        super().__init__(AMDSMI_STATUS_TIMEOUT)


class AmdSmiParameterException(AmdSmiException):
    def __init__(self, receivedValue: Any, expectedType: Any, msg: str | None = None) -> None:
        super().__init__(msg)
        self.err_code = None
        self.actualType = type(receivedValue)
        self.expectedType = expectedType
        self.err_msg = msg or (
            f"Invalid parameter:\nActual type: {self.actualType}\nExpected type: {expectedType}"
        )

    def __str__(self) -> str:
        return self.err_msg


class AmdSmiKeyException(AmdSmiException):
    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key

    def __str__(self) -> str:
        return "Key " + self.key + " is missing from dictionary"


def _raise(code: int) -> None:
    if code == AMDSMI_STATUS_RETRY:
        raise AmdSmiRetryException()
    if code == AMDSMI_STATUS_TIMEOUT:
        raise AmdSmiTimeoutException()
    raise AmdSmiLibraryException(code)


# -- amdsmi_interface enums (the members the backend uses, real names and values) ------------


class AmdSmiInitFlags(IntEnum):
    INIT_ALL_PROCESSORS = 0xFFFFFFFF
    INIT_AMD_CPUS = 1
    INIT_AMD_GPUS = 2
    INIT_AMD_APUS = 3
    INIT_NON_AMD_CPUS = 4
    INIT_NON_AMD_GPUS = 8


class AmdSmiProcessorType(IntEnum):
    UNKNOWN = 0
    AMDSMI_PROCESSOR_TYPE_AMD_GPU = 1
    AMDSMI_PROCESSOR_TYPE_AMD_CPU = 2
    AMDSMI_PROCESSOR_TYPE_NON_AMD_GPU = 3
    AMDSMI_PROCESSOR_TYPE_NON_AMD_CPU = 4


class AmdSmiClkType(IntEnum):
    SYS = 0
    GFX = 0
    DF = 1
    DCEF = 2
    SOC = 3
    MEM = 4
    PCIE = 5
    VCLK0 = 6
    VCLK1 = 7
    DCLK0 = 8
    DCLK1 = 9


class AmdSmiTemperatureType(IntEnum):
    EDGE = 0
    HOTSPOT = 1
    JUNCTION = 1
    VRAM = 2
    HBM_0 = 3
    HBM_1 = 4
    HBM_2 = 5
    HBM_3 = 6
    PLX = 7


class AmdSmiTemperatureMetric(IntEnum):
    CURRENT = 0
    MAX = 1
    MIN = 2
    MAX_HYST = 3
    MIN_HYST = 4
    CRITICAL = 5
    CRITICAL_HYST = 6
    EMERGENCY = 7
    EMERGENCY_HYST = 8
    CRIT_MIN = 9
    CRIT_MIN_HYST = 10
    OFFSET = 11
    LOWEST = 12
    HIGHEST = 13


class AmdSmiMemoryType(IntEnum):
    VRAM = 0
    VIS_VRAM = 1
    GTT = 2


ENUMS = (
    AmdSmiInitFlags,
    AmdSmiProcessorType,
    AmdSmiClkType,
    AmdSmiTemperatureType,
    AmdSmiTemperatureMetric,
    AmdSmiMemoryType,
)
EXCEPTIONS = (
    AmdSmiException,
    AmdSmiLibraryException,
    AmdSmiRetryException,
    AmdSmiTimeoutException,
    AmdSmiParameterException,
    AmdSmiKeyException,
)

# Every key amdsmi 7.0.2's amdsmi_get_gpu_metrics_info returns (see _NA_amdsmi_get_gpu_metrics_info).
GPU_METRICS_KEYS: tuple[str, ...] = (
    "common_header.structure_size", "common_header.format_revision", "common_header.content_revision",
    "temperature_edge", "temperature_hotspot", "temperature_mem", "temperature_vrgfx",
    "temperature_vrsoc", "temperature_vrmem", "average_gfx_activity", "average_umc_activity",
    "average_mm_activity", "average_socket_power", "energy_accumulator", "system_clock_counter",
    "average_gfxclk_frequency", "average_socclk_frequency", "average_uclk_frequency",
    "average_vclk0_frequency", "average_dclk0_frequency", "average_vclk1_frequency",
    "average_dclk1_frequency", "current_gfxclk", "current_socclk", "current_uclk", "current_vclk0",
    "current_dclk0", "current_vclk1", "current_dclk1", "throttle_status", "current_fan_speed",
    "pcie_link_width", "pcie_link_speed", "gfx_activity_acc", "mem_activity_acc", "temperature_hbm",
    "firmware_timestamp", "voltage_soc", "voltage_gfx", "voltage_mem", "indep_throttle_status",
    "current_socket_power", "vcn_activity", "gfxclk_lock_status", "xgmi_link_width",
    "xgmi_link_speed", "pcie_bandwidth_acc", "pcie_bandwidth_inst", "pcie_l0_to_recov_count_acc",
    "pcie_replay_count_acc", "pcie_replay_rover_count_acc", "xgmi_read_data_acc",
    "xgmi_write_data_acc", "current_gfxclks", "current_socclks", "current_vclk0s", "current_dclk0s",
    "jpeg_activity", "pcie_nak_sent_count_acc", "pcie_nak_rcvd_count_acc", "accumulation_counter",
    "prochot_residency_acc", "ppt_residency_acc", "socket_thm_residency_acc", "vr_thm_residency_acc",
    "hbm_thm_residency_acc", "num_partition", "xcp_stats.gfx_busy_inst", "xcp_stats.jpeg_busy",
    "xcp_stats.vcn_busy", "xcp_stats.gfx_busy_acc", "xcp_stats.gfx_below_host_limit_acc",
    "xcp_stats.gfx_below_host_limit_ppt_acc", "xcp_stats.gfx_below_host_limit_thm_acc",
    "xcp_stats.gfx_low_utilization_acc", "xcp_stats.gfx_below_host_limit_total_acc",
    "pcie_lc_perf_other_end_recovery", "vram_max_bandwidth", "xgmi_link_status",
)  # fmt: skip

NA = "N/A"


def _names(member: IntEnum) -> list[str]:
    return [name for name, m in type(member).__members__.items() if m is member]


def _lookup(table: dict[str, Any], member: IntEnum) -> Any:
    for name in _names(member):
        if name in table:
            return table[name]
    _raise(AMDSMI_STATUS_NOT_SUPPORTED)


class FakeProcessorHandle:
    """Opaque, like amdsmi_wrapper.amdsmi_processor_handle (a ctypes void pointer)."""

    def __init__(self, slot: int) -> None:
        self.slot = slot

    def __repr__(self) -> str:
        return f"<amdsmi_processor_handle {self.slot}>"


def _clk(clk: int | str, lo: int, hi: int) -> dict[str, Any]:
    return {"clk": clk, "min_clk": lo, "max_clk": hi, "clk_locked": False, "clk_deep_sleep": 0}


@dataclass
class FakeGpu:
    """One scripted GPU (one die). Values are in amdsmi's own units; edit them between reads."""

    market_name: str = "AMD Instinct MI300X"
    uuid: str = "81ff74a1-0000-1000-8089-a3c2b3e12f00"
    bdf: str = "0000:05:00.0"
    driver_version: str = "6.12.12"
    product_serial: str = "692424000100"
    asic_serial: str = "0x1F5E31A2C0D4E900"
    gfx_target: str = "gfx942"
    compute_units: int | str = 304
    oam_id: int | str = 0
    hip_id: int = 0
    drm_card: int = 0
    drm_render: int = 128
    vram_total_bytes: int = 192 * 2**30
    compute_partition: str = "SPX"
    xgmi_hive_id: int = 0x2A3B4C5D6E7F8091
    xgmi_node_id: int = 0
    # amdsmi_get_power_info: W (0xFFFF -> "N/A")
    power: dict[str, Any] = field(
        default_factory=lambda: {
            "socket_power": 550,
            "current_socket_power": 550,
            "average_socket_power": NA,
            "gfx_voltage": 806,
            "soc_voltage": 900,
            "mem_voltage": 1100,
            "power_limit": 750,
        }
    )
    # amdsmi_get_power_cap_info: µW (dpm_cap in MHz)
    power_cap: dict[str, Any] = field(
        default_factory=lambda: {
            "power_cap": 750_000_000,
            "default_power_cap": 750_000_000,
            "dpm_cap": 2100,
            "min_power_cap": 0,
            "max_power_cap": 750_000_000,
        }
    )
    energy_accumulator: int = 3_000_000_000  # ticks
    counter_resolution: float = 15.2587890625  # µJ per tick (1e6 / 65536)
    temps: dict[str, int] = field(default_factory=lambda: {"HOTSPOT": 62, "VRAM": 48})  # °C
    clocks: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {"GFX": _clk(2100, 500, 2100), "MEM": _clk(1300, 900, 1300)}
    )
    activity: dict[str, Any] = field(
        default_factory=lambda: {"gfx_activity": 97, "umc_activity": 41, "mm_activity": NA}
    )
    vram_used_bytes: int = 150 * 2**30
    gpu_metrics: dict[str, Any] = field(default_factory=dict)  # over the values derived below
    errors: dict[str, int] = field(default_factory=dict)
    lost: bool = False
    lost_code: int = AMDSMI_STATUS_NOT_FOUND


def mi300x(index: int = 0, **changes: Any) -> FakeGpu:
    """An MI300X in SPX mode: current (not average) socket power, no edge sensor, gpu_metrics v1.6
    with XGMI counters and residency accumulators."""
    gpu = FakeGpu(
        uuid=f"81ff74a1-0000-1000-8089-a3c2b3e12f{index:02x}",
        bdf=f"0000:{0x05 + 0x20 * index:02x}:00.0",
        product_serial=f"6924240001{index:02d}",
        asic_serial=f"0x1F5E31A2C0D4E9{index:02X}",
        oam_id=index,
        hip_id=index,
        drm_card=index,
        drm_render=128 + index,
        xgmi_node_id=index,
        gpu_metrics={
            "common_header.format_revision": 1,
            "common_header.content_revision": 6,
            "current_gfxclk": NA,  # MI300X reports per-XCC clocks in current_gfxclks
            "current_gfxclks": [2100] * 8,
            "xgmi_read_data_acc": [4_000_000, 3_000_000, 2_000_000, 1_000_000, 0, 0, 0, NA],
            "xgmi_write_data_acc": [1_000_000, 1_000_000, 1_000_000, 1_000_000, 0, 0, 0, NA],
            "accumulation_counter": 1_000_000,
            "prochot_residency_acc": 0,
            "ppt_residency_acc": 200_000,
            "socket_thm_residency_acc": 10_000,
            "vr_thm_residency_acc": 0,
            "hbm_thm_residency_acc": 0,
            "system_clock_counter": 5_000_000_000_000,
            "firmware_timestamp": 500_000_000_000,
            "pcie_bandwidth_acc": 123_456,
            "throttle_status": False,
            "indep_throttle_status": False,
        },
    )
    for name, value in changes.items():
        setattr(gpu, name, value)
    return gpu


def mi250_package(
    package: int = 0, secondary_power: int | str = NA, secondary_energy: int = 0
) -> list[FakeGpu]:
    """The two dies (GCDs) of one MI250X: die 0 reports the package's average socket power and
    energy, die 1 reports ``secondary_power`` ("N/A" or 0) and ``secondary_energy`` ticks.
    gpu_metrics v1.3: no current socket power, no XGMI counters, no residency accumulators."""
    dies = []
    for die in range(2):
        index = 2 * package + die
        primary = die == 0
        power = {
            "socket_power": 290 if primary else secondary_power,
            "current_socket_power": NA,
            "average_socket_power": 290 if primary else secondary_power,
            "gfx_voltage": 850,
            "soc_voltage": 900,
            "mem_voltage": 1200,
            "power_limit": 560 if primary else NA,
        }
        cap = 560_000_000 if primary else 0
        dies.append(
            FakeGpu(
                market_name="AMD Instinct MI250X",
                uuid=f"a4ff740c-0000-1000-80ea-6d0a1b2c3d{index:02x}",
                bdf=f"0000:{0xC1 + 0x08 * index:02x}:00.0",
                product_serial=f"PCB0469820{package:03d}",  # one board FRU, both dies
                asic_serial=f"0x2A1B3C4D5E6F70{index:02X}",
                gfx_target="gfx90a",
                compute_units=110,
                oam_id=NA,
                hip_id=index,
                drm_card=index,
                drm_render=128 + index,
                vram_total_bytes=64 * 2**30,
                compute_partition=NA,
                xgmi_node_id=index,
                power=power,
                power_cap={
                    "power_cap": cap,
                    "default_power_cap": cap,
                    "dpm_cap": 1700,
                    "min_power_cap": 0,
                    "max_power_cap": cap,
                },
                energy_accumulator=9_000_000_000 if primary else secondary_energy,
                temps={"EDGE": 38 + die, "HOTSPOT": 45 + die, "VRAM": 50 + die},
                clocks={"GFX": _clk(1700, 500, 1700), "MEM": _clk(1600, 400, 1600)},
                activity={"gfx_activity": 88, "umc_activity": 33, "mm_activity": 0},
                vram_used_bytes=40 * 2**30,
                gpu_metrics={
                    "common_header.format_revision": 1,
                    "common_header.content_revision": 3,
                    "throttle_status": False,  # a bool in 7.0.2: the bits do not reach Python
                },
            )
        )
    return dies


class FakeAmdSmi:
    """The scripted library behind one fake ``amdsmi`` module."""

    def __init__(self, gpus: Sequence[FakeGpu]) -> None:
        self.gpus = list(gpus)
        self.handles = [FakeProcessorHandle(i) for i in range(len(self.gpus))]
        self.initialized = False
        self.init_flags: list[AmdSmiInitFlags] = []
        self.init_error: int | None = None  # status code amdsmi_init raises
        self.shut_down_calls = 0
        self.calls: Counter[str] = Counter()

    # -- plumbing

    def module(self) -> ModuleType:
        mod = ModuleType("amdsmi")
        mod.__version__ = "7.0.2"  # type: ignore[attr-defined]
        for name in dir(self):
            if name.startswith("amdsmi_"):
                setattr(mod, name, getattr(self, name))
        for obj in (*ENUMS, *EXCEPTIONS):
            setattr(mod, obj.__name__, obj)
        wrapper = ModuleType("amdsmi.amdsmi_wrapper")
        for name, value in globals().items():
            if name.startswith("AMDSMI_STATUS_"):
                setattr(wrapper, name, value)
        mod.amdsmi_wrapper = wrapper  # type: ignore[attr-defined]
        mod.fake = self  # type: ignore[attr-defined]
        return mod

    def _check_init(self) -> None:
        if not self.initialized:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_INIT)

    def _gpu(self, h: Any, fn: str, arg: IntEnum | None = None) -> FakeGpu:
        if not isinstance(h, FakeProcessorHandle):
            raise AmdSmiParameterException(h, FakeProcessorHandle)
        self._check_init()
        # An aliased member (AmdSmiClkType.GFX is SYS) answers to every name it has.
        keys = [f"{fn}:{name}" for name in _names(arg)] if arg is not None else []
        self.calls[fn] += 1
        for key in keys:
            self.calls[key] += 1
        gpu = self.gpus[h.slot]
        if gpu.lost:
            _raise(gpu.lost_code)
        for key in (*keys, fn):
            if key in gpu.errors:
                _raise(gpu.errors[key])
        return gpu

    @staticmethod
    def _enum(value: Any, cls: type[IntEnum]) -> None:
        if not isinstance(value, cls):
            raise AmdSmiParameterException(value, cls)

    # -- library

    def amdsmi_init(self, flag: AmdSmiInitFlags = AmdSmiInitFlags.INIT_AMD_GPUS) -> None:
        self._enum(flag, AmdSmiInitFlags)
        self.calls["amdsmi_init"] += 1
        if self.init_error is not None:
            _raise(self.init_error)
        self.init_flags.append(flag)
        self.initialized = True

    def amdsmi_shut_down(self) -> None:
        self.calls["amdsmi_shut_down"] += 1
        self._check_init()
        self.shut_down_calls += 1
        self.initialized = False

    def amdsmi_get_lib_version(self) -> dict[str, Any]:
        return {"major": 25, "minor": 5, "release": 1, "build": "fake"}

    def amdsmi_get_processor_handles(self) -> list[FakeProcessorHandle]:
        self._check_init()
        return list(self.handles)

    def amdsmi_get_processor_type(self, processor_handle: Any) -> dict[str, Any]:
        self._gpu(processor_handle, "amdsmi_get_processor_type")
        return {"processor_type": AmdSmiProcessorType.AMDSMI_PROCESSOR_TYPE_AMD_GPU.name}

    # -- identity

    def amdsmi_get_gpu_device_bdf(self, processor_handle: Any) -> str:
        return self._gpu(processor_handle, "amdsmi_get_gpu_device_bdf").bdf

    def amdsmi_get_gpu_device_uuid(self, processor_handle: Any) -> str:
        return self._gpu(processor_handle, "amdsmi_get_gpu_device_uuid").uuid

    def amdsmi_get_gpu_enumeration_info(self, processor_handle: Any) -> dict[str, Any]:
        g = self._gpu(processor_handle, "amdsmi_get_gpu_enumeration_info")
        return {
            "drm_render": g.drm_render,
            "drm_card": g.drm_card,
            "hsa_id": g.hip_id + 1,
            "hip_id": g.hip_id,
            "hip_uuid": f"GPU-{g.uuid[:16]}",
        }

    def amdsmi_get_gpu_asic_info(self, processor_handle: Any) -> dict[str, Any]:
        g = self._gpu(processor_handle, "amdsmi_get_gpu_asic_info")
        return {
            "market_name": g.market_name or NA,
            "vendor_id": "0x1002",
            "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
            "subvendor_id": "0x1002",
            "device_id": "0x74a1" if g.gfx_target == "gfx942" else "0x740c",
            "rev_id": "0x00",
            "asic_serial": g.asic_serial,
            "oam_id": g.oam_id,
            "num_compute_units": g.compute_units,
            "target_graphics_version": g.gfx_target,
            "subsystem_id": "0x74a1",
        }

    def amdsmi_get_gpu_board_info(self, processor_handle: Any) -> dict[str, Any]:
        g = self._gpu(processor_handle, "amdsmi_get_gpu_board_info")
        return {
            "model_number": "102-G30211-00",
            "product_serial": g.product_serial or NA,
            "fru_id": NA,
            "product_name": g.market_name or NA,
            "manufacturer_name": "AMD",
        }

    def amdsmi_get_gpu_driver_info(self, processor_handle: Any) -> dict[str, Any]:
        g = self._gpu(processor_handle, "amdsmi_get_gpu_driver_info")
        return {"driver_name": "amdgpu", "driver_version": g.driver_version or NA, "driver_date": NA}

    def amdsmi_get_xgmi_info(self, processor_handle: Any) -> dict[str, Any]:
        g = self._gpu(processor_handle, "amdsmi_get_xgmi_info")
        return {"xgmi_lanes": 16, "xgmi_hive_id": g.xgmi_hive_id, "xgmi_node_id": g.xgmi_node_id, "index": 0}

    def amdsmi_get_gpu_compute_partition(self, processor_handle: Any) -> str:
        return self._gpu(processor_handle, "amdsmi_get_gpu_compute_partition").compute_partition

    def amdsmi_get_gpu_memory_total(self, processor_handle: Any, mem_type: AmdSmiMemoryType) -> int:
        self._enum(mem_type, AmdSmiMemoryType)
        return self._gpu(processor_handle, "amdsmi_get_gpu_memory_total", mem_type).vram_total_bytes

    # -- monitoring

    def amdsmi_get_power_info(self, processor_handle: Any) -> dict[str, Any]:
        return dict(self._gpu(processor_handle, "amdsmi_get_power_info").power)

    def amdsmi_get_power_cap_info(self, processor_handle: Any) -> dict[str, Any]:
        return dict(self._gpu(processor_handle, "amdsmi_get_power_cap_info").power_cap)

    def amdsmi_get_energy_count(self, processor_handle: Any) -> dict[str, Any]:
        g = self._gpu(processor_handle, "amdsmi_get_energy_count")
        return {
            "energy_accumulator": g.energy_accumulator,
            "counter_resolution": g.counter_resolution,
            "timestamp": 1_700_000_000_000_000_000,
        }

    def amdsmi_get_temp_metric(
        self, processor_handle: Any, sensor_type: AmdSmiTemperatureType, metric: AmdSmiTemperatureMetric
    ) -> int:
        self._enum(sensor_type, AmdSmiTemperatureType)
        self._enum(metric, AmdSmiTemperatureMetric)
        g = self._gpu(processor_handle, "amdsmi_get_temp_metric", sensor_type)
        if metric != AmdSmiTemperatureMetric.CURRENT:
            _raise(AMDSMI_STATUS_NOT_SUPPORTED)
        temp: int = _lookup(g.temps, sensor_type)
        return temp

    def amdsmi_get_clock_info(self, processor_handle: Any, clock_type: AmdSmiClkType) -> dict[str, Any]:
        self._enum(clock_type, AmdSmiClkType)
        g = self._gpu(processor_handle, "amdsmi_get_clock_info", clock_type)
        return dict(_lookup(g.clocks, clock_type))

    def amdsmi_get_gpu_activity(self, processor_handle: Any) -> dict[str, Any]:
        return dict(self._gpu(processor_handle, "amdsmi_get_gpu_activity").activity)

    def amdsmi_get_gpu_memory_usage(self, processor_handle: Any, mem_type: AmdSmiMemoryType) -> int:
        self._enum(mem_type, AmdSmiMemoryType)
        g = self._gpu(processor_handle, "amdsmi_get_gpu_memory_usage", mem_type)
        if mem_type != AmdSmiMemoryType.VRAM:
            _raise(AMDSMI_STATUS_NOT_SUPPORTED)
        return g.vram_used_bytes

    def amdsmi_get_gpu_vram_usage(self, processor_handle: Any) -> dict[str, Any]:
        g = self._gpu(processor_handle, "amdsmi_get_gpu_vram_usage")
        return {"vram_total": g.vram_total_bytes // 2**20, "vram_used": g.vram_used_bytes // 2**20}

    def amdsmi_get_gpu_metrics_info(self, processor_handle: Any) -> dict[str, Any]:
        g = self._gpu(processor_handle, "amdsmi_get_gpu_metrics_info")
        m: dict[str, Any] = dict.fromkeys(GPU_METRICS_KEYS, NA)
        m.update(
            {
                "temperature_edge": g.temps.get("EDGE", NA),
                "temperature_hotspot": g.temps.get("HOTSPOT", NA),
                "temperature_mem": g.temps.get("VRAM", NA),
                "average_gfx_activity": g.activity.get("gfx_activity", NA),
                "average_umc_activity": g.activity.get("umc_activity", NA),
                "average_socket_power": g.power.get("average_socket_power", NA),
                "current_socket_power": g.power.get("current_socket_power", NA),
                "energy_accumulator": g.energy_accumulator,
                "current_gfxclk": g.clocks.get("GFX", {}).get("clk", NA),
                "current_uclk": g.clocks.get("MEM", {}).get("clk", NA),
                "xgmi_read_data_acc": [NA] * 8,
                "xgmi_write_data_acc": [NA] * 8,
            }
        )
        m.update(copy.deepcopy(g.gpu_metrics))
        return m  # a fresh dict per call, as the real wrapper builds one

    def amdsmi_get_violation_status(self, processor_handle: Any) -> dict[str, Any]:
        # The real one sleeps 100 ms between two gpu_metrics reads; the backend must not call it.
        self._gpu(processor_handle, "amdsmi_get_violation_status")
        _raise(AMDSMI_STATUS_NOT_SUPPORTED)
        return {}


def install(monkeypatch: pytest.MonkeyPatch, gpus: Sequence[FakeGpu]) -> FakeAmdSmi:
    """Make ``import amdsmi`` return a fake module scripted by the returned FakeAmdSmi."""
    fake = FakeAmdSmi(gpus)
    mod = fake.module()
    monkeypatch.setitem(sys.modules, "amdsmi", mod)
    monkeypatch.setitem(sys.modules, "amdsmi.amdsmi_wrapper", mod.amdsmi_wrapper)
    return fake


class _FailingLoader(importlib.abc.Loader):
    def __init__(self, exc: BaseException, printout: str) -> None:
        self.exc = exc
        self.printout = printout

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        if self.printout:
            print(self.printout)
        raise self.exc


class FailingImportFinder(importlib.abc.MetaPathFinder):
    """Finds ``amdsmi`` first and fails while executing it, as the real wrapper does."""

    def __init__(self, exc: BaseException, printout: str = "", missing: bool = False) -> None:
        self.loader = _FailingLoader(exc, printout)
        self.missing = missing

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "amdsmi" and not fullname.startswith("amdsmi."):
            return None
        if self.missing:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return importlib.util.spec_from_loader(fullname, self.loader)


def _forget_amdsmi(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name == "amdsmi" or name.startswith("amdsmi."):
            monkeypatch.delitem(sys.modules, name)


def install_failing_import(
    monkeypatch: pytest.MonkeyPatch,
    exc: BaseException | None = None,
    printout: str = NO_ROCM_PRINTOUT,
) -> None:
    """``import amdsmi`` prints what the wrapper prints without ROCm and raises ``exc``
    (default KeyError('libamd_smi.so'), what amdsmi 7.0.2 raises)."""
    _forget_amdsmi(monkeypatch)
    finder = FailingImportFinder(exc if exc is not None else KeyError("libamd_smi.so"), printout)
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])


def install_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import amdsmi`` raises ModuleNotFoundError, as when the package is not installed."""
    _forget_amdsmi(monkeypatch)
    finder = FailingImportFinder(ImportError(), missing=True)
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
