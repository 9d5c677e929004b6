"""Where each NVML metric can come from, and the slice of the NVML C ABI the backend calls.

:func:`candidate_sources` is the table: for every schema metric, the NVML sources that can serve
it, best first (a field of the batched ``nvmlDeviceGetFieldValues`` call, or a dedicated call
with its output buffer allocated here, once). :class:`FieldBatch` is that batched call over a
prebuilt ``nvmlFieldValue_t`` array. :mod:`charllm_nemo.devices.nvml` probes the sources,
builds the sampling plan from the ones that answer and reads through it.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# nvml.h values, used when the installed binding predates a name. Field ids below 251 have been
# stable across NVML releases; the driver, not the binding, decides whether a field works.
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
LOST_CODES = frozenset({NVML_ERROR_UNINITIALIZED, NVML_ERROR_GPU_IS_LOST})

_FIELD_DEFAULTS: dict[str, int] = {
    "NVML_FI_DEV_PERF_POLICY_POWER": 74,  # ns clocks were held down by the power policy
    "NVML_FI_DEV_PERF_POLICY_THERMAL": 75,  # ns clocks were held down by the thermal policy
    "NVML_FI_DEV_PERF_POLICY_SYNC_BOOST": 76,  # ns, and the same for each policy below
    "NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT": 77,
    "NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION": 78,
    "NVML_FI_DEV_PERF_POLICY_RELIABILITY": 79,
    "NVML_FI_DEV_PERF_POLICY_TOTAL_APP_CLOCKS": 80,
    "NVML_FI_DEV_PERF_POLICY_TOTAL_BASE_CLOCKS": 81,
    "NVML_FI_DEV_MEMORY_TEMP": 82,  # degC
    "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 83,  # mJ since driver load
    "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX": 138,  # KiB; scopeId = link id or UINT_MAX = all links
    "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX": 139,
    "NVML_FI_DEV_POWER_AVERAGE": 185,  # mW, 1 s average (Ampere+ except GA100)
    "NVML_FI_DEV_POWER_INSTANT": 186,  # mW
    "NVML_FI_DEV_PCIE_COUNT_TX_BYTES": 197,  # B
    "NVML_FI_DEV_PCIE_COUNT_RX_BYTES": 198,
    # Newer clock-event reason counters (ns; nvidia-ml-py 12.570+ names them): the driver decides.
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN": 269,
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN": 270,
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN": 271,
}

# Per-reason violation counters: metric -> (field name, NVML_PERF_POLICY_* of the older
# nvmlDeviceGetViolationStatus call, or None where the driver has no such policy).
VIOLATION_SOURCES: dict[str, tuple[str, tuple[str, int] | None]] = {
    "power": ("NVML_FI_DEV_PERF_POLICY_POWER", ("NVML_PERF_POLICY_POWER", 0)),
    "thermal": ("NVML_FI_DEV_PERF_POLICY_THERMAL", ("NVML_PERF_POLICY_THERMAL", 1)),
    "sync_boost": ("NVML_FI_DEV_PERF_POLICY_SYNC_BOOST", ("NVML_PERF_POLICY_SYNC_BOOST", 2)),
    "board_limit": ("NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT", ("NVML_PERF_POLICY_BOARD_LIMIT", 3)),
    "low_util": ("NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION", ("NVML_PERF_POLICY_LOW_UTILIZATION", 4)),
    "reliability": ("NVML_FI_DEV_PERF_POLICY_RELIABILITY", ("NVML_PERF_POLICY_RELIABILITY", 5)),
    "total_app_clocks": (
        "NVML_FI_DEV_PERF_POLICY_TOTAL_APP_CLOCKS",
        ("NVML_PERF_POLICY_TOTAL_APP_CLOCKS", 10),
    ),
    "total_base_clocks": (
        "NVML_FI_DEV_PERF_POLICY_TOTAL_BASE_CLOCKS",
        ("NVML_PERF_POLICY_TOTAL_BASE_CLOCKS", 11),
    ),
    "sw_thermal": ("NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN", None),
    "hw_thermal": ("NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN", None),
    "hw_power_brake": ("NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN", None),
}
_POWER_SCOPE_GPU = 0  # nvml.h nvmlPowerScopeType_t: the GPU alone
_POWER_SCOPE_MODULE = 1  # the whole module: GPU + Grace CPU + memory (GH200 / GB200); else NOT_SUPPORTED
_POWER_SCOPE_MEMORY = 2  # the GPU's memory
_SCOPE_ALL_LINKS = 0xFFFFFFFF  # nvml.h: "A scopeId of UINT_MAX returns aggregate value"
NVLINK_MAX_LINKS = 18  # only if the binding does not say (nvidia-ml-py 13 says 36)

_TEMPERATURE_GPU = 0
_TEMPERATURE_GPU_MAX = 1  # NVML 13: "the hottest part of the GPU"; older drivers reject it
CLOCK_SM = 1
CLOCK_MEM = 2
_TEMPERATURE_V1 = 0x0100000C  # sizeof(nvmlTemperature_t) | 1 << 24
_MEMORY_V2 = 0x02000028  # sizeof(nvmlMemory_v2_t) | 2 << 24

# nvmlFieldValue_t: fieldId u32, scopeId u32, timestamp i64, latencyUsec i64, valueType u32,
# nvmlReturn u32, value (8-byte union): 40 bytes. A read unpacks (timestamp, valueType,
# nvmlReturn, the 8 value bytes as u64) for every field in one struct call: FIELD_STRIDE items
# per field, at these offsets.
_FIELD_VALUE_SIZE = 40
_FIELD_VALUE_READ = "8xq8xIIQ"
FIELD_STRIDE = 4
FIELD_TS, FIELD_VT, FIELD_RC, FIELD_VALUE = range(FIELD_STRIDE)
VT_DOUBLE, VT_UINT, VT_ULONG, VT_ULL, VT_SLL, VT_SINT, VT_USHORT = range(7)


class _TemperatureV1(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("sensorType", ctypes.c_int), ("temperature", ctypes.c_int)]


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _MemoryV2(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint),
        ("total", ctypes.c_ulonglong),
        ("reserved", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


class _ViolationTime(ctypes.Structure):
    _fields_ = [("referenceTime", ctypes.c_ulonglong), ("violationTime", ctypes.c_ulonglong)]


def decode(value_type: int, raw: int) -> int | float | None:
    """The value union's member named by ``valueType``, from its 8 bytes read as a u64."""
    if value_type in (VT_ULL, VT_ULONG):  # unsigned long is 64-bit on Linux
        return raw
    if value_type == VT_UINT:
        return raw & 0xFFFFFFFF
    if value_type == VT_DOUBLE:
        return float(struct.unpack("<d", struct.pack("<Q", raw))[0])
    if value_type == VT_SLL:
        return raw - (1 << 64) if raw >> 63 else raw
    if value_type == VT_SINT:
        low = raw & 0xFFFFFFFF
        return low - (1 << 32) if low >> 31 else low
    if value_type == VT_USHORT:
        return raw & 0xFFFF
    return None


