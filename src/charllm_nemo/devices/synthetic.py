"""A synthetic accelerator: a small physical model for machines with no GPU.

It lets the whole pipeline (sampler, store, windows, attribution, sinks) run on a laptop or
in CI. It is a model, not a measurement, and says so: the backend name, every sample's
``source`` column and the manifest are ``synthetic``, and the factory warns once.

The model (defaults loosely follow an H200 SXM):

* demanded power ``P_d = idle_w + (peak_w - idle_w) * activity`` (550 W at full activity by
  default, well under the 700 W cap: no throttling unless a device is configured hot or
  capped lower); the delivered power is capped at ``power_limit_w``. Under the cap the SM
  clock scales as ``(P_avail / P_d_dyn) ** (1/3)``
  (dynamic power ~ f * V^2 ~ f^3) and ``sw_power_cap`` is set;
* the die temperature follows power through a first-order thermal model
  ``T -> T_amb + R * P`` with time constant ``tau_s``; HBM follows with its own R and tau;
  above ``temp_limit_c`` the clock drops by ``thermal_clock_factor`` and ``sw_thermal`` is set;
  at ``slowdown_c`` the clock is cut as far as it takes to hold the die there (the cut
  ``g <= 1`` that makes ``T_amb + R * P`` equal ``slowdown_c``), down to ``min_clock_factor``;
  where even that floor cannot hold it, ``hw_slowdown`` and ``hw_thermal`` are set, and at
  ``shutdown_c`` the device shuts down: ``read()`` raises DeviceLost, and it never reports a
  temperature above ``shutdown_c`` (docs/devices.md has the numbers: a device cooled 0.15 x
  holds at 90 C, one cooled under ~0.095 x shuts down);
* the energy counter integrates delivered power, published every ``energy_update_ms`` like
  real counters (so windows shorter than that need the power timeline, as on hardware);
* PCIe traffic grows with activity, so the 64-bit counter path is exercised end to end.

Activity comes from something real: the window marks the training loop reports (forward and
backward = 1.0, optimizer = 0.5, other phases 0.7, communication: pipeline send / receive and
gradient syncs = 0.15, inside a step otherwise = 0.3, no window = 0: compute high, communication
and pipeline bubbles low, so the power swings at the iteration period as a GPU's does), or this
process's CPU use, or a fixed number / callable for tests. When the device is read in a separate
sampling process, the marks cross over as one shared float64 (:class:`SharedActivity`) and
"this process" means the training process (``observe_pid``).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from charllm_nemo.devices.base import DeviceIdentity
from charllm_nemo.devices.contract import METRIC_NAMES, THROTTLE_BITS, Reading
from charllm_nemo.devices.factory import ProcessPlan
from charllm_nemo.devices.synthetic_activity import CpuActivity, SharedActivity, _rss_bytes
from charllm_nemo.errors import ConfigError, DeviceLost

ActivitySpec = str | float | Callable[[int], float]
Injection = tuple[str, float, float, int, float]
"""An injected throttle window: (``steps`` | ``seconds``, begin, end, reason bits, clock
factor); devices/synthetic_config.py's ``injection_tuples`` makes them from the config."""
_THERMAL_BITS = THROTTLE_BITS["hw_slowdown"] | THROTTLE_BITS["sw_thermal"] | THROTTLE_BITS["hw_thermal"]
_HW_THERMAL = THROTTLE_BITS["hw_slowdown"] | THROTTLE_BITS["hw_thermal"]
# Metrics after nvlink_rx_bytes (the per-reason violation counters and the driver's timestamps
# of their values): not modelled, null.
_NOT_MODELLED: tuple[None, ...] = (None,) * (len(METRIC_NAMES) - METRIC_NAMES.index("nvlink_rx_bytes") - 1)
_MAX_SEGMENTS = 16
"""Pieces one advance is cut into at the temperatures where the model changes (slowdown_c,
shutdown_c): each crossing moves to a higher one, so a few are ever needed; the cap only bounds
a pathological case (the rest of the interval is then left out of the integration)."""


