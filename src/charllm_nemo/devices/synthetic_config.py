"""Heterogeneity of synthetic devices: per-rank cooling, power limit and injected throttling.

The Hydra shape (``telemetry.synthetic``, docs/devices.md "Heterogeneous devices")::

    telemetry:
      synthetic:
        slowdown: null          # null = on when any device below is set; true | false
        devices:                # keyed by the GLOBAL RANK whose synthetic device it sets
          "1":
            cooling: 0.5        # cooling effectiveness: thermal resistance = default / cooling
            power_limit_w: 600  # null = the model's 700 W
            tau_s: 2.0          # thermal time constant of the die (HBM: twice it); null = 20 s
            ambient_c: null     # inlet temperature; null = 30 C
            throttle:           # injected throttle windows, by step or by seconds
              - {steps: [3, 6], reasons: [hw_slowdown], clock_factor: 0.5}
              - {seconds: [10, 12.5], reasons: [hw_power_brake]}

On the command line a device is added with Hydra's ``++`` (the key is new to the config):
``++telemetry.synthetic.devices.1.cooling=0.5``.

Framework-free: plain dataclasses, the checks (:func:`synthetic_problems`, each message naming
the field, its value and a fix), and :func:`synthetic_options`, the keyword arguments of
``devices.synthetic.open_backend`` for one rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from charllm_nemo.devices.contract import THROTTLE_BITS

INJECTABLE_REASONS: tuple[str, ...] = (
    "sw_power_cap",
    "hw_slowdown",
    "sw_thermal",
    "hw_thermal",
    "hw_power_brake",
)
"""Throttle reasons an injected window may set: the limiting ones (NVML's bit values)."""

THERMAL_REASONS = frozenset({"hw_slowdown", "sw_thermal", "hw_thermal"})
"""Injected reasons whose time counts in ``violation_thermal_ns`` (the others: power)."""


@dataclass
class ThrottleInjection:
    """One injected throttle window of a synthetic device.

    Exactly one of ``steps`` (``[first, last]``, inclusive, counted from 0 at the first step the
    rank marks) and ``seconds`` (``[begin, end)``, seconds since the first step began). While it
    is on, the device sets ``reasons`` (names of :data:`INJECTABLE_REASONS`) and its SM clock
    runs at ``clock_factor`` (0..1] of what it would be, its dynamic power at the cube of it."""

    steps: list[int] | None = None
    seconds: list[float] | None = None
    reasons: list[str] = field(default_factory=lambda: ["hw_slowdown"])
    clock_factor: float = 0.5


@dataclass
class SyntheticDeviceConfig:
    """What makes one rank's synthetic device differ from the default model
    (``devices.synthetic.SyntheticParams``). ``cooling``: how well it is cooled, relative to the
    default (1.0); its thermal resistance (°C/W, die and HBM) is the default's divided by it, so
    0.5 runs twice as far above ambient. ``power_limit_w`` (W), ``tau_s`` (s, the die's thermal
    time constant; HBM's is twice it), ``ambient_c`` (°C): None keeps the model's. ``throttle``:
    injected throttle windows (:class:`ThrottleInjection`)."""

    cooling: float = 1.0
    power_limit_w: float | None = None
    tau_s: float | None = None
    ambient_c: float | None = None
    throttle: list[ThrottleInjection] = field(default_factory=list)


@dataclass
class SyntheticConfig:
    """``telemetry.synthetic``: heterogeneity of the synthetic devices, by global rank.

    ``devices``: ``{"<rank>": SyntheticDeviceConfig}`` (string keys: Hydra's command line makes
    them so). ``slowdown``: whether a synthetic device slows its rank's training thread in
    proportion to its clock (a simulation: the compute phases run longer by ``max clock / clock
    - 1`` of their last length; docs/devices.md); None = on when ``devices`` sets any rank, off
    otherwise (a uniform fleet runs as before)."""

    slowdown: bool | None = None
    devices: dict[str, SyntheticDeviceConfig] = field(default_factory=dict)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _field(cfg: Any, name: str) -> Any:
    return cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)


def _device_problems(key: str, dev: Any, prefix: str) -> list[str]:
    p = f"{prefix}.devices.{key}"
    out: list[str] = []
    cooling = _field(dev, "cooling")
    if not _number(cooling) or not 0.05 <= cooling <= 20:
        out.append(
            f"{p}.cooling={cooling!r} must be a number in [0.05, 20] (1 = the default cooling; 0.5 "
            "= half as effective, the device runs hotter)"
        )
    for name, lo, hi, unit in (("power_limit_w", 50.0, 2000.0, "W"), ("tau_s", 0.01, 3600.0, "s")):
        v = _field(dev, name)
        if v is not None and (not _number(v) or not lo <= v <= hi):
            out.append(f"{p}.{name}={v!r} must be null or a number in [{lo:g}, {hi:g}] {unit}")
    amb = _field(dev, "ambient_c")
    if amb is not None and (not _number(amb) or not -20 <= amb <= 80):
        out.append(f"{p}.ambient_c={amb!r} must be null or a temperature in [-20, 80] C")
    windows = _field(dev, "throttle") or []
    if not isinstance(windows, (list, tuple)):
        return [*out, f"{p}.throttle={windows!r} must be a list of windows, e.g. [{{steps: [3, 6]}}]"]
    for i, w in enumerate(windows):
        out.extend(_window_problems(w, f"{p}.throttle.{i}"))
    return out


