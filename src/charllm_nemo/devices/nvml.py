"""NVML backend: NVIDIA GPUs through nvidia-ml-py (module ``pynvml``).

What one ``read()`` costs: one batched ``nvmlDeviceGetFieldValues`` call for everything NVML
exposes as a field (instant / average power of the GPU, memory and, on Grace modules, module
scope; energy, HBM temperature, the per-reason
violation time counters with each value's own timestamp, PCIe and NVLink byte counters), plus
one call per remaining source
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

The source table (field ids, dedicated calls, their buffers and the raw C layouts) lives in
:mod:`charllm_nemo.devices.nvml_sources`; this module probes it, samples and opens devices.

A device object is not thread-safe: one sampler thread per device.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from charllm_nemo.devices.base import ActivityInput, DeviceIdentity, UnsupportedLog
from charllm_nemo.devices.contract import METRIC_INDEX, METRIC_NAMES, METRICS, Reading
from charllm_nemo.devices.nvml_buffer import Batch, DriverBuffers
from charllm_nemo.devices.nvml_power_state import power_state
from charllm_nemo.devices.nvml_sources import (
    CLOCK_MEM,
    CLOCK_SM,
    FIELD_RC,
    FIELD_STRIDE,
    FIELD_TS,
    FIELD_VALUE,
    FIELD_VT,
    LOST_CODES,
    NVLINK_MAX_LINKS,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_SUCCESS,
    PER_LINK_FALLBACK,
    POWER_SCOPES,
    VT_UINT,
    VT_ULL,
    VT_ULONG,
    CallSource,
    FieldBatch,
    FieldSource,
    Source,
    candidate_sources,
    decode,
    error_name,
    resolve,
)
from charllm_nemo.errors import BackendUnavailable, ConfigError, DeviceLost

log = logging.getLogger("charllm_nemo.devices")

NVIDIA_EXTRA_HINT = "install the [nvidia] extra: pip install 'charllm-nemo[nvidia]'"


def _binding_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("nvidia-ml-py")
    except Exception:  # not installed as a distribution (vendored, renamed): not worth failing
        return None


# --- device -----------------------------------------------------------------------------------


_FieldPlan = tuple[tuple[int, tuple[int, ...], bool, float, bool], ...]
_CallPlan = tuple[tuple[Any, tuple[Any, ...], tuple[tuple[int, Any, str, bool, float], ...]], ...]
_Plan = tuple[FieldBatch | None, _FieldPlan, _CallPlan]


def _plan(p: Any, chosen: dict[str, Source]) -> _Plan:
    """A read plan for ``chosen`` (metric -> source): one field-values batch for the fields (an
    entry asked once however many metrics use it: a counter and its timestamp), each metric with
    its offsets in the batch's unpacked values, then one entry per distinct call."""
    index: dict[tuple[int, int], int] = {}
    field_plan: list[tuple[int, tuple[int, ...], bool, float, bool]] = []
    calls: dict[str, tuple[Any, tuple[Any, ...], list[tuple[int, Any, str, bool, float]]]] = {}
    for metric, source in chosen.items():
        mi = METRIC_INDEX[metric]
        if isinstance(source, FieldSource):
            offsets = tuple(FIELD_STRIDE * index.setdefault(e, len(index)) for e in source.entries)
            field_plan.append((mi, offsets, source.is_float, source.factor, source.timestamp))
        else:
            fn = resolve(p, source.fn_name)
            entry = calls.setdefault(source.label, (fn, source.args, []))
            entry[2].append((mi, source.obj, source.attr, source.is_float, source.factor))
    fields = FieldBatch(list(index)) if index else None
    return fields, tuple(field_plan), tuple((fn, args, tuple(outs)) for fn, args, outs in calls.values())