@dataclass(frozen=True)
class SyntheticParams:
    """Physical constants of the model (units in the names)."""

    idle_w: float = 75.0
    # What full activity draws: well below the cap, as a real accelerator at a training load
    # (a tiny model on a CPU showed 657 W avg, peak 700 W, "throttle 100%" with 760 W here).
    # A power-limited or hot device is configured: power_limit_w, cooling (synthetic_config.py).
    peak_w: float = 550.0
    power_limit_w: float = 700.0
    ambient_c: float = 30.0
    r_gpu_c_per_w: float = 0.075
    tau_gpu_s: float = 20.0
    r_hbm_c_per_w: float = 0.06
    tau_hbm_s: float = 40.0
    temp_limit_c: float = 87.0
    thermal_clock_factor: float = 0.8
    # An H100's own thresholds are of this order (nvidia-smi -q: "GPU Max Operating Temp" 87 C,
    # "GPU Slowdown Temp", "GPU Shutdown Temp" a few degrees above it, all below 100 C).
    slowdown_c: float = 90.0
    min_clock_factor: float = 0.25
    shutdown_c: float = 92.0
    clock_max_mhz: float = 1980.0
    clock_idle_mhz: float = 345.0
    clock_mem_mhz: float = 2619.0
    energy_update_ms: float = 50.0
    avg_window_s: float = 1.0
    pcie_bytes_per_s_at_full: float = 4.0e9
    mem_total_bytes: int = 141 * 2**30


_LEVELS = (1.0, 0.7, 0.5, 0.15)
"""Activity of an open phase, highest first: forward / backward (compute), any other phase, the
optimizer (memory-bound), communication (pipeline send / receive ``pp-*``, waiting for the
neighbour stage included, and gradient syncs ``*grad-sync``: a GPU blocked in NCCL spins a few
SMs and draws little more than idle). The highest open one wins, so a sync overlapped with
backward draws compute power."""
_LEVEL_OF = {"forward": 0, "backward": 0, "optimizer": 2}  # index into _LEVELS; others: 1 or 3
_COMM = 3
_IN_STEP, _IDLE = 0.3, 0.0


def _level_index(name: str) -> int:
    """The index in :data:`_LEVELS` of phase ``name`` (the phase names of steps/marks.py)."""
    i = _LEVEL_OF.get(name)
    if i is not None:
        return i
    return _COMM if name.startswith("pp-") or name.endswith("grad-sync") else 1


