"""NVML backend: NVIDIA GPUs through nvidia-ml-py (module ``pynvml``).

What one ``read()`` costs: one batched ``nvmlDeviceGetFieldValues`` call for everything NVML
exposes as a field (instant / average / memory power, energy, HBM temperature, power and
thermal violation time, PCIe and NVLink byte counters), plus one call per remaining source
(temperatures, clocks, clock-event reasons, utilization, memory, enforced power limit).

At open every metric is probed once, trying its sources in order of preference (a field
first, then the older dedicated call where one exists); the first source that answers
``NVML_SUCCESS`` is kept, the rest are never called. A metric with no working source is
logged once (:class:`~charllm_nemo.devices.base.UnsupportedLog`) and is ``None`` in every
reading without costing a call. The chosen source of each metric is recorded in
``identity.extra["metric_sources"]``.

The sampling path resolves NVML's C entry points once through pynvml and calls them directly
with buffers allocated at open: no per-call allocation, no pynvml wrapper overhead, no
exceptions for unsupported values. Units are converted here, once: mW -> W, KiB -> B; energy
stays in mJ, violation time in ns, memory in bytes, temperatures in degC, clocks in MHz.

Errors while sampling: ``NVML_ERROR_GPU_IS_LOST`` (or ``NVML_ERROR_UNINITIALIZED``, i.e. NVML
was shut down underneath us) raises :class:`~charllm_nemo.errors.DeviceLost`; any other error
makes that metric ``None`` for that sample, logged once per (device, metric), and the source is
tried again next sample (NVML reports transient errors at high polling rates).

A device object is not thread-safe: one sampler thread per device.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from charllm_nemo.devices.base import DeviceIdentity, UnsupportedLog
from charllm_nemo.errors import BackendUnavailable, ConfigError, DeviceLost
from charllm_nemo.telemetry.schema import METRIC_INDEX, METRIC_NAMES, METRICS, Reading

log = logging.getLogger("charllm_nemo.devices")

NVIDIA_EXTRA_HINT = "install the [nvidia] extra: pip install 'charllm-nemo[nvidia]'"

# nvml.h values, used when the installed binding predates a name. Field ids below 251 have been
# stable across NVML releases; the driver, not the binding, decides whether a field works.
_NVML_SUCCESS = 0
_NVML_ERROR_UNINITIALIZED = 1
_NVML_ERROR_FUNCTION_NOT_FOUND = 13
_NVML_ERROR_GPU_IS_LOST = 15
_LOST_CODES = frozenset({_NVML_ERROR_UNINITIALIZED, _NVML_ERROR_GPU_IS_LOST})

_FIELD_DEFAULTS: dict[str, int] = {
    "NVML_FI_DEV_PERF_POLICY_POWER": 74,  # ns clocks were held down by the power policy
    "NVML_FI_DEV_PERF_POLICY_THERMAL": 75,  # ns clocks were held down by the thermal policy
    "NVML_FI_DEV_MEMORY_TEMP": 82,  # degC
    "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 83,  # mJ since driver load
    "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX": 138,  # KiB; scopeId = link id or UINT_MAX = all links
    "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX": 139,
    "NVML_FI_DEV_POWER_AVERAGE": 185,  # mW, 1 s average (Ampere+ except GA100)
    "NVML_FI_DEV_POWER_INSTANT": 186,  # mW
    "NVML_FI_DEV_PCIE_COUNT_TX_BYTES": 197,  # B
    "NVML_FI_DEV_PCIE_COUNT_RX_BYTES": 198,
}
_POWER_SCOPE_GPU = 0
_POWER_SCOPE_MEMORY = 2
_SCOPE_ALL_LINKS = 0xFFFFFFFF  # nvml.h: "A scopeId of UINT_MAX returns aggregate value"
_NVLINK_MAX_LINKS = 18  # only if the binding does not say (nvidia-ml-py 13 says 36)

_TEMPERATURE_GPU = 0
_TEMPERATURE_GPU_MAX = 1  # NVML 13: "the hottest part of the GPU"; older drivers reject it
_CLOCK_SM = 1
_CLOCK_MEM = 2
_PERF_POLICY_POWER = 0
_PERF_POLICY_THERMAL = 1
_TEMPERATURE_V1 = 0x0100000C  # sizeof(nvmlTemperature_t) | 1 << 24
_MEMORY_V2 = 0x02000028  # sizeof(nvmlMemory_v2_t) | 2 << 24

# nvmlFieldValue_t: fieldId u32, scopeId u32, timestamp i64, latencyUsec i64, valueType u32,
# nvmlReturn u32, value (8-byte union): 40 bytes. A read unpacks (valueType, nvmlReturn, the 8
# value bytes as u64) for every field in one struct call.
_FIELD_VALUE_SIZE = 40
_FIELD_VALUE_READ = "24xIIQ"
_VT_DOUBLE, _VT_UINT, _VT_ULONG, _VT_ULL, _VT_SLL, _VT_SINT, _VT_USHORT = range(7)


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


def _decode(value_type: int, raw: int) -> int | float | None:
    """The value union's member named by ``valueType``, from its 8 bytes read as a u64."""
    if value_type in (_VT_ULL, _VT_ULONG):  # unsigned long is 64-bit on Linux
        return raw
    if value_type == _VT_UINT:
        return raw & 0xFFFFFFFF
    if value_type == _VT_DOUBLE:
        return float(struct.unpack("<d", struct.pack("<Q", raw))[0])
    if value_type == _VT_SLL:
        return raw - (1 << 64) if raw >> 63 else raw
    if value_type == _VT_SINT:
        low = raw & 0xFFFFFFFF
        return low - (1 << 32) if low >> 31 else low
    if value_type == _VT_USHORT:
        return raw & 0xFFFF
    return None