def _range_ok(r: Any, integer: bool) -> bool:
    if not isinstance(r, (list, tuple)) or len(r) != 2 or not all(_number(v) and v >= 0 for v in r):
        return False
    if integer and not all(float(v).is_integer() for v in r):
        return False
    return bool(r[0] <= r[1]) if integer else bool(r[0] < r[1])


def _window_problems(w: Any, p: str) -> list[str]:
    out: list[str] = []
    steps, seconds = _field(w, "steps"), _field(w, "seconds")
    if (steps is None) == (seconds is None):
        out.append(f"{p}: give exactly one of steps: [first, last] or seconds: [begin, end)")
    elif steps is not None and not _range_ok(steps, True):
        out.append(f"{p}.steps={steps!r} must be [first, last]: two step numbers >= 0, first <= last")
    elif seconds is not None and not _range_ok(seconds, False):
        out.append(f"{p}.seconds={seconds!r} must be [begin, end): two times >= 0 (s), begin < end")
    reasons = _field(w, "reasons")
    if (
        not isinstance(reasons, (list, tuple))
        or not reasons
        or any(r not in INJECTABLE_REASONS for r in reasons)
    ):
        out.append(f"{p}.reasons={reasons!r} must be a non-empty list of {list(INJECTABLE_REASONS)}")
    f = _field(w, "clock_factor")
    if not _number(f) or not 0.05 <= f <= 1.0:
        out.append(f"{p}.clock_factor={f!r} must be a number in [0.05, 1] (the share of the clock left)")
    return out


def synthetic_problems(cfg: Any, prefix: str = "telemetry.synthetic") -> list[str]:
    """Every problem of a :class:`SyntheticConfig` (or the same shape as plain dicts), one
    message each naming ``<prefix>.<field>``, the value and a fix; empty when valid."""
    out: list[str] = []
    slowdown = _field(cfg, "slowdown")
    if slowdown is not None and not isinstance(slowdown, bool):
        out.append(f"{prefix}.slowdown={slowdown!r} must be true, false or null (auto)")
    devices = _field(cfg, "devices") or {}
    if not isinstance(devices, dict):
        return [
            *out,
            f"{prefix}.devices={devices!r} must map a rank to its device, e.g. {{'1': {{cooling: 0.5}}}}",
        ]
    for key, dev in devices.items():
        if not str(key).isdigit():
            out.append(f"{prefix}.devices has key {key!r}; keys are global ranks (0, 1, ...)")
            continue
        out.extend(_device_problems(str(key), dev, prefix))
    return out


def device_config_for_rank(cfg: SyntheticConfig, rank: int) -> SyntheticDeviceConfig | None:
    """The entry of ``rank`` in ``cfg.devices`` (keys compared as integers), or None."""
    for key, dev in cfg.devices.items():
        if str(key).isdigit() and int(key) == rank:
            return dev
    return None


def slowdown_on(cfg: SyntheticConfig) -> bool:
    """``cfg.slowdown``, or for None: whether any rank's device is set."""
    return bool(cfg.devices) if cfg.slowdown is None else bool(cfg.slowdown)


def injection_tuples(windows: list[ThrottleInjection]) -> tuple[tuple[Any, ...], ...]:
    """Picklable form of injected windows (they cross into the telemetry process):
    ``(kind, begin, end, reason_bits, clock_factor)``, kind ``steps`` or ``seconds``."""
    out: list[tuple[Any, ...]] = []
    for w in windows:
        bits = 0
        for r in w.reasons:
            bits |= THROTTLE_BITS[r]
        if w.steps is not None:
            out.append(("steps", int(w.steps[0]), int(w.steps[1]), bits, float(w.clock_factor)))
        elif w.seconds is not None:
            out.append(("seconds", float(w.seconds[0]), float(w.seconds[1]), bits, float(w.clock_factor)))
    return tuple(out)


def synthetic_options(cfg: SyntheticConfig, rank: int) -> dict[str, Any]:
    """``devices.synthetic.open_backend`` keywords for ``rank``'s device: ``params`` (the
    default model with its cooling, limit, time constant, ambient), ``throttle`` (injected
    windows) and ``slowdown``; empty when nothing is set (the default model, no slowdown)."""
    from charllm_nemo.devices.synthetic import SyntheticParams

    on = slowdown_on(cfg)
    dev = device_config_for_rank(cfg, rank)
    if dev is None and not on:
        return {}
    options: dict[str, Any] = {"slowdown": on}
    if dev is None:
        return options
    base = SyntheticParams()
    changes: dict[str, Any] = {
        "r_gpu_c_per_w": base.r_gpu_c_per_w / dev.cooling,
        "r_hbm_c_per_w": base.r_hbm_c_per_w / dev.cooling,
    }
    if dev.power_limit_w is not None:
        changes["power_limit_w"] = float(dev.power_limit_w)
    if dev.tau_s is not None:
        changes["tau_gpu_s"] = float(dev.tau_s)
        changes["tau_hbm_s"] = 2.0 * float(dev.tau_s)
    if dev.ambient_c is not None:
        changes["ambient_c"] = float(dev.ambient_c)
    options["params"] = replace(base, **changes)
    if dev.throttle:
        options["throttle"] = injection_tuples(dev.throttle)
    return options
