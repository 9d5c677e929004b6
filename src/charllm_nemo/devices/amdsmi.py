"""AMD Instinct GPUs through the ``amdsmi`` Python package (written against amdsmi 7.0.2).

What this backend reads, and why (docs/devices-amd.md has the full table):

* power: ``amdsmi_get_power_info`` (W). ``current_socket_power`` is the instant reading on
  MI300 and later; MI200 and older report only ``average_socket_power``, so the instant column
  falls back to it (``identity.extra["power_instant_source"]`` says which one is used);
* energy: ``amdsmi_get_energy_count`` ticks times ``counter_resolution`` (µJ per tick), as an
  exact integer in mJ (the accumulator is 64-bit; a float product would round it);
* temperatures, clocks, activity, VRAM use and the power cap through their dedicated calls,
  with ``amdsmi_get_gpu_metrics_info`` as the fallback (or first, with ``prefer="gpu_metrics"``);
* XGMI bytes from gpu_metrics ``xgmi_read_data_acc`` / ``xgmi_write_data_acc`` (KB per link);
* throttle bits and violation time from the gpu_metrics residency accumulators (MI300+).
  ``amdsmi_get_violation_status`` computes the same thing but sleeps 100 ms inside every call,
  and gpu_metrics ``throttle_status`` reaches Python as a bool, so neither is used.

Multi-die packages (MI250/MI250X, MI300X in CPX mode): only one die of a package reports the
package's power and energy. The other dies report None for those metrics, never 0 and never a
copy; ``identity.extra`` names the die that carries the package (``package_power_die``).

Every metric is probed once at open. What produced no value is logged once and never called
again. ``read()`` raises only :class:`DeviceLost`; any other failure is None for that sample.

Where each metric can come from (the call table, the candidates, the value helpers, the
residency tracker and the probe) lives in :mod:`charllm_nemo.devices.amdsmi_sources`; this
module opens the devices, works out which die reports a package, and samples.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import operator
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from charllm_nemo.devices.amdsmi_sources import (
    LOST_CODES,
    PACKAGE_METRICS,
    TRANSIENT_CODES,
    Calls,
    Chosen,
    Extractor,
    Residency,
    Value,
    call_table,
    candidate_table,
    describe,
    error_code,
    probe_sources,
    text,
    watts,
)
from charllm_nemo.devices.base import ActivityInput, Device, DeviceIdentity, UnsupportedLog
from charllm_nemo.devices.contract import METRIC_INDEX, METRIC_NAMES, Reading
from charllm_nemo.errors import BackendUnavailable, ConfigError, DeviceLost

log = logging.getLogger("charllm_nemo.devices.amdsmi")

_N = len(METRIC_NAMES)
PREFER_CHOICES: tuple[str, ...] = ("api", "gpu_metrics")


# -- the device ------------------------------------------------------------------------------

Plan = tuple[tuple[str, Callable[[], Any], tuple[tuple[int, Extractor], ...]], ...]


class AmdSmiDevice:
    """One AMD GPU (one die of a multi-die package). ``read()`` makes only the probed calls."""

    def __init__(
        self, identity: DeviceIdentity, plan: Plan, supported: dict[str, bool], lost_after: int
    ) -> None:
        self.identity = identity
        self._plan = plan
        self._supported = supported
        self._lost_after = lost_after
        self._all_failed = 0
        self._logged: set[str] = set()

    def supported_metrics(self) -> dict[str, bool]:
        return dict(self._supported)

    def read(self) -> Reading:
        """One value per schema metric, in schema units; None where absent. Raises only DeviceLost."""
        out: list[Value] = [None] * _N
        hard = 0
        for fn_name, call, extractors in self._plan:
            try:
                r = call()
            except Exception as exc:
                hard += self._failed(fn_name, exc)
                continue
            for i, ex in extractors:
                try:
                    out[i] = ex(r)
                except Exception as exc:
                    self._note(fn_name, exc)
        if hard and hard == len(self._plan):
            # A GPU whose sysfs files vanished fails every call with ENOENT, which amdsmi
            # reports as NOT_SUPPORTED: several reads in a row with nothing working is a loss.
            self._all_failed += 1
            if self._all_failed >= self._lost_after:
                raise DeviceLost(
                    f"AMD GPU {self.identity.index} ({self.identity.extra.get('bdf')}): every amdsmi "
                    f"call failed in {self._all_failed} reads in a row; treating the device as gone"
                )
        else:
            self._all_failed = 0
        return tuple(out)

    def _failed(self, fn_name: str, exc: Exception) -> int:
        code = error_code(exc)
        if code in LOST_CODES:
            raise DeviceLost(
                f"AMD GPU {self.identity.index} ({self.identity.extra.get('bdf')}): {fn_name} returned "
                f"{describe(exc)}; the device, its driver or the amdsmi session is gone"
            ) from exc
        self._note(fn_name, exc)
        return 0 if code is None or code in TRANSIENT_CODES else 1

    def _note(self, fn_name: str, exc: Exception) -> None:
        if fn_name in self._logged:
            return
        self._logged.add(fn_name)
        log.warning(
            "device %d: %s failed (%s); its metrics are null for this sample (later failures of "
            "this call are not logged)",
            self.identity.index,
            fn_name,
            describe(exc),
        )


class AmdSmiBackend:
    """An initialized amdsmi session and the GPUs opened through it."""

    name = "amdsmi"

    def __init__(self, smi: ModuleType, devices: list[AmdSmiDevice]) -> None:
        self.devices: list[Device] = list(devices)
        self._smi = smi
        self.activity: ActivityInput | None = None  # a GPU measures its own activity
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """amdsmi_shut_down, once; later calls do nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _shut_down_quietly(self._smi)