class MarkActivity:
    """Activity from the training loop's window marks (attach with WindowRecorder.add_listener).

    ``on_change(level)``, when set, is called whenever a mark changes the level (the session
    uses it to publish the level to a synthetic device in its telemetry process): one call per
    change, not per mark, since marks run on the training thread. An ``on_change`` that raises
    ValueError or TypeError (where it publishes to was released: the session is stopping) is
    dropped. The level is the highest activity of the phases open (:data:`_LEVELS`: 1.0
    forward / backward, 0.7 other phases, 0.5 optimizer, 0.15 communication: ``pp-*`` send /
    receive and waits, ``*grad-sync``), 0.3 inside a step between phases, 0
    outside steps; kept as counts of open phases per activity, so a mark costs a few list
    operations."""

    def __init__(
        self, schedule: Sequence[Injection] = (), clock: Callable[[], int] = time.monotonic_ns
    ) -> None:
        self._open = [0] * len(_LEVELS)  # phases open per activity level
        self._index: dict[str, int] = {}  # phase name -> its _level_index, cached
        self._in_step = 0
        self.seen_any = False
        self.on_change: Callable[[float], object] | None = None
        self._published = -1.0
        self.schedule: tuple[Injection, ...] = tuple(schedule)
        self._clock = clock
        self.step_index = -1  # steps begun so far - 1: the step in progress (or the last one)
        self._first_step_ns: int | None = None
        self.governor: Slowdown | None = None  # set by open_backend when the device slows the loop

    def __call__(self, kind: str, name: str, is_begin: bool) -> None:
        self.seen_any = True
        gov = self.governor
        if gov is not None:
            gov.device.advance_now()  # the time since the last mark, at the level it had
        if kind == "phase":
            i = self._index.get(name)
            if i is None:
                i = self._index[name] = _level_index(name)
            n = self._open[i] + (1 if is_begin else -1)
            self._open[i] = n if n > 0 else 0
        elif kind == "step":
            self._in_step += 1 if is_begin else -1
            if is_begin:
                self.step_index += 1
                if self._first_step_ns is None:
                    self._first_step_ns = self._clock()
        if self.on_change is not None:
            o = self._open  # level(), inline: this runs on every mark of the training thread
            value = (
                _LEVELS[0] if o[0] else _LEVELS[1] if o[1] else _LEVELS[2] if o[2] else _LEVELS[3] if o[3]
                else _IN_STEP if self._in_step > 0 else _IDLE
            )  # fmt: skip
            if self.schedule:
                value += 2.0 * self.injected(self._clock())
            if value != self._published:
                self._published = value
                try:
                    self.on_change(value)
                except (ValueError, TypeError):
                    self.on_change = None
        if gov is not None and kind == "phase":
            gov.phase(name, is_begin)

    def injected(self, t_ns: int) -> int:
        """The injected throttle window in force at ``t_ns``: 1 + its index in
        :attr:`schedule`, 0 for none (before the first step, none is). Windows by step count
        the steps this listener saw begin, from 0; by seconds, from the first step's begin."""
        first = self._first_step_ns
        if not self.schedule or first is None:
            return 0
        for i, (kind, begin, end, _bits, _factor) in enumerate(self.schedule):
            if kind == "steps":
                if begin <= self.step_index <= end:
                    return i + 1
            elif begin <= (t_ns - first) / 1e9 < end:
                return i + 1
        return 0

    def level(self) -> float:
        o = self._open
        if o[0]:
            return _LEVELS[0]
        if o[1]:
            return _LEVELS[1]
        if o[2]:
            return _LEVELS[2]
        if o[3]:
            return _LEVELS[3]
        return _IN_STEP if self._in_step > 0 else _IDLE


_SLOWED = {"forward": 0, "backward": 1, "optimizer": 2}
"""The phases a synthetic device's clock slows (compute; pipeline and gradient sync waits are not)."""


class Slowdown:
    """Simulates, on a CPU, that a rank's accelerator runs at its modelled clock: at the begin
    of each compute phase (``forward``, ``backward``, ``optimizer``) the training thread sleeps
    ``last length of that phase x (1 / clock fraction - 1)``, where the clock fraction is the
    device's SM clock at full activity over its maximum (power cap, thermal limit and injected
    windows included; :meth:`SyntheticDevice.clock_fraction`). The sleep falls inside the phase
    window (its begin mark is taken first), so the phase, the step and the peers waiting on the
    rank are slower as they would be on a throttled GPU. A phase's length is measured from after
    its sleep, so the slowdown does not feed on itself. It is a simulation, on for the synthetic
    backend only (``telemetry.synthetic.slowdown``), and says so in docs/devices.md."""

    def __init__(self, device: SyntheticDevice, sleep: Callable[[float], None] = time.sleep) -> None:
        self.device = device
        self._sleep = sleep
        self._last_s = [0.0, 0.0, 0.0]  # the last length of each slowed phase (s)
        self._began = [0, 0, 0]  # when it began, after its sleep (ns; 0: not open)
        self.slept_s = 0.0  # in all (s)

    def phase(self, name: str, is_begin: bool) -> None:
        i = _SLOWED.get(name)
        if i is None:
            return
        if is_begin:
            f = self.device.clock_fraction(_LEVELS[2] if i == 2 else _LEVELS[0])
            extra = self._last_s[i] * (1.0 / f - 1.0) if 0.0 < f < 1.0 else 0.0
            if extra > 0.0:
                self._sleep(extra)
                self.slept_s += extra
            self._began[i] = time.monotonic_ns()
        elif self._began[i]:
            self._last_s[i] = (time.monotonic_ns() - self._began[i]) / 1e9
            self._began[i] = 0

    def last_length_s(self, name: str) -> float:
        """The last measured length of compute phase ``name`` (s, after its sleep; 0 before one)."""
        return self._last_s[_SLOWED[name]]