class NvmlDevice:
    """One NVIDIA GPU opened through NVML; ``read()`` returns one value per ``schema.METRICS``.

    Units: power W, energy mJ (64-bit counter), temperatures degC, clocks MHz, throttle reasons
    NVML's clock-event bitmask, violation time ns (cumulative), utilization %, memory B,
    PCIe / NVLink traffic B (cumulative 64-bit counters).
    """

    __slots__ = (
        "_closed",
        "_counters",
        "_field_fn",
        "_gauges",
        "_handle",
        "_index",
        "_nvml",
        "_supported",
        "_unsupported",
        "buffers",
        "identity",
    )

    def __init__(self, nvml: Any, index: int, handle: Any, unsupported: UnsupportedLog) -> None:
        self._nvml = nvml
        self._index = index
        self._handle = handle
        self._unsupported = unsupported
        self._closed = False
        sources = self._probe()
        self.buffers = _open_buffers(nvml, handle, index)
        self.identity = self._identify(sources)

    # -- open time ------------------------------------------------------------------------

    def _probe(self) -> dict[str, str]:
        """Pick each metric's first working source; build the read plan. Returns metric -> source."""
        p, handle = self._nvml, self._handle
        candidates = candidate_sources(p, handle)
        field_fn = resolve(p, "nvmlDeviceGetFieldValues")

        # Every candidate field in one probe call; per-link NVLink only if the aggregate fails.
        probe_entries = sorted(
            {e for srcs in candidates.values() for s in srcs if isinstance(s, FieldSource) for e in s.entries}
        )
        field_rc = self._probe_fields(field_fn, probe_entries)
        for metric, field_name in PER_LINK_FALLBACK.items():
            aggregate = candidates[metric][0]
            assert isinstance(aggregate, FieldSource)
            if field_rc.get(aggregate.entries[0], -1) == NVML_SUCCESS:
                continue
            max_links = int(getattr(p, "NVML_NVLINK_MAX_LINKS", NVLINK_MAX_LINKS))
            fid = aggregate.entries[0][0]
            links = [(fid, link) for link in range(max_links)]
            link_rc = self._probe_fields(field_fn, links)
            working = [e for e in links if link_rc.get(e) == NVML_SUCCESS]
            if working:
                field_rc.update(link_rc)
                label = f"{field_name}[links={','.join(str(s) for _, s in working)}] summed"
                candidates[metric].append(FieldSource(label, working, False, 1024))

        chosen: dict[str, Source] = {}
        reasons: dict[str, list[str]] = {}
        call_rc: dict[str, int] = {}
        for metric in METRIC_NAMES:
            for source in candidates.get(metric, []):
                if isinstance(source, FieldSource):
                    rcs = [field_rc.get(e, NVML_ERROR_FUNCTION_NOT_FOUND) for e in source.entries]
                    rc = next((r for r in rcs if r != NVML_SUCCESS), NVML_SUCCESS)
                else:
                    if source.label not in call_rc:
                        call_rc[source.label] = self._probe_call(source)
                    rc = call_rc[source.label]
                if rc == NVML_SUCCESS:
                    chosen[metric] = source
                    break
                reasons.setdefault(metric, []).append(f"{source.label}: {error_name(p, rc)}")
        for metric in METRIC_NAMES:
            if metric not in chosen:
                why = "; ".join(reasons.get(metric, [])) or "NVML has no source for it"
                self._unsupported(self._index, metric, why)

        # Two sampling plans: the gauges, read with every sample, and the cumulative counters,
        # which cost far more on some drivers (the energy counter ~3 ms on an H200) and are read
        # only on the sampler's counter slots (read() reads both, read_gauges() the first).
        self._field_fn: Any = field_fn
        self._gauges = _plan(p, {m: s for m, s in chosen.items() if not METRICS[METRIC_INDEX[m]].cumulative})
        self._counters = _plan(p, {m: s for m, s in chosen.items() if METRICS[METRIC_INDEX[m]].cumulative})
        self._supported = {m: m in chosen for m in METRIC_NAMES}
        return {m: s.label for m, s in chosen.items()}

    def _probe_fields(self, field_fn: Any, entries: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
        if field_fn is None or not entries:
            return {}
        rc, raw = FieldBatch(entries).fetch(field_fn, self._handle)
        if rc != NVML_SUCCESS:
            self._raise_if_lost(rc)
            return {e: rc for e in entries}
        result = {}
        for i, entry in enumerate(entries):
            b = FIELD_STRIDE * i
            field_rc = raw[b + FIELD_RC]
            self._raise_if_lost(field_rc)
            if field_rc == NVML_SUCCESS and decode(raw[b + FIELD_VT], 0) is None:
                field_rc = -1000 - raw[b + FIELD_VT]  # a valueType this code does not know
            result[entry] = field_rc
        return result

    def _raise_if_lost(self, rc: int) -> None:
        if rc in LOST_CODES:
            raise BackendUnavailable(
                f"NVML GPU {self._index} stopped answering while it was being opened "
                f"({error_name(self._nvml, rc)}); check `nvidia-smi` and the kernel log (Xid errors)"
            )

    def _probe_call(self, source: CallSource) -> int:
        fn = resolve(self._nvml, source.fn_name)
        if fn is None:
            return NVML_ERROR_FUNCTION_NOT_FOUND
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
                if getattr(exc, "value", None) == NVML_ERROR_GPU_IS_LOST:
                    raise BackendUnavailable(
                        f"NVML GPU {self._index} is lost ({exc}); check `nvidia-smi` and the kernel log"
                    ) from exc
                return None

        extra: dict[str, Any] = {
            "metric_sources": sources,
            "power_scopes": {m: scope if m in sources else None for m, scope in POWER_SCOPES.items()},
            "energy_counter_unit": "mJ",
        }
        if self.buffers is not None:
            extra["driver_buffers"] = {
                "metrics": list(self.buffers.metrics),
                "capacity": dict(self.buffers.capacity),
                "unsupported": dict(self.buffers.unsupported),
            }
        pci = ask("nvmlDeviceGetPciInfo_v3", h)
        if pci is not None:
            extra["pci_bus_id"] = str(pci.busId)
        cuda = ask("nvmlSystemGetCudaDriverVersion_v2") or ask("nvmlSystemGetCudaDriverVersion")
        facts: dict[str, Any] = {
            "nvml_version": ask("nvmlSystemGetNVMLVersion"),
            "nvidia_ml_py_version": _binding_version(),
            "cuda_driver_version": f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else None,
            "architecture": ask("nvmlDeviceGetArchitecture", h),
            "clock_sm_max_mhz": ask("nvmlDeviceGetMaxClockInfo", h, CLOCK_SM),
            "clock_mem_max_mhz": ask("nvmlDeviceGetMaxClockInfo", h, CLOCK_MEM),
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
        facts["power_state"] = power_state(p, h)
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
        self._read_plan(self._gauges, out)
        self._read_plan(self._counters, out)
        return tuple(out)

    def read_gauges(self) -> Reading:
        """:meth:`read` without the cumulative counters (``Metric.cumulative``: energy,
        violation times, PCIe/NVLink bytes), which stay None: what the sampler calls between
        its counter slots (telemetry.sample_loop)."""
        if self._closed:
            raise DeviceLost(f"NVML GPU {self._index}: the backend was closed")
        out: list[float | int | None] = [None] * _N_METRICS
        self._read_plan(self._gauges, out)
        return tuple(out)

    @property
    def has_driver_buffers(self) -> bool:
        """Whether the driver serves this GPU any sample buffer (devices/base.py
        ``ServesDriverBuffers``)."""
        return self.buffers is not None

    def read_buffered(self) -> list[Batch]:
        """The driver's own samples taken since the last call (:mod:`.nvml_buffer`): one
        ``(metric, wall-clock timestamps in us, values)`` per metric that has new ones, metrics
        ``power_w`` (W), ``clock_sm_mhz`` (MHz), ``util_gpu_pct`` (%). Empty where the driver
        serves none. Raises only DeviceLost. May be called from another thread than read()'s."""
        if self._closed:
            raise DeviceLost(f"NVML GPU {self._index}: the backend was closed")
        if self.buffers is None:
            return []
        return self.buffers.read()

    def _read_plan(self, plan: _Plan, out: list[float | int | None]) -> None:
        fields, field_plan, call_plan = plan
        if fields is not None:
            rc = self._field_fn(self._handle, fields.count, fields.buffer)
            if rc:
                self._failed(rc, [plan[0] for plan in field_plan])
            else:
                raw = fields.unpack(fields.buffer)
                for mi, offsets, is_float, factor, stamp in field_plan:
                    total: int | float = 0
                    for b in offsets:
                        frc = raw[b + FIELD_RC]
                        if frc:
                            self._failed(frc, (mi,))
                            break
                        if stamp:  # the value's own time, as the driver took it (us)
                            total += raw[b + FIELD_TS]
                            continue
                        vt = raw[b + FIELD_VT]
                        if vt == VT_UINT:
                            v = raw[b + FIELD_VALUE] & 0xFFFFFFFF
                        elif vt in (VT_ULL, VT_ULONG):
                            v = raw[b + FIELD_VALUE]
                        else:
                            v = decode(vt, raw[b + FIELD_VALUE])
                            if v is None:
                                self._failed(-1000 - vt, (mi,))
                                break
                        total += v
                    else:
                        out[mi] = total / factor if is_float else int(total * factor)
        for fn, args, outputs in call_plan:
            rc = fn(*args)
            if rc:
                self._failed(rc, [o[0] for o in outputs])
                continue
            for mi, obj, attr, is_float, factor in outputs:
                value = getattr(obj, attr)
                out[mi] = value / factor if is_float else value * factor

    def _failed(self, rc: int, metric_indices: Sequence[int]) -> None:
        """A source returned an error while sampling: DeviceLost, or log once and leave None."""
        if rc in LOST_CODES:
            raise DeviceLost(f"NVML GPU {self._index}: {error_name(self._nvml, rc)}")
        reason = f"{error_name(self._nvml, rc)} while sampling"
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


def _open_buffers(nvml: Any, handle: Any, index: int) -> DriverBuffers | None:
    """The device's driver sample buffers, or None where it serves none (logged at INFO)."""
    try:
        buffers = DriverBuffers(nvml, handle, index)
    except DeviceLost as exc:
        raise BackendUnavailable(
            f"NVML GPU {index} stopped answering while it was being opened ({exc}); check `nvidia-smi`"
        ) from exc
    return buffers if buffers.metrics else None


# --- backend ----------------------------------------------------------------------------------


class NvmlBackend:
    """NVML initialized once for this process and the devices opened through it."""

    name = "nvml"

    def __init__(self, nvml: Any, devices: list[NvmlDevice], unsupported: UnsupportedLog) -> None:
        self._nvml = nvml
        self.devices: list[NvmlDevice] = devices
        self.unsupported = unsupported
        self.activity: ActivityInput | None = None  # a GPU measures its own activity
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