# --- metric sources ---------------------------------------------------------------------------


@dataclass
class FieldSource:
    """One metric from one or more (fieldId, scopeId) entries of the batch, summed; with
    ``timestamp`` the metric is the (single) entry's own timestamp (us since the epoch) instead."""

    label: str
    entries: list[tuple[int, int]]
    is_float: bool = False
    factor: float = 1  # float metrics: value / factor; int metrics: value * factor
    timestamp: bool = False


@dataclass
class CallSource:
    """One NVML call filling ``obj``; sources with the same label are one call (utilization)."""

    label: str
    fn_name: str
    args: tuple[Any, ...]
    obj: Any
    attr: str = "value"
    is_float: bool = False
    factor: float = 1


Source = FieldSource | CallSource


def candidate_sources(p: Any, handle: Any) -> dict[str, list[Source]]:
    """Candidate sources of every metric, best first. Buffers are created here, once."""

    def fid(name: str) -> int:
        return int(getattr(p, name, _FIELD_DEFAULTS[name]))

    scope_memory = int(getattr(p, "NVML_POWER_SCOPE_MEMORY", _POWER_SCOPE_MEMORY))
    scope_gpu = int(getattr(p, "NVML_POWER_SCOPE_GPU", _POWER_SCOPE_GPU))
    scope_module = int(getattr(p, "NVML_POWER_SCOPE_MODULE", _POWER_SCOPE_MODULE))

    def field(name: str, scope: int = 0, is_float: bool = False, factor: float = 1) -> FieldSource:
        label = name if scope == 0 else f"{name}[scope={scope:#x}]"
        return FieldSource(label, [(fid(name), scope)], is_float, factor)

    def call(
        fn_name: str,
        args: tuple[Any, ...],
        obj: Any,
        attr: str = "value",
        is_float: bool = False,
        factor: float = 1,
        key: str | None = None,
    ) -> CallSource:
        full_args = (handle, *args, ctypes.byref(obj))
        return CallSource(key or fn_name, fn_name, full_args, obj, attr, is_float, factor)

    def temp_v(sensor: int) -> CallSource:
        buf = _TemperatureV1(version=_TEMPERATURE_V1, sensorType=sensor)
        key = f"nvmlDeviceGetTemperatureV(sensor={sensor})"
        return call("nvmlDeviceGetTemperatureV", (), buf, "temperature", True, key=key)

    def temp(sensor: int) -> CallSource:
        key = f"nvmlDeviceGetTemperature(sensor={sensor})"
        return call("nvmlDeviceGetTemperature", (sensor,), ctypes.c_uint(), "value", True, key=key)

    def clock(kind: int, label: str) -> CallSource:
        key = f"nvmlDeviceGetClockInfo({label})"
        return call("nvmlDeviceGetClockInfo", (kind,), ctypes.c_uint(), "value", True, key=key)

    def violations() -> dict[str, list[Source]]:
        """Each violation counter and its value's timestamp: the field, then the older call
        (one buffer per policy, shared by the counter and its timestamp: one call fills both)."""
        out: dict[str, list[Source]] = {}
        for name, (field_name, policy) in VIOLATION_SOURCES.items():
            value: list[Source] = [field(field_name)]
            stamp: list[Source] = [
                FieldSource(f"{field_name}.timestamp", [(fid(field_name), 0)], timestamp=True)
            ]
            if policy is not None:
                code = int(getattr(p, policy[0], policy[1]))
                buf = _ViolationTime()
                key = f"nvmlDeviceGetViolationStatus({policy[0]})"
                value.append(call("nvmlDeviceGetViolationStatus", (code,), buf, "violationTime", key=key))
                stamp.append(call("nvmlDeviceGetViolationStatus", (code,), buf, "referenceTime", key=key))
            out[f"violation_{name}_ns"] = value
            out[f"violation_{name}_ts_us"] = stamp
        return out

    util = _Utilization()
    mem_v2 = _MemoryV2(version=_MEMORY_V2)
    mw = 1000.0
    return {
        **violations(),
        "power_instant_w": [field("NVML_FI_DEV_POWER_INSTANT", scope_gpu, True, mw)],
        "power_avg_w": [
            field("NVML_FI_DEV_POWER_AVERAGE", scope_gpu, True, mw),
            call("nvmlDeviceGetPowerUsage", (), ctypes.c_uint(), is_float=True, factor=mw),
        ],
        "power_memory_w": [
            field("NVML_FI_DEV_POWER_INSTANT", scope_memory, True, mw),
            field("NVML_FI_DEV_POWER_AVERAGE", scope_memory, True, mw),
        ],
        # No fallback between instant and average here: the grid waveform reads the instant one.
        "power_module_w": [field("NVML_FI_DEV_POWER_INSTANT", scope_module, True, mw)],
        "power_module_avg_w": [field("NVML_FI_DEV_POWER_AVERAGE", scope_module, True, mw)],
        "energy_mj": [
            field("NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION"),
            call("nvmlDeviceGetTotalEnergyConsumption", (), ctypes.c_ulonglong()),
        ],
        "temp_gpu_c": [temp_v(_TEMPERATURE_GPU), temp(_TEMPERATURE_GPU)],
        "temp_hbm_c": [field("NVML_FI_DEV_MEMORY_TEMP", 0, True, 1)],
        "temp_hotspot_c": [temp_v(_TEMPERATURE_GPU_MAX), temp(_TEMPERATURE_GPU_MAX)],
        "clock_sm_mhz": [clock(CLOCK_SM, "NVML_CLOCK_SM")],
        "clock_mem_mhz": [clock(CLOCK_MEM, "NVML_CLOCK_MEM")],
        "throttle_reasons": [
            call("nvmlDeviceGetCurrentClocksEventReasons", (), ctypes.c_ulonglong()),
            call("nvmlDeviceGetCurrentClocksThrottleReasons", (), ctypes.c_ulonglong()),
        ],
        "util_gpu_pct": [call("nvmlDeviceGetUtilizationRates", (), util, "gpu", True)],
        "util_mem_pct": [call("nvmlDeviceGetUtilizationRates", (), util, "memory", True)],
        "mem_used_bytes": [
            call("nvmlDeviceGetMemoryInfo_v2", (), mem_v2, "used"),
            call("nvmlDeviceGetMemoryInfo", (), _Memory(), "used"),
        ],
        "power_limit_w": [
            call("nvmlDeviceGetEnforcedPowerLimit", (), ctypes.c_uint(), is_float=True, factor=mw)
        ],
        "pcie_tx_bytes": [field("NVML_FI_DEV_PCIE_COUNT_TX_BYTES")],
        "pcie_rx_bytes": [field("NVML_FI_DEV_PCIE_COUNT_RX_BYTES")],
        "nvlink_tx_bytes": [field("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", _SCOPE_ALL_LINKS, False, 1024)],
        "nvlink_rx_bytes": [field("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", _SCOPE_ALL_LINKS, False, 1024)],
    }