class SyntheticDevice:
    """One modelled accelerator. ``read()`` advances the model to now and reports it."""

    def __init__(
        self,
        index: int,
        activity: Callable[[int], float],
        params: SyntheticParams,
        clock: Callable[[], int] = time.monotonic_ns,
        observe_pid: int | None = None,
        throttle: Sequence[Injection] = (),
        injected: Callable[[int], int] | None = None,
    ) -> None:
        self.params = params
        self.throttle: tuple[Injection, ...] = tuple(throttle)
        self._injected = injected  # t_ns -> 1 + the injected window in force (0: none)
        self._statm = "/proc/self/statm" if observe_pid is None else f"/proc/{observe_pid}/statm"
        self._activity = activity
        self._clock = clock
        self._lock = threading.Lock()
        p = params
        self.identity = DeviceIdentity(
            index=index,
            name="Synthetic accelerator (model, not hardware)",
            vendor="synthetic",
            backend="synthetic",
            uuid=f"SYNTHETIC-{index:04d}",
            driver_version=None,
            extra={"synthetic": True, "params": p.__dict__.copy()},
        )
        now = clock()
        self._t = now
        # Idle's steady temperature, but no hotter than the limit: a device too poorly cooled
        # for even its idle power heats to its shutdown during the run, not before it.
        self._temp = min(p.ambient_c + p.r_gpu_c_per_w * p.idle_w, max(p.temp_limit_c, p.ambient_c))
        self._shutdown: str | None = None  # why the device shut down (None: running)
        self._temp_hbm = p.ambient_c + p.r_hbm_c_per_w * p.idle_w
        self._power = p.idle_w
        self._power_avg = p.idle_w
        self._energy_true_mj = 0.0
        self._energy_pub_mj = 0
        self._next_energy_pub = now
        self._viol_power_ns = 0
        self._viol_thermal_ns = 0
        self._pcie_tx = 0.0
        self._pcie_rx = 0.0
        self._clock_sm = p.clock_idle_mhz
        self._reasons = THROTTLE_BITS["idle"]
        self._activity_level = 0.0

    def supported_metrics(self) -> dict[str, bool]:
        unsupported = {"power_memory_w", "temp_hotspot_c", "nvlink_tx_bytes", "nvlink_rx_bytes"}
        modelled = len(METRIC_NAMES) - len(_NOT_MODELLED)
        return {m: i < modelled and m not in unsupported for i, m in enumerate(METRIC_NAMES)}

    def _operating_point(self, a: float, now: int) -> tuple[float, float, int, bool, bool]:
        """(delivered power W, SM clock MHz, throttle bits, power-limited, thermally limited) at
        activity ``a`` with the die at its present temperature and the injection at ``now``."""
        p = self.params
        demanded = p.idle_w + (p.peak_w - p.idle_w) * a
        reasons = 0
        power_held = thermal_held = False
        if a < 0.05:
            reasons |= THROTTLE_BITS["idle"]
            clock = p.clock_idle_mhz
        else:
            clock = p.clock_max_mhz
        power = demanded
        if demanded > p.power_limit_w:
            power = p.power_limit_w
            dyn_avail = p.power_limit_w - p.idle_w
            dyn_demand = demanded - p.idle_w
            clock *= (dyn_avail / dyn_demand) ** (1.0 / 3.0)
            reasons |= THROTTLE_BITS["sw_power_cap"]
            power_held = True
        if self._temp > p.temp_limit_c:
            clock *= p.thermal_clock_factor
            power = p.idle_w + (power - p.idle_w) * p.thermal_clock_factor**3
            reasons |= THROTTLE_BITS["sw_thermal"]
            thermal_held = True
        k = self._injected(now) if self._injected is not None else 0
        if 0 < k <= len(self.throttle):
            _kind, _b, _e, bits, factor = self.throttle[k - 1]
            clock *= factor
            power = p.idle_w + (power - p.idle_w) * factor**3
            reasons |= bits
            thermal_held |= bool(bits & _THERMAL_BITS)
            power_held |= bool(bits & ~_THERMAL_BITS)
        if self._temp >= p.slowdown_c and power > p.idle_w:
            # Harder throttling: the clock is cut to what holds the die at slowdown_c (its
            # steady temperature there), down to min_clock_factor; past that, the hardware's
            # own slowdown is on record and the die goes on heating towards shutdown_c.
            hold_w = (p.slowdown_c - p.ambient_c) / p.r_gpu_c_per_w
            if power > hold_w:
                cut = ((max(hold_w, p.idle_w) - p.idle_w) / (power - p.idle_w)) ** (1.0 / 3.0)
                if cut < p.min_clock_factor:
                    cut = p.min_clock_factor
                    reasons |= _HW_THERMAL
                clock *= cut
                power = p.idle_w + (power - p.idle_w) * cut**3
                reasons |= THROTTLE_BITS["sw_thermal"]
                thermal_held = True
        return power, clock, reasons, power_held, thermal_held

    def _advance(self, now: int) -> None:
        p = self.params
        dt_ns = now - self._t
        if dt_ns <= 0 or self._shutdown is not None:
            return
        a = min(1.0, max(0.0, float(self._activity(now))))
        self._activity_level = a
        # The interval is cut where the die reaches slowdown_c (the hold starts there) or
        # shutdown_c (the device stops there), found exactly from the first-order response, so
        # no sampling interval, however long against tau, carries the die past either.
        left = dt_ns
        for _ in range(_MAX_SEGMENTS):
            power, clock, reasons, power_held, thermal_held = self._operating_point(a, now)
            t_inf = p.ambient_c + p.r_gpu_c_per_w * power
            seg, reached = left, None
            for mark in (p.slowdown_c, p.shutdown_c):
                if self._temp < mark < t_inf:
                    to_mark = int(1e9 * p.tau_gpu_s * math.log((t_inf - self._temp) / (t_inf - mark)))
                    if to_mark < seg:
                        seg, reached = to_mark, mark
                    break
            self._integrate(seg, power, a, power_held, thermal_held)
            if reached is not None:
                self._temp = reached
            self._power, self._clock_sm, self._reasons = power, clock, reasons
            left -= seg
            if self._temp >= p.shutdown_c:
                self._shutdown = self._shutdown_message(power)
                break
            if left <= 0:
                break
        if now >= self._next_energy_pub:
            self._energy_pub_mj = int(self._energy_true_mj)
            step_ns = int(p.energy_update_ms * 1e6)
            self._next_energy_pub = now - (now - self._next_energy_pub) % step_ns + step_ns
        self._t = now

    def _shutdown_message(self, power: float) -> str:
        p = self.params
        return (
            f"synthetic device {self.identity.index} shut down: its die reached its shutdown "
            f"temperature {p.shutdown_c:g} C with the clock cut to its floor ({p.min_clock_factor:g} x): "
            f"its cooling is too weak (thermal resistance {p.r_gpu_c_per_w:g} C/W) for even "
            f"{power:.0f} W; raise it (telemetry.synthetic.devices.<rank>.cooling)"
        )

    def _integrate(self, dt_ns: int, power: float, a: float, power_held: bool, thermal_held: bool) -> None:
        """``dt_ns`` at constant ``power`` and activity ``a``: temperatures, average power,
        energy, violation time and PCIe counters."""
        p = self.params
        if power_held:
            self._viol_power_ns += dt_ns
        if thermal_held:
            self._viol_thermal_ns += dt_ns
        dt = dt_ns / 1e9
        # First-order thermal response, exact for piecewise-constant power.
        t_inf = p.ambient_c + p.r_gpu_c_per_w * power
        self._temp = t_inf + (self._temp - t_inf) * math.exp(-dt / p.tau_gpu_s)
        h_inf = p.ambient_c + p.r_hbm_c_per_w * power
        self._temp_hbm = h_inf + (self._temp_hbm - h_inf) * math.exp(-dt / p.tau_hbm_s)
        alpha = 1.0 - math.exp(-dt / p.avg_window_s)
        self._power_avg += (power - self._power_avg) * alpha
        self._energy_true_mj += power * dt * 1e3
        self._pcie_tx += p.pcie_bytes_per_s_at_full * a * dt
        self._pcie_rx += 0.5 * p.pcie_bytes_per_s_at_full * a * dt

    def advance_now(self) -> None:
        """Bring the model up to now (the training process's copy does this at every mark
        when it slows the loop, so that each stretch between marks has the level it had)."""
        with self._lock:
            self._advance(self._clock())

    def clock_fraction(self, level: float = 1.0) -> float:
        """The SM clock at activity ``level``, now, as a fraction of the maximum clock (power
        cap, thermal limit and injected windows included): what :class:`Slowdown` runs at."""
        with self._lock:
            if self._shutdown is not None:
                return 0.0  # shut down: Slowdown adds nothing (its clock says nothing any more)
            now = self._clock()
            return self._operating_point(level, now)[1] / self.params.clock_max_mhz

    def read(self) -> Reading:
        with self._lock:
            self._advance(self._clock())
            if self._shutdown is None and self._temp >= self.params.shutdown_c:
                self._shutdown = self._shutdown_message(self._power)  # e.g. an ambient above it
            if self._shutdown is not None:
                # As a GPU that shut down falls off the bus: the sampler logs this once and
                # stops sampling the device; nothing above shutdown_c is ever reported.
                raise DeviceLost(self._shutdown)
            p = self.params
            return (
                self._power,  # power_instant_w
                self._power_avg,  # power_avg_w
                None,  # power_memory_w
                self._energy_pub_mj,  # energy_mj
                self._temp,  # temp_gpu_c
                self._temp_hbm,  # temp_hbm_c
                None,  # temp_hotspot_c
                self._clock_sm,  # clock_sm_mhz
                p.clock_mem_mhz,  # clock_mem_mhz
                self._reasons,  # throttle_reasons
                self._viol_power_ns,  # violation_power_ns
                self._viol_thermal_ns,  # violation_thermal_ns
                100.0 * self._activity_level,  # util_gpu_pct
                60.0 * self._activity_level,  # util_mem_pct
                _rss_bytes(self._statm),  # mem_used_bytes: the observed process's resident memory
                p.power_limit_w,  # power_limit_w
                int(self._pcie_tx),  # pcie_tx_bytes
                int(self._pcie_rx),  # pcie_rx_bytes
                None,  # nvlink_tx_bytes
                None,  # nvlink_rx_bytes
                *_NOT_MODELLED,  # the other per-reason violation counters, their timestamps, module power
            )


