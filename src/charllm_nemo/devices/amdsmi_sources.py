"""Where each AMD metric can come from, and how a value is picked out of amdsmi's answer.

* :func:`call_table`: the amdsmi calls one GPU can make, as zero-argument callables;
* :func:`candidate_table`: per schema metric, the (call, field, extractor) candidates, best first;
* the value helpers that turn amdsmi's fields (``"N/A"`` for missing) into schema units, and
  :class:`Residency`, which turns gpu_metrics residency accumulators into throttle bits and
  violation time;
* :func:`probe_sources`: calls each needed function once at open and keeps, per metric, the first
  candidate that gives a value;
* amdsmi's status codes (:func:`error_code`, :func:`describe`).

:mod:`charllm_nemo.devices.amdsmi` opens the devices, builds the read plan from the probe's
choice and samples through it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from fractions import Fraction
from types import ModuleType
from typing import Any

from charllm_nemo.devices.contract import METRIC_NAMES, THROTTLE_BITS

Value = float | int | None
Extractor = Callable[[Any], Value]
# (call key, field label, factory: the probe's result of that call -> the extractor, or None)
Candidate = tuple[str, str, Callable[[Any], Extractor | None]]


# -- amdsmi status codes ----------------------------------------------------------------------

# amdsmi_status_t values from amdsmi.h (the C ABI; the Python wrapper raises
# AmdSmiLibraryException(code) and get_error_code() gives them back).
_STATUS = """1 INVAL 2 NOT_SUPPORTED 3 NOT_YET_IMPLEMENTED 4 FAIL_LOAD_MODULE 5 FAIL_LOAD_SYMBOL
6 DRM_ERROR 7 API_FAILED 8 TIMEOUT 9 RETRY 10 NO_PERM 11 INTERRUPT 12 IO 14 FILE_ERROR 18 INIT_ERROR
30 BUSY 31 NOT_FOUND 32 NOT_INIT 34 DRIVER_NOT_LOADED 40 NO_DATA 42 UNEXPECTED_SIZE 43 UNEXPECTED_DATA
4294967295 UNKNOWN_ERROR""".split()  # noqa: SIM905 (a table, easier to read as text)
STATUS_NAMES: dict[int, str] = {
    int(code): f"AMDSMI_STATUS_{name}" for code, name in zip(_STATUS[::2], _STATUS[1::2], strict=True)
}
# The processor is gone (31), its driver is unloaded (34), or the library was shut down (32).
LOST_CODES: frozenset[int] = frozenset({31, 32, 34})
# Worth another try next sample; never evidence that the device is gone.
TRANSIENT_CODES: frozenset[int] = frozenset({8, 9, 11, 30})


def error_code(exc: BaseException) -> int | None:
    """The amdsmi_status_t of an AmdSmiLibraryException, else None."""
    get = getattr(exc, "get_error_code", None)
    if get is None:
        return None
    try:
        code = get()
    except Exception:
        return None
    return code if isinstance(code, int) else None


def describe(exc: BaseException) -> str:
    code = error_code(exc)
    if code is None:
        return f"{type(exc).__name__}: {exc}"
    return f"{STATUS_NAMES.get(code, 'amdsmi status')} ({code})"


# -- units, and what belongs to a package or is not exposed at all --------------------------

XGMI_KB = 1024  # gpu_metrics xgmi_*_data_acc are in KB (taken as KiB, as amdsmi's MB are MiB)
MIB = 1024 * 1024
_NA_SENTINELS = frozenset({0xFFFF, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF})
# Metrics a die of a multi-die package may not report: they belong to the package.
PACKAGE_METRICS: tuple[str, ...] = ("power_instant_w", "power_avg_w", "energy_mj")

NOT_EXPOSED: dict[str, str] = {
    "power_memory_w": "amdsmi reports no memory-rail power",
    "power_module_w": "amdsmi has no module power scope (an APU's socket power is power_instant_w)",
    "power_module_avg_w": "amdsmi has no module power scope",
    "pcie_tx_bytes": (
        "amdsmi has no cumulative PCIe byte counter (gpu_metrics pcie_bandwidth_acc is an "
        "accumulated GB/s figure with no direction; amdsmi_get_gpu_pci_throughput blocks ~1 s)"
    ),
    "pcie_rx_bytes": "amdsmi has no cumulative PCIe byte counter (see pcie_tx_bytes)",
}


# -- value helpers: amdsmi marks a missing value with the string "N/A" ---------------------


def _float(v: Any) -> float | None:
    t = type(v)
    return float(v) if t is int or t is float else None


def watts(v: Any) -> float | None:
    # power_info maps only 0xFFFF to "N/A"; a uint32 all-ones would otherwise be 4 GW.
    t = type(v)
    if (t is int or t is float) and 0 <= v < 0xFFFF:
        return float(v)
    return None


def _pct(v: Any) -> float | None:
    t = type(v)
    if (t is int or t is float) and 0 <= v <= 100:
        return float(v)
    return None


def _limit_w(v: Any) -> float | None:
    """A power cap in W from a value in µW (Linux bare metal) or W (virtualization host).

    amdsmi.h documents ``power_cap`` as µW on bare metal and W on a host, and amd_smi.cc fills
    ``power_info.power_limit`` from the raw hwmon ``power1_cap`` (µW) in some releases and in W
    in others. A GPU's cap is below 10 kW and above 10 mW, so the magnitude tells them apart.
    """
    if type(v) is not int and type(v) is not float:
        return None
    if v <= 0 or v in _NA_SENTINELS:
        return None
    return v / 1e6 if v >= 10_000 else float(v)


def text(v: Any) -> str | None:
    if not isinstance(v, str):
        return None
    v = v.strip()
    return None if v in ("", "N/A") else v


def _key(key: str, conv: Callable[[Any], Value]) -> Callable[[Any], Extractor]:
    def make(probe_sources: Any) -> Extractor:
        def ex(r: Any) -> Value:
            return conv(r[key])

        return ex

    return make


def _whole(conv: Callable[[Any], Value]) -> Callable[[Any], Extractor]:
    return lambda probe_sources: conv


def _energy(probe: Any) -> Extractor | None:
    """mJ = ticks * resolution_uJ / 1000, exactly: the resolution is a C float (a dyadic rational)."""
    res = probe.get("counter_resolution") if isinstance(probe, dict) else None
    if type(res) is not float and type(res) is not int:
        return None
    if res <= 0:
        return None
    frac = Fraction(res)
    num, den = frac.numerator, frac.denominator * 1000

    def ex(r: Any) -> Value:
        acc = r["energy_accumulator"]
        return (acc * num) // den if type(acc) is int else None

    return ex


def _xgmi(key: str) -> Callable[[Any], Extractor]:
    def make(probe_sources: Any) -> Extractor:
        def ex(r: Any) -> Value:
            links = r[key]
            if type(links) is not list:
                return None
            total, seen = 0, False
            for v in links:
                if type(v) is int:
                    total += v
                    seen = True
            return total * XGMI_KB if seen else None

        return ex

    return make


class Residency:
    """Throttle bits and violation time from the gpu_metrics residency accumulators.

    gpu_metrics (v1.6+, MI300 and later) counts firmware cycles (``accumulation_counter``) and,
    per limiter, the cycles it held the clock. A limiter whose count advanced since the last
    fresh snapshot sets its bit; violation time integrates the fraction held over the GPU's own
    clock (``system_clock_counter``, ns): ``dt * d(residency) / d(accumulation)``, summed since
    open. A snapshot that has not advanced (firmware updates about once a millisecond) keeps
    the previous bits.
    """

    FIELDS: tuple[tuple[str, int], ...] = (
        ("ppt_residency_acc", THROTTLE_BITS["sw_power_cap"]),  # package power tracking (PVIOL)
        ("socket_thm_residency_acc", THROTTLE_BITS["sw_thermal"]),  # socket thermal (TVIOL)
        ("hbm_thm_residency_acc", THROTTLE_BITS["hw_thermal"]),
        ("vr_thm_residency_acc", THROTTLE_BITS["hw_thermal"]),
        ("prochot_residency_acc", THROTTLE_BITS["hw_slowdown"]),  # PROCHOT, an external signal
    )

    def __init__(self, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self._clock = clock
        self._seen: Any = None
        self._prev: tuple[int, int, tuple[Any, ...]] | None = None
        self.mask: int | None = None
        # The cumulative totals, kept across snapshots that say nothing (N/A) or a reset; what
        # a sample reports (power_ns / thermal_ns) is None while the snapshot says nothing.
        self._power_total: int | None = None
        self._thermal_total: int | None = None
        self._known = False

    @property
    def power_ns(self) -> int | None:
        return self._power_total if self._known else None

    @property
    def thermal_ns(self) -> int | None:
        return self._thermal_total if self._known else None

    def update(self, r: Any) -> None:
        if r is self._seen:
            return
        self._seen = r
        acc = r["accumulation_counter"]
        vals = tuple(r[k] for k, _ in self.FIELDS)
        if type(acc) is not int or not any(type(v) is int for v in vals):
            # Says nothing: this sample has no bits or times; the totals wait for the next one
            # (which re-baselines: the cycles in between are not attributed to any limiter).
            self.mask = None
            self._prev = None
            self._known = False
            return
        self._known = True
        t = r["system_clock_counter"]
        if type(t) is not int:
            t = self._clock()
        prev = self._prev
        if prev is None or acc < prev[0]:  # first snapshot, after N/A, or counters reset (driver reload)
            self._prev = (acc, t, vals)
            self.mask = 0
            if type(vals[0]) is int and self._power_total is None:
                self._power_total = 0
            if type(vals[1]) is int and self._thermal_total is None:
                self._thermal_total = 0
            return
        p_acc, p_t, p_vals = prev
        d_acc = acc - p_acc
        if d_acc == 0:
            return
        self._prev = (acc, t, vals)
        mask = 0
        for (_, bit), v, pv in zip(self.FIELDS, vals, p_vals, strict=True):
            if type(v) is int and type(pv) is int and v > pv:
                mask |= bit
        self.mask = mask
        dt = t - p_t
        if dt > 0:
            if self._power_total is not None and type(vals[0]) is int and type(p_vals[0]) is int:
                self._power_total += (max(0, vals[0] - p_vals[0]) * dt) // d_acc
            if self._thermal_total is not None and type(vals[1]) is int and type(p_vals[1]) is int:
                self._thermal_total += (max(0, vals[1] - p_vals[1]) * dt) // d_acc

    def extractor(self, attr: str) -> Callable[[Any], Extractor]:
        def make(probe_sources: Any) -> Extractor:
            def ex(r: Any) -> Value:
                self.update(r)
                value: int | None = getattr(self, attr)
                return value

            return ex

        return make


def _k(call: str, field: str, conv: Callable[[Any], Value]) -> Candidate:
    return (call, field, _key(field, conv))


def candidate_table(res: Residency) -> dict[str, list[Candidate]]:
    """For each metric, where it can come from, best first (the "api" order)."""
    gm = "gpu_metrics"
    return {
        "power_instant_w": [
            _k("power_info", "current_socket_power", watts),
            _k("power_info", "average_socket_power", watts),
            _k(gm, "current_socket_power", watts),
            _k(gm, "average_socket_power", watts),
        ],
        "power_avg_w": [
            _k("power_info", "average_socket_power", watts),
            _k(gm, "average_socket_power", watts),
        ],
        "energy_mj": [("energy_count", "energy_accumulator", _energy)],
        "temp_gpu_c": [("temp_edge", "EDGE", _whole(_float)), _k(gm, "temperature_edge", _float)],
        "temp_hbm_c": [("temp_vram", "VRAM", _whole(_float)), _k(gm, "temperature_mem", _float)],
        "temp_hotspot_c": [
            ("temp_hotspot", "HOTSPOT", _whole(_float)),
            _k(gm, "temperature_hotspot", _float),
        ],
        "clock_sm_mhz": [_k("clock_gfx", "clk", _float), _k(gm, "current_gfxclk", _float)],
        "clock_mem_mhz": [_k("clock_mem", "clk", _float), _k(gm, "current_uclk", _float)],
        "throttle_reasons": [(gm, "residency counters", res.extractor("mask"))],
        "violation_power_ns": [(gm, "ppt_residency_acc", res.extractor("power_ns"))],
        "violation_thermal_ns": [(gm, "socket_thm_residency_acc", res.extractor("thermal_ns"))],
        "util_gpu_pct": [_k("activity", "gfx_activity", _pct), _k(gm, "average_gfx_activity", _pct)],
        "util_mem_pct": [_k("activity", "umc_activity", _pct), _k(gm, "average_umc_activity", _pct)],
        "mem_used_bytes": [
            ("memory_usage", "VRAM", _whole(lambda v: v if type(v) is int else None)),
            _k("vram_usage", "vram_used", lambda v: v * MIB if type(v) is int else None),
        ],
        "power_limit_w": [
            _k("power_info", "power_limit", _limit_w),
            _k("power_cap_info", "power_cap", _limit_w),
        ],
        "nvlink_tx_bytes": [(gm, "xgmi_write_data_acc", _xgmi("xgmi_write_data_acc"))],
        "nvlink_rx_bytes": [(gm, "xgmi_read_data_acc", _xgmi("xgmi_read_data_acc"))],
    }


def call_table(smi: ModuleType, h: Any) -> dict[str, tuple[str, Callable[[], Any]]]:
    """The amdsmi calls one device can make, by key: (name for logs, zero-argument callable)."""
    p = functools.partial

    def temp(sensor: str) -> Callable[[], Any]:
        kind = getattr(smi.AmdSmiTemperatureType, sensor)
        return p(smi.amdsmi_get_temp_metric, h, kind, smi.AmdSmiTemperatureMetric.CURRENT)

    def clock(clk: str) -> Callable[[], Any]:
        return p(smi.amdsmi_get_clock_info, h, getattr(smi.AmdSmiClkType, clk))

    builders: tuple[tuple[str, str, Callable[[], Callable[[], Any]]], ...] = (
        ("power_info", "amdsmi_get_power_info", lambda: p(smi.amdsmi_get_power_info, h)),
        ("energy_count", "amdsmi_get_energy_count", lambda: p(smi.amdsmi_get_energy_count, h)),
        ("temp_edge", "amdsmi_get_temp_metric(EDGE)", lambda: temp("EDGE")),
        ("temp_hotspot", "amdsmi_get_temp_metric(HOTSPOT)", lambda: temp("HOTSPOT")),
        ("temp_vram", "amdsmi_get_temp_metric(VRAM)", lambda: temp("VRAM")),
        ("clock_gfx", "amdsmi_get_clock_info(GFX)", lambda: clock("GFX")),
        ("clock_mem", "amdsmi_get_clock_info(MEM)", lambda: clock("MEM")),
        ("activity", "amdsmi_get_gpu_activity", lambda: p(smi.amdsmi_get_gpu_activity, h)),
        (
            "memory_usage",
            "amdsmi_get_gpu_memory_usage(VRAM)",
            lambda: p(smi.amdsmi_get_gpu_memory_usage, h, smi.AmdSmiMemoryType.VRAM),
        ),
        ("vram_usage", "amdsmi_get_gpu_vram_usage", lambda: p(smi.amdsmi_get_gpu_vram_usage, h)),
        ("power_cap_info", "amdsmi_get_power_cap_info", lambda: p(smi.amdsmi_get_power_cap_info, h)),
        ("gpu_metrics", "amdsmi_get_gpu_metrics_info", lambda: p(smi.amdsmi_get_gpu_metrics_info, h)),
    )
    table: dict[str, tuple[str, Callable[[], Any]]] = {}
    for key, name, build in builders:
        try:
            table[key] = (name, build())
        except AttributeError:  # an older amdsmi without this function or enum member
            continue
    return table


# -- probing ---------------------------------------------------------------------------------

Calls = dict[str, tuple[str, Callable[[], Any]]]
Chosen = dict[str, tuple[str, str, Extractor]]  # metric -> (call key, field label, extractor)


def probe_sources(
    calls: Calls, candidates: dict[str, list[Candidate]], prefer: str
) -> tuple[Chosen, dict[str, str], dict[str, Any]]:
    """Call each needed function once; keep, per metric, the first candidate that gives a value.

    Returns (chosen, reasons for the metrics nothing serves, the probe's results by call key).
    A package metric (power, energy) that reads 0 counts as not reported: an Instinct GPU never
    draws 0 W and its energy counter runs from driver load, so 0 is a die that does not report.
    """
    results: dict[str, Any] = {}
    chosen: Chosen = {}
    reasons: dict[str, str] = {}
    for name in METRIC_NAMES:
        if name in NOT_EXPOSED:
            reasons[name] = NOT_EXPOSED[name]
            continue
        cands = candidates.get(name, [])
        if prefer == "gpu_metrics":
            cands = sorted(cands, key=lambda c: c[0] != "gpu_metrics")
        why: list[str] = []
        for key, label, make in cands:
            if key not in calls:
                why.append(f"{key}: not in this amdsmi")
                continue
            fn_name = calls[key][0]
            if key not in results:
                try:
                    results[key] = calls[key][1]()
                except Exception as exc:
                    results[key] = exc
            r = results[key]
            if isinstance(r, BaseException):
                why.append(f"{fn_name}: {describe(r)}")
                continue
            try:
                ex = make(r)
                value = ex(r) if ex is not None else None
            except Exception as exc:
                why.append(f"{fn_name}[{label}]: {type(exc).__name__}: {exc}")
                continue
            if value is None:
                why.append(f"{fn_name}[{label}]: N/A")
            elif name in PACKAGE_METRICS and value == 0:
                why.append(f"{fn_name}[{label}]: reads 0")
            elif ex is not None:
                chosen[name] = (key, label, ex)
                break
        else:
            reasons[name] = "; ".join(why) or "no amdsmi call provides it"
    return chosen, reasons, results