POWER_SCOPES: dict[str, str] = {
    "power_instant_w": "gpu",
    "power_avg_w": "gpu",
    "power_memory_w": "memory",
    "power_module_w": "module",
    "power_module_avg_w": "module",
}
"""The NVML power scope (``nvmlPowerScopeType_t``) of every power column's sources: what the
manifest records per device (``identity.extra["power_scopes"]``, null where unsupported)."""


PER_LINK_FALLBACK = {
    "nvlink_tx_bytes": "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX",
    "nvlink_rx_bytes": "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX",
}


# --- the raw field-values call ----------------------------------------------------------------


class FieldBatch:
    """A prebuilt nvmlFieldValue_t array and the struct that reads it back in one call."""

    def __init__(self, entries: Sequence[tuple[int, int]]) -> None:
        self.count = len(entries)
        self.buffer = ctypes.create_string_buffer(_FIELD_VALUE_SIZE * max(self.count, 1))
        for i, (field_id, scope_id) in enumerate(entries):
            struct.pack_into("<II", self.buffer, i * _FIELD_VALUE_SIZE, field_id, scope_id)
        self.unpack = struct.Struct("<" + _FIELD_VALUE_READ * self.count).unpack_from

    def fetch(self, fn: Any, handle: Any) -> tuple[int, tuple[int, ...]]:
        """(overall nvmlReturn, flat (timestamp, valueType, nvmlReturn, raw value) per entry:
        ``FIELD_STRIDE`` items each, at ``FIELD_TS`` .. ``FIELD_VALUE``)."""
        rc = int(fn(handle, self.count, self.buffer))
        return rc, (self.unpack(self.buffer) if rc == NVML_SUCCESS else ())


def resolve(p: Any, name: str) -> Any | None:
    """The ctypes function for an NVML symbol, or None when the library lacks it."""
    getter = getattr(p, "_nvmlGetFunctionPointer", None)
    try:
        if getter is not None:
            return getter(name)
        return getattr(p.nvmlLib, name)
    except (AttributeError, p.NVMLError):
        return None


def error_name(p: Any, rc: int) -> str:
    if rc <= -1000:
        return f"unknown NVML valueType {-1000 - rc}"
    try:
        return f"{p.NVMLError(rc)} (NVML error {rc})"
    except Exception:  # an unknown code: str() asks the library, which may itself fail
        return f"NVML error {rc}"