# -- opening ---------------------------------------------------------------------------------


def import_amdsmi() -> ModuleType:
    """Import the vendor package, turning every way it fails into BackendUnavailable.

    Without ROCm the PyPI wrapper prints two lines to stdout and then raises KeyError
    ('libamd_smi.so'), not ImportError; the lines are captured and put in the message.
    """
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            return importlib.import_module("amdsmi")
    except ImportError as exc:
        raise BackendUnavailable(
            f"the amdsmi Python package is not installed ({exc}): pip install 'charllm-nemo[amd]', "
            "choosing the amdsmi release that matches the host's ROCm (e.g. amdsmi==7.0.2 for ROCm 7.0.2)"
        ) from exc
    except KeyError as exc:
        said = " ".join(captured.getvalue().split())
        raise BackendUnavailable(
            f"the amdsmi Python package is installed but could not load ROCm's libamd_smi.so "
            f"(import raised KeyError({exc})"
            + (f"; it printed: {said}" if said else "")
            + "): install ROCm's amd-smi-lib (e.g. apt install amd-smi-lib) or set ROCM_PATH to the "
            "ROCm tree whose lib/ holds libamd_smi.so"
        ) from exc
    except Exception as exc:  # OSError, or AttributeError for a symbol an older library lacks
        raise BackendUnavailable(
            f"importing amdsmi failed ({type(exc).__name__}: {exc}); the amdsmi Python package and "
            "ROCm's libamd_smi.so probably come from different releases: install the amdsmi "
            "version that matches ROCm (amd-smi version shows it)"
        ) from exc
    finally:
        if captured.getvalue().strip():
            log.debug("import amdsmi printed: %s", captured.getvalue().strip())


def _shut_down_quietly(smi: ModuleType) -> None:
    try:
        smi.amdsmi_shut_down()
    except Exception as exc:
        log.debug("amdsmi_shut_down failed: %s", describe(exc))


def _init_hint(code: int | None) -> str:
    if code in (4, 18, 34):
        return "the amdgpu kernel driver looks absent: check `lsmod | grep amdgpu` and `dmesg | grep amdgpu`"
    if code == 10:
        return (
            "permission denied: add this user to the render and video groups "
            "(or give the container /dev/kfd and /dev/dri)"
        )
    return "check that `amd-smi list` works on this host"