class SyntheticBackend:
    """``count`` modelled devices sharing one activity source."""

    name = "synthetic"

    def __init__(self, devices: list[SyntheticDevice], marks: MarkActivity | None) -> None:
        self.devices: list[Any] = list(devices)
        self.activity = marks  # devices/base.py's ActivityInput: None unless activity follows marks

    def close(self) -> None:
        pass


def _activity_fn(
    spec: ActivitySpec,
    observe_pid: int | None = None,
    schedule: Sequence[Injection] = (),
    clock: Callable[[], int] = time.monotonic_ns,
) -> tuple[Callable[[int], float], MarkActivity | None]:
    if callable(spec):
        return spec, None
    if isinstance(spec, (int, float)):
        level = float(spec)
        if not 0.0 <= level <= 1.0:
            raise ConfigError(f"synthetic activity={level} must be within [0, 1]")
        return (lambda _t: level), None
    if spec == "marks":
        marks = MarkActivity(schedule, clock)
        return (lambda _t: marks.level()), marks
    if spec == "cpu":
        cpu = CpuActivity(observe_pid)
        return cpu.level, None
    if spec == "auto":
        marks = MarkActivity(schedule, clock)
        cpu = CpuActivity(observe_pid)

        def auto(t: int) -> float:
            return marks.level() if marks.seen_any else cpu.level(t)

        return auto, marks
    raise ConfigError(
        f"synthetic activity={spec!r}; use 'auto', 'marks', 'cpu', a number in [0, 1] or a callable"
    )