# --- metric sources ---------------------------------------------------------------------------


@dataclass
class _FieldSource:
    """One metric from one or more (fieldId, scopeId) entries of the batch, summed."""

    label: str
    entries: list[tuple[int, int]]
    is_float: bool = False
    factor: float = 1  # float metrics: value / factor; int metrics: value * factor


@dataclass
class _CallSource:
    """One NVML call filling ``obj``; sources with the same label are one call (utilization)."""

    label: str
    fn_name: str
    args: tuple[Any, ...]
    obj: Any
    attr: str = "value"
    is_float: bool = False
    factor: float = 1


_Source = _FieldSource | _CallSource


def _sources(p: Any, handle: Any) -> dict[str, list[_Source]]:
    """Candidate sources of every metric, best first. Buffers are created here, once."""

    def fid(name: str) -> int:
        return int(getattr(p, name, _FIELD_DEFAULTS[name]))

    scope_memory = int(getattr(p, "NVML_POWER_SCOPE_MEMORY", _POWER_SCOPE_MEMORY))
    scope_gpu = int(getattr(p, "NVML_POWER_SCOPE_GPU", _POWER_SCOPE_GPU))

    def field(name: str, scope: int = 0, is_float: bool = False, factor: float = 1) -> _FieldSource:
        label = name if scope == 0 else f"{name}[scope={scope:#x}]"
        return _FieldSource(label, [(fid(name), scope)], is_float, factor)

    def call(
        fn_name: str,
        args: tuple[Any, ...],
        obj: Any,
        attr: str = "value",
        is_float: bool = False,
        factor: float = 1,
        key: str | None = None,
    ) -> _CallSource:
        full_args = (handle, *args, ctypes.byref(obj))
        return _CallSource(key or fn_name, fn_name, full_args, obj, attr, is_float, factor)

    def temp_v(sensor: int) -> _CallSource:
        buf = _TemperatureV1(version=_TEMPERATURE_V1, sensorType=sensor)
        key = f"nvmlDeviceGetTemperatureV(sensor={sensor})"
        return call("nvmlDeviceGetTemperatureV", (), buf, "temperature", True, key=key)

    def temp(sensor: int) -> _CallSource:
        key = f"nvmlDeviceGetTemperature(sensor={sensor})"
        return call("nvmlDeviceGetTemperature", (sensor,), ctypes.c_uint(), "value", True, key=key)

    def clock(kind: int, label: str) -> _CallSource:
        key = f"nvmlDeviceGetClockInfo({label})"
        return call("nvmlDeviceGetClockInfo", (kind,), ctypes.c_uint(), "value", True, key=key)

    def violation(policy: int, label: str) -> _CallSource:
        key = f"nvmlDeviceGetViolationStatus({label})"
        return call("nvmlDeviceGetViolationStatus", (policy,), _ViolationTime(), "violationTime", key=key)

    util = _Utilization()
    mem_v2 = _MemoryV2(version=_MEMORY_V2)
    mw = 1000.0
    return {
        "power_instant_w": [field("NVML_FI_DEV_POWER_INSTANT", scope_gpu, True, mw)],
        "power_avg_w": [
            field("NVML_FI_DEV_POWER_AVERAGE", scope_gpu, True, mw),
            call("nvmlDeviceGetPowerUsage", (), ctypes.c_uint(), is_float=True, factor=mw),
        ],
        "power_memory_w": [
            field("NVML_FI_DEV_POWER_INSTANT", scope_memory, True, mw),
            field("NVML_FI_DEV_POWER_AVERAGE", scope_memory, True, mw),
        ],
        "energy_mj": [
            field("NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION"),
            call("nvmlDeviceGetTotalEnergyConsumption", (), ctypes.c_ulonglong()),
        ],
        "temp_gpu_c": [temp_v(_TEMPERATURE_GPU), temp(_TEMPERATURE_GPU)],
        "temp_hbm_c": [field("NVML_FI_DEV_MEMORY_TEMP", 0, True, 1)],
        "temp_hotspot_c": [temp_v(_TEMPERATURE_GPU_MAX), temp(_TEMPERATURE_GPU_MAX)],
        "clock_sm_mhz": [clock(_CLOCK_SM, "NVML_CLOCK_SM")],
        "clock_mem_mhz": [clock(_CLOCK_MEM, "NVML_CLOCK_MEM")],
        "throttle_reasons": [
            call("nvmlDeviceGetCurrentClocksEventReasons", (), ctypes.c_ulonglong()),
            call("nvmlDeviceGetCurrentClocksThrottleReasons", (), ctypes.c_ulonglong()),
        ],
        "violation_power_ns": [
            field("NVML_FI_DEV_PERF_POLICY_POWER"),
            violation(_PERF_POLICY_POWER, "NVML_PERF_POLICY_POWER"),
        ],
        "violation_thermal_ns": [
            field("NVML_FI_DEV_PERF_POLICY_THERMAL"),
            violation(_PERF_POLICY_THERMAL, "NVML_PERF_POLICY_THERMAL"),
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


_PER_LINK_FALLBACK = {
    "nvlink_tx_bytes": "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX",
    "nvlink_rx_bytes": "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX",
}


# --- the raw field-values call ----------------------------------------------------------------


class _FieldBatch:
    """A prebuilt nvmlFieldValue_t array and the struct that reads it back in one call."""

    def __init__(self, entries: Sequence[tuple[int, int]]) -> None:
        self.count = len(entries)
        self.buffer = ctypes.create_string_buffer(_FIELD_VALUE_SIZE * max(self.count, 1))
        for i, (field_id, scope_id) in enumerate(entries):
            struct.pack_into("<II", self.buffer, i * _FIELD_VALUE_SIZE, field_id, scope_id)
        self.unpack = struct.Struct("<" + _FIELD_VALUE_READ * self.count).unpack_from

    def fetch(self, fn: Any, handle: Any) -> tuple[int, tuple[int, ...]]:
        """(overall nvmlReturn, flat (valueType, nvmlReturn, raw value) per entry)."""
        rc = int(fn(handle, self.count, self.buffer))
        return rc, (self.unpack(self.buffer) if rc == _NVML_SUCCESS else ())


def _resolve(p: Any, name: str) -> Any | None:
    """The ctypes function for an NVML symbol, or None when the library lacks it."""
    getter = getattr(p, "_nvmlGetFunctionPointer", None)
    try:
        if getter is not None:
            return getter(name)
        return getattr(p.nvmlLib, name)
    except (AttributeError, p.NVMLError):
        return None


def _binding_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("nvidia-ml-py")
    except Exception:  # not installed as a distribution (vendored, renamed): not worth failing
        return None


def _error_name(p: Any, rc: int) -> str:
    if rc <= -1000:
        return f"unknown NVML valueType {-1000 - rc}"
    try:
        return f"{p.NVMLError(rc)} (NVML error {rc})"
    except Exception:  # an unknown code: str() asks the library, which may itself fail
        return f"NVML error {rc}"


# --- device -----------------------------------------------------------------------------------


class NvmlDevice:
    """One NVIDIA GPU opened through NVML; ``read()`` returns one value per ``schema.METRICS``.

    Units: power W, energy mJ (64-bit counter), temperatures degC, clocks MHz, throttle reasons
    NVML's clock-event bitmask, violation time ns (cumulative), utilization %, memory B,
    PCIe / NVLink traffic B (cumulative 64-bit counters).
    """

    __slots__ = (
        "_call_plan",
        "_closed",
        "_field_fn",
        "_field_plan",
        "_fields",
        "_handle",
        "_index",
        "_nvml",
        "_supported",
        "_unsupported",
        "identity",
    )

    def __init__(self, nvml: Any, index: int, handle: Any, unsupported: UnsupportedLog) -> None:
        self._nvml = nvml
        self._index = index
        self._handle = handle
        self._unsupported = unsupported
        self._closed = False
        sources = self._probe()
        self.identity = self._identify(sources)

    # -- open time ------------------------------------------------------------------------

    def _probe(self) -> dict[str, str]:
        """Pick each metric's first working source; build the read plan. Returns metric -> source."""
        p, handle = self._nvml, self._handle
        candidates = _sources(p, handle)
        field_fn = _resolve(p, "nvmlDeviceGetFieldValues")

        # Every candidate field in one probe call; per-link NVLink only if the aggregate fails.
        probe_entries = sorted(
            {
                e
                for srcs in candidates.values()
                for s in srcs
                if isinstance(s, _FieldSource)
                for e in s.entries
            }
        )
        field_rc = self._probe_fields(field_fn, probe_entries)
        for metric, field_name in _PER_LINK_FALLBACK.items():
            aggregate = candidates[metric][0]
            assert isinstance(aggregate, _FieldSource)
            if field_rc.get(aggregate.entries[0], -1) == _NVML_SUCCESS:
                continue
            max_links = int(getattr(p, "NVML_NVLINK_MAX_LINKS", _NVLINK_MAX_LINKS))
            fid = aggregate.entries[0][0]
            links = [(fid, link) for link in range(max_links)]
            link_rc = self._probe_fields(field_fn, links)
            working = [e for e in links if link_rc.get(e) == _NVML_SUCCESS]
            if working:
                field_rc.update(link_rc)
                label = f"{field_name}[links={','.join(str(s) for _, s in working)}] summed"
                candidates[metric].append(_FieldSource(label, working, False, 1024))

        chosen: dict[str, _Source] = {}
        reasons: dict[str, list[str]] = {}
        call_rc: dict[str, int] = {}
        for metric in METRIC_NAMES:
            for source in candidates.get(metric, []):
                if isinstance(source, _FieldSource):
                    rcs = [field_rc.get(e, _NVML_ERROR_FUNCTION_NOT_FOUND) for e in source.entries]
                    rc = next((r for r in rcs if r != _NVML_SUCCESS), _NVML_SUCCESS)
                else:
                    if source.label not in call_rc:
                        call_rc[source.label] = self._probe_call(source)
                    rc = call_rc[source.label]
                if rc == _NVML_SUCCESS:
                    chosen[metric] = source
                    break
                reasons.setdefault(metric, []).append(f"{source.label}: {_error_name(p, rc)}")
        for metric in METRIC_NAMES:
            if metric not in chosen:
                why = "; ".join(reasons.get(metric, [])) or "NVML has no source for it"
                self._unsupported(self._index, metric, why)

        # The sampling plan: one batch for the chosen fields, then one entry per distinct call.
        entries: list[tuple[int, int]] = []
        field_plan: list[tuple[int, tuple[int, ...], bool, float]] = []
        calls: dict[str, tuple[Any, tuple[Any, ...], list[tuple[int, Any, str, bool, float]]]] = {}
        for metric, source in chosen.items():
            mi = METRIC_INDEX[metric]
            if isinstance(source, _FieldSource):
                offsets = tuple(3 * (len(entries) + k) for k in range(len(source.entries)))
                entries.extend(source.entries)
                field_plan.append((mi, offsets, source.is_float, source.factor))
            else:
                fn = _resolve(p, source.fn_name)
                entry = calls.setdefault(source.label, (fn, source.args, []))
                entry[2].append((mi, source.obj, source.attr, source.is_float, source.factor))
        self._fields = _FieldBatch(entries) if entries else None
        self._field_fn: Any = field_fn
        self._field_plan = tuple(field_plan)
        self._call_plan = tuple((fn, args, tuple(outs)) for fn, args, outs in calls.values())
        self._supported = {m: m in chosen for m in METRIC_NAMES}
        return {m: s.label for m, s in chosen.items()}

    def _probe_fields(self, field_fn: Any, entries: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
        if field_fn is None or not entries:
            return {}
        rc, raw = _FieldBatch(entries).fetch(field_fn, self._handle)
        if rc != _NVML_SUCCESS:
            self._raise_if_lost(rc)
            return {e: rc for e in entries}
        result = {}
        for i, entry in enumerate(entries):
            field_rc = raw[3 * i + 1]
            self._raise_if_lost(field_rc)
            if field_rc == _NVML_SUCCESS and _decode(raw[3 * i], 0) is None:
                field_rc = -1000 - raw[3 * i]  # a valueType this code does not know
            result[entry] = field_rc
        return result

    def _raise_if_lost(self, rc: int) -> None:
        if rc in _LOST_CODES:
            raise BackendUnavailable(
                f"NVML GPU {self._index} stopped answering while it was being opened "
                f"({_error_name(self._nvml, rc)}); check `nvidia-smi` and the kernel log (Xid errors)"
            )

    def _probe_call(self, source: _CallSource) -> int:
        fn = _resolve(self._nvml, source.fn_name)
        if fn is None:
            return _NVML_ERROR_FUNCTION_NOT_FOUND
        rc = int(fn(*source.args))
        self._raise_if_lost(rc)
        return rc

    def _identify(self, sources: dict[str, str]) -> DeviceIdentity:
        p, h = self._nvml, self._handle

        def ask(fn_name: str, *args: Any) -> Any:
            fn = getattr(p, fn_name, None)
            if fn is None:
                return None
            try:
                return fn(*args)
            except p.NVMLError as exc:
                if getattr(exc, "value", None) == _NVML_ERROR_GPU_IS_LOST:
                    raise BackendUnavailable(
                        f"NVML GPU {self._index} is lost ({exc}); check `nvidia-smi` and the kernel log"
                    ) from exc
                return None

        extra: dict[str, Any] = {"metric_sources": sources, "energy_counter_unit": "mJ"}
        pci = ask("nvmlDeviceGetPciInfo_v3", h)
        if pci is not None:
            extra["pci_bus_id"] = str(pci.busId)
        cuda = ask("nvmlSystemGetCudaDriverVersion_v2") or ask("nvmlSystemGetCudaDriverVersion")
        facts: dict[str, Any] = {
            "nvml_version": ask("nvmlSystemGetNVMLVersion"),
            "nvidia_ml_py_version": _binding_version(),
            "cuda_driver_version": f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else None,
            "architecture": ask("nvmlDeviceGetArchitecture", h),
            "clock_sm_max_mhz": ask("nvmlDeviceGetMaxClockInfo", h, _CLOCK_SM),
            "clock_mem_max_mhz": ask("nvmlDeviceGetMaxClockInfo", h, _CLOCK_MEM),
        }
        cc = ask("nvmlDeviceGetCudaComputeCapability", h)
        if cc is not None:
            facts["compute_capability"] = f"{cc[0]}.{cc[1]}"
        default_limit = ask("nvmlDeviceGetPowerManagementDefaultLimit", h)
        if default_limit is not None:
            facts["power_limit_default_w"] = default_limit / 1000.0
        constraints = ask("nvmlDeviceGetPowerManagementLimitConstraints", h)
        if constraints is not None:
            facts["power_limit_min_w"] = constraints[0] / 1000.0
            facts["power_limit_max_w"] = constraints[1] / 1000.0
        memory = ask("nvmlDeviceGetMemoryInfo", h)
        if memory is not None:
            facts["memory_total_bytes"] = int(memory.total)
        extra.update({k: v for k, v in facts.items() if v is not None})
        name = ask("nvmlDeviceGetName", h)
        return DeviceIdentity(
            index=self._index,
            name=str(name) if name is not None else f"NVIDIA GPU {self._index}",
            vendor="nvidia",
            backend="nvml",
            uuid=ask("nvmlDeviceGetUUID", h),
            driver_version=ask("nvmlSystemGetDriverVersion"),
            extra=extra,
        )

    # -- sampling -------------------------------------------------------------------------

    def read(self) -> Reading:
        """One value per ``schema.METRICS`` entry, in schema units; None = unsupported or failed.

        Raises DeviceLost on NVML_ERROR_GPU_IS_LOST / NVML_ERROR_UNINITIALIZED or after close().
        """
        if self._closed:
            raise DeviceLost(f"NVML GPU {self._index}: the backend was closed")
        out: list[float | int | None] = [None] * _N_METRICS
        fields = self._fields
        if fields is not None:
            rc = self._field_fn(self._handle, fields.count, fields.buffer)
            if rc:
                self._failed(rc, [mi for mi, _, _, _ in self._field_plan])
            else:
                raw = fields.unpack(fields.buffer)
                for mi, offsets, is_float, factor in self._field_plan:
                    total: int | float = 0
                    for b in offsets:
                        frc = raw[b + 1]
                        if frc:
                            self._failed(frc, (mi,))
                            break
                        vt = raw[b]
                        if vt == _VT_UINT:
                            v = raw[b + 2] & 0xFFFFFFFF
                        elif vt in (_VT_ULL, _VT_ULONG):
                            v = raw[b + 2]
                        else:
                            v = _decode(vt, raw[b + 2])
                            if v is None:
                                self._failed(-1000 - vt, (mi,))
                                break
                        total += v
                    else:
                        out[mi] = total / factor if is_float else int(total * factor)
        for fn, args, outputs in self._call_plan:
            rc = fn(*args)
            if rc:
                self._failed(rc, [o[0] for o in outputs])
                continue
            for mi, obj, attr, is_float, factor in outputs:
                value = getattr(obj, attr)
                out[mi] = value / factor if is_float else value * factor
        return tuple(out)

    def _failed(self, rc: int, metric_indices: Sequence[int]) -> None:
        """A source returned an error while sampling: DeviceLost, or log once and leave None."""
        if rc in _LOST_CODES:
            raise DeviceLost(f"NVML GPU {self._index}: {_error_name(self._nvml, rc)}")
        reason = f"{_error_name(self._nvml, rc)} while sampling"
        for mi in metric_indices:
            self._unsupported(self._index, METRIC_NAMES[mi], reason)

    def supported_metrics(self) -> dict[str, bool]:
        """Which metrics produced a value at open time (the probe), by name."""
        return dict(self._supported)

    def _mark_closed(self) -> None:
        self._closed = True

    def __repr__(self) -> str:
        return f"NvmlDevice(index={self._index}, name={self.identity.name!r})"


_N_METRICS = len(METRICS)


# --- backend ----------------------------------------------------------------------------------


class NvmlBackend:
    """NVML initialized once for this process and the devices opened through it."""

    name = "nvml"

    def __init__(self, nvml: Any, devices: list[NvmlDevice], unsupported: UnsupportedLog) -> None:
        self._nvml = nvml
        self.devices: list[NvmlDevice] = devices
        self.unsupported = unsupported
        self._open = True

    def close(self) -> None:
        """nvmlShutdown once; later calls do nothing. Devices raise DeviceLost afterwards."""
        if not self._open:
            return
        self._open = False
        for device in self.devices:
            device._mark_closed()
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:  # already shut down by someone else: nothing to release
            log.debug("nvmlShutdown: %s", exc)

    def __enter__(self) -> NvmlBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NvmlBackend(devices={[d.identity.index for d in self.devices]}, open={self._open})"


def _import_pynvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:
        raise BackendUnavailable(
            f"nvidia-ml-py (module pynvml) is not installed; {NVIDIA_EXTRA_HINT}"
        ) from exc
    return pynvml


# nvmlInit failures a person can act on, by NVML error code.
_INIT_HINTS: dict[int, str] = {
    12: "no NVIDIA driver found (libnvidia-ml.so.1 not loadable): run on a machine with the NVIDIA "
    "driver installed, or put the directory holding libnvidia-ml.so.1 on LD_LIBRARY_PATH",
    9: "the NVIDIA driver is installed but not loaded (nvmlInit: Driver Not Loaded); check "
    "`nvidia-smi`, `lsmod | grep nvidia` and, in a container, that the GPUs are passed through",
    18: "libnvidia-ml.so and the loaded NVIDIA kernel module have different versions (driver "
    "updated without a reboot?); reboot or reload the nvidia kernel module",
    4: "no permission to open the NVIDIA devices (nvmlInit: Insufficient Permissions); check the "
    "permissions of /dev/nvidia*",
}


def _init_error(exc: Exception) -> BackendUnavailable:
    code = getattr(exc, "value", None)
    hint = _INIT_HINTS.get(code) if isinstance(code, int) else None
    return BackendUnavailable(hint or f"nvmlInit failed: {exc}; check `nvidia-smi`")


def open_backend(indices: Sequence[int] | None = None, **options: Any) -> NvmlBackend:
    """Initialize NVML and open the GPUs at ``indices`` (host / NVML indices; None = all).

    Raises BackendUnavailable (no binding, no driver, no GPU, GPU lost while opening) and
    ConfigError (an index out of range, an unknown option). Readings are in schema units.
    """
    if options:
        raise ConfigError(
            f"telemetry backend nvml takes no options, got {', '.join(sorted(options))}; remove them"
        )
    p = _import_pynvml()
    try:
        p.nvmlInit()
    except p.NVMLError as exc:
        raise _init_error(exc) from exc
    try:
        return _open_devices(p, indices)
    except BaseException:
        with contextlib.suppress(p.NVMLError):
            p.nvmlShutdown()
        raise


def _open_devices(p: Any, indices: Sequence[int] | None) -> NvmlBackend:
    try:
        count = int(p.nvmlDeviceGetCount())
    except p.NVMLError as exc:
        raise BackendUnavailable(f"NVML cannot count the GPUs ({exc}); check `nvidia-smi`") from exc
    if count == 0:
        raise BackendUnavailable("NVML found no NVIDIA GPU on this host (nvmlDeviceGetCount = 0)")
    if indices is None:
        wanted = list(range(count))
    else:
        wanted = []
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count:
                raise ConfigError(
                    f"device index {i!r} is out of range: this host has {count} NVIDIA GPU(s), "
                    f"valid indices are 0..{count - 1}"
                )
            if i in wanted:
                raise ConfigError(f"device index {i} is listed twice in {list(indices)}; list each GPU once")
            wanted.append(i)
        if not wanted:
            raise ConfigError("no device index given (indices=[]); pass None for all GPUs")
    unsupported = UnsupportedLog()
    devices = []
    for i in wanted:
        try:
            handle = p.nvmlDeviceGetHandleByIndex(i)
        except p.NVMLError as exc:
            raise BackendUnavailable(
                f"NVML cannot open GPU {i} ({exc}); "
                f"check `nvidia-smi -i {i}` and the permissions of /dev/nvidia*"
            ) from exc
        devices.append(NvmlDevice(p, i, handle, unsupported))
    return NvmlBackend(p, devices, unsupported)