def _call(smi: ModuleType, fn_name: str, *args: Any) -> Any:
    fn = getattr(smi, fn_name, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except Exception:
        return None


def _field(d: Any, key: str) -> Any:
    return d.get(key) if isinstance(d, dict) else None


def _is_gpu(smi: ModuleType, h: Any) -> bool:
    kind = _field(_call(smi, "amdsmi_get_processor_type", h), "processor_type")
    return not (isinstance(kind, str) and ("CPU" in kind or "NIC" in kind))


def _package_key(smi: ModuleType, h: Any) -> str | None:
    """Dies of one package share the board's FRU serial (the ASIC serial is the fallback)."""
    serial = text(_field(_call(smi, "amdsmi_get_gpu_board_info", h), "product_serial"))
    if serial is None:
        serial = text(_field(_call(smi, "amdsmi_get_gpu_asic_info", h), "asic_serial"))
    return serial


def _reports_power(smi: ModuleType, h: Any) -> bool:
    for fn_name in ("amdsmi_get_power_info", "amdsmi_get_gpu_metrics_info"):
        d = _call(smi, fn_name, h)
        for key in ("current_socket_power", "average_socket_power"):
            w = watts(_field(d, key))
            if w is not None and w > 0:
                return True
    return False


def _select(indices: Sequence[int] | None, count: int) -> list[int]:
    if indices is None:
        return list(range(count))
    chosen: list[int] = []
    bad: list[Any] = []
    for i in indices:  # ints, or integer-likes such as numpy.int64; not bools
        if isinstance(i, bool):
            bad.append(i)
            continue
        try:
            chosen.append(operator.index(i))
        except TypeError:
            bad.append(i)
    bad += [i for i in chosen if not 0 <= i < count]
    if bad:
        raise ConfigError(
            f"telemetry device indices {bad} are out of range: amdsmi sees {count} AMD GPU(s) on this "
            f"host, so valid indices are 0..{count - 1} (or leave indices unset for all)"
        )
    dupes = sorted({i for i in chosen if chosen.count(i) > 1})
    if dupes:
        raise ConfigError(f"telemetry device indices list {dupes} more than once; list each GPU once")
    return chosen


def _lib_version(smi: ModuleType) -> str | None:
    v = _call(smi, "amdsmi_get_lib_version")
    if not isinstance(v, dict):
        return None
    parts = [v.get(k) for k in ("major", "minor", "release")]
    return ".".join(str(p) for p in parts) if all(isinstance(p, int) for p in parts) else None


def _static_extra(smi: ModuleType, h: Any) -> dict[str, Any]:
    """Cheap facts worth keeping in the manifest (None where amdsmi does not say)."""
    asic = _call(smi, "amdsmi_get_gpu_asic_info", h)
    enum = _call(smi, "amdsmi_get_gpu_enumeration_info", h)
    xgmi = _call(smi, "amdsmi_get_xgmi_info", h)
    vram = getattr(getattr(smi, "AmdSmiMemoryType", None), "VRAM", None)
    total = _call(smi, "amdsmi_get_gpu_memory_total", h, vram) if vram is not None else None
    partition = _call(smi, "amdsmi_get_gpu_compute_partition", h)

    def num(v: Any) -> int | None:
        return v if type(v) is int else None

    hive = num(_field(xgmi, "xgmi_hive_id"))
    return {
        "bdf": text(_call(smi, "amdsmi_get_gpu_device_bdf", h)),
        "hip_id": num(_field(enum, "hip_id")),
        "drm_card": num(_field(enum, "drm_card")),
        "drm_render": num(_field(enum, "drm_render")),
        "gfx_target": text(_field(asic, "target_graphics_version")),
        "compute_units": num(_field(asic, "num_compute_units")),
        "oam_id": num(_field(asic, "oam_id")),
        "vram_total_bytes": num(total),
        "compute_partition": text(partition),
        "xgmi_hive_id": f"{hive:#x}" if hive else None,
        "xgmi_node_id": num(_field(xgmi, "xgmi_node_id")),
    }


def open_backend(
    indices: Sequence[int] | None = None,
    *,
    prefer: str = "api",
    lost_after: int = 3,
    **unknown: Any,
) -> AmdSmiBackend:
    """Initialize amdsmi (GPUs only) and open the GPUs at ``indices`` (amdsmi order; None = all).

    ``prefer``: ``"api"`` reads each metric through its dedicated amdsmi call, falling back to
    gpu_metrics; ``"gpu_metrics"`` reads gpu_metrics first (fewer calls per sample).
    ``lost_after``: consecutive reads in which every call fails before the device counts as lost.
    Raises BackendUnavailable (no package, no ROCm library, no driver, no GPU) or ConfigError.
    """
    if unknown:
        raise ConfigError(
            f"unknown amdsmi backend option(s) {sorted(unknown)}; the options are prefer= and lost_after="
        )
    if prefer not in PREFER_CHOICES:
        raise ConfigError(f"amdsmi prefer={prefer!r}; use one of {', '.join(PREFER_CHOICES)}")
    if isinstance(lost_after, bool) or not isinstance(lost_after, int) or lost_after < 1:
        raise ConfigError(f"amdsmi lost_after={lost_after!r} must be an integer >= 1")
    smi = import_amdsmi()
    try:
        smi.amdsmi_init(smi.AmdSmiInitFlags.INIT_AMD_GPUS)
    except Exception as exc:
        raise BackendUnavailable(
            f"amdsmi_init(INIT_AMD_GPUS) failed with {describe(exc)}: {_init_hint(error_code(exc))}"
        ) from exc
    try:
        devices = _open_devices(smi, indices, prefer, lost_after)
    except BaseException:
        _shut_down_quietly(smi)
        raise
    return AmdSmiBackend(smi, devices)


def _open_devices(
    smi: ModuleType, indices: Sequence[int] | None, prefer: str, lost_after: int
) -> list[AmdSmiDevice]:
    try:
        handles = [h for h in smi.amdsmi_get_processor_handles() if _is_gpu(smi, h)]
    except Exception as exc:
        raise BackendUnavailable(f"amdsmi_get_processor_handles failed with {describe(exc)}") from exc
    if not handles:
        raise BackendUnavailable(
            "amdsmi is initialized but sees no AMD GPU on this host: check `amd-smi list`; in a "
            "container pass /dev/kfd and /dev/dri"
        )
    selected = _select(indices, len(handles))
    keys = [_package_key(smi, h) for h in handles]
    members: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        if k is not None:
            members.setdefault(k, []).append(i)

    probes: dict[int, tuple[Calls, Chosen, dict[str, str], dict[str, Any]]] = {}
    reports: dict[int, bool] = {}
    for i in selected:
        calls = call_table(smi, handles[i])
        chosen, reasons, results = probe_sources(calls, candidate_table(Residency()), prefer)
        probes[i] = (calls, chosen, reasons, results)
        reports[i] = "power_instant_w" in chosen or "power_avg_w" in chosen
    for i in selected:
        for j in members.get(keys[i] or "", []):
            if j not in reports:
                reports[j] = _reports_power(smi, handles[j])

    unsupported = UnsupportedLog()
    py_version = getattr(smi, "__version__", None)
    lib_version = _lib_version(smi)
    devices = []
    for i in selected:
        calls, chosen, reasons, results = probes[i]
        group = members.get(keys[i] or "", [i])
        carriers = [j for j in group if reports.get(j, False)]
        if reports[i]:
            scope = "package" if len(group) > 1 and carriers == [i] else "device"
            carrier: int | None = i
        else:
            scope = "none"
            carrier = carriers[0] if len(carriers) == 1 else None
            if carriers and len(group) > 1:
                # Power and energy of a package come from one die; the others must not copy it.
                who = f"device {carrier}" if carrier is not None else f"devices {carriers}"
                for name in PACKAGE_METRICS:
                    chosen.pop(name, None)
                    reasons[name] = f"reported for the whole package by {who}"
        for name in METRIC_NAMES:
            if name in reasons:
                unsupported(i, name, reasons[name])
        identity = _identity(smi, handles[i], i, chosen, results, py_version, lib_version, prefer)
        identity.extra.update(
            {
                "package_id": keys[i],
                "package_dies": group,
                "power_scope": scope,
                "package_power_die": carrier,
            }
        )
        by_call: dict[str, list[tuple[int, Extractor]]] = {}
        for name, (key, _label, ex) in chosen.items():
            by_call.setdefault(key, []).append((METRIC_INDEX[name], ex))
        plan: Plan = tuple((calls[key][0], calls[key][1], tuple(exs)) for key, exs in by_call.items())
        supported = {name: name in chosen for name in METRIC_NAMES}
        devices.append(AmdSmiDevice(identity, plan, supported, lost_after))
    return devices


def _identity(
    smi: ModuleType,
    h: Any,
    index: int,
    chosen: Chosen,
    results: dict[str, Any],
    py_version: Any,
    lib_version: str | None,
    prefer: str,
) -> DeviceIdentity:
    asic = _call(smi, "amdsmi_get_gpu_asic_info", h)
    board = _call(smi, "amdsmi_get_gpu_board_info", h)
    name = text(_field(asic, "market_name")) or text(_field(board, "product_name")) or "AMD GPU"
    driver = text(_field(_call(smi, "amdsmi_get_gpu_driver_info", h), "driver_version"))
    resolution = _field(results.get("energy_count"), "counter_resolution")
    instant = chosen.get("power_instant_w")
    extra = _static_extra(smi, h)
    extra.update(
        {
            "energy_counter_resolution_uj": float(resolution) if type(resolution) in (int, float) else None,
            "power_instant_source": (
                None
                if instant is None
                else ("gpu_metrics:" if instant[0] == "gpu_metrics" else "") + instant[1]
            ),
            "throttle_source": "gpu_metrics residency counters" if "throttle_reasons" in chosen else None,
            "prefer": prefer,
            "amdsmi_version": py_version if isinstance(py_version, str) else None,
            "amdsmi_lib_version": lib_version,
        }
    )
    return DeviceIdentity(
        index=index,
        name=name,
        vendor="amd",
        backend="amdsmi",
        uuid=text(_call(smi, "amdsmi_get_gpu_device_uuid", h)),
        driver_version=driver,
        extra=extra,
    )