def process_plan(options: dict[str, Any]) -> ProcessPlan:
    """devices/factory.py's hook: how ``options`` cross into a telemetry process. ``marks`` and
    ``auto`` follow the level the training process's marks publish (``auto``: its CPU use until
    the first mark); ``cpu`` and fixed levels cross as they are; every mode models the training
    process, not the telemetry process. A callable cannot cross (ConfigError)."""
    activity = options.pop("activity", "auto")
    options.pop("slowdown", None)  # the training thread's business: its own copy of the device
    if activity in ("marks", "auto"):
        return ProcessPlan(options, str(activity), True)
    if activity == "cpu":
        return ProcessPlan({**options, "activity": "cpu"}, None, True)
    if isinstance(activity, (int, float)) and not isinstance(activity, bool):
        return ProcessPlan({**options, "activity": float(activity)}, None, True)
    raise ConfigError(
        f"synthetic activity={activity!r} cannot cross into the sampling process; use 'auto', 'marks', "
        "'cpu' or a number in [0, 1], or telemetry.sampler=thread"
    )


def process_activity(mode: str, published_level: Callable[[], float], parent_pid: int) -> dict[str, Any]:
    """devices/factory.py's hook: the ``activity`` option of a device in a telemetry process
    whose plan said ``mode`` (``marks`` / ``auto``): the published level, and until there is
    one, 0 (``marks``) or the training process's CPU use (``auto``)."""
    fallback: Callable[[int], float] = CpuActivity(parent_pid).level if mode == "auto" else (lambda _t: 0.0)
    shared = SharedActivity(published_level, fallback)
    return {"activity": shared.level, "injected": shared.injected}


def open_backend(
    indices: Sequence[int] | None = None,
    *,
    count: int = 1,
    activity: ActivitySpec = "auto",
    params: SyntheticParams | None = None,
    clock: Callable[[], int] = time.monotonic_ns,
    observe_pid: int | None = None,
    throttle: Sequence[Injection] = (),
    injected: Callable[[int], int] | None = None,
    slowdown: bool = False,
) -> SyntheticBackend:
    """Open ``count`` synthetic devices (or those at ``indices``).

    ``activity``: ``auto`` (window marks once any arrive, else this process's CPU use),
    ``marks``, ``cpu``, a fixed level in [0, 1], or ``f(t_mono_ns) -> level``. With marks, wire
    ``backend.activity`` to ``WindowRecorder.add_listener`` (the session does this).
    ``observe_pid``: the process whose CPU use (``cpu``, ``auto``) and resident memory
    (``mem_used_bytes``) the model follows; None = this one. The sampling process passes the
    training process, and a :class:`SharedActivity` level for ``marks`` / ``auto``.
    ``throttle``: injected throttle windows (:data:`Injection`; with ``marks`` / ``auto``,
    which count the steps); ``injected``: where the window in force is read instead (the
    telemetry process: the word the training process publishes). ``slowdown``: the first
    device slows the training thread by its clock (:class:`Slowdown`; needs marks).
    """
    if count < 1:
        raise ConfigError(f"synthetic count={count} must be >= 1")
    idx = list(range(count)) if indices is None else list(indices)
    bad = [i for i in idx if not 0 <= i < max(count, len(idx))]
    if bad:
        raise ConfigError(f"synthetic device indices {bad} are negative; use 0..{count - 1}")
    fn, marks = _activity_fn(activity, observe_pid, throttle if injected is None else (), clock)
    if marks is None and injected is None and (throttle or slowdown):
        raise ConfigError(
            f"synthetic activity={activity!r} does not follow the training loop's marks, which "
            "injected throttle windows and the slowdown need; use activity 'auto' or 'marks'"
        )
    if injected is None and marks is not None and throttle:
        injected = marks.injected
    prm = params or SyntheticParams()
    devices = [SyntheticDevice(i, fn, prm, clock, observe_pid, throttle, injected) for i in idx]
    if slowdown and marks is not None:
        marks.governor = Slowdown(devices[0])
    return SyntheticBackend(devices, marks)
