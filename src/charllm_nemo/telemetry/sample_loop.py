"""The deadline loop every sampler runs, whichever thread or process it runs in.

:class:`~charllm_nemo.telemetry.sampler.Sampler` (a daemon thread in the training process) and
:class:`~charllm_nemo.telemetry.process.parent.ProcessSampler` (a separate sampling process)
both call :func:`run_sample_loop`; they differ only in where a row goes (``emit``), how the loop
learns that it should stop (``should_stop``) and how it waits for the next deadline (``sleep``).

This module imports only the standard library and the package's light modules (no pyarrow, no
numpy), so that the sampling process starts quickly.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from charllm_nemo.devices.base import Device, ReadsGaugesApart
from charllm_nemo.errors import ConfigError, DeviceLost
from charllm_nemo.telemetry.schema import METRICS

log = logging.getLogger("charllm_nemo.sampler")

MIN_HZ = 1.0
MAX_HZ = 1000.0
DEFAULT_HZ = 100.0
"""The sampling rate when none is given (telemetry.hz, the callbacks' ``hz=``, ``charllm telemetry
--hz``; the one declaration)."""

Row = tuple[int, int, int, int, tuple[Any, ...]]  # t_mono_ns, t_wall_ns, read_ns, device_index, reading


def hz_problem(hz: object, name: str = "telemetry.hz") -> str | None:
    """Why ``hz`` is not a rate the sampler holds (a number from MIN_HZ to MAX_HZ; not a bool,
    not text, not nan or inf), named ``name``; None when it is. The one range check: the config
    checks, the samplers' constructors and ``charllm telemetry --hz`` all ask it."""
    ok = False
    if not isinstance(hz, (bool, str, bytes)):
        try:
            ok = MIN_HZ <= float(hz) <= MAX_HZ  # type: ignore[arg-type]  # nan compares False
        except (TypeError, ValueError):
            ok = False
    if ok:
        return None
    return (
        f"{name}={hz!r} is not a sampling rate; use a rate in [{MIN_HZ:g}, {MAX_HZ:g}] Hz, e.g. "
        f"{name}={DEFAULT_HZ:g} (1 kHz is the most a Python sampler holds reliably; NVML's own power "
        "average is 1 s)"
    )


def validate_hz(hz: float) -> float:
    """Return ``hz`` as a float if :func:`hz_problem` finds none, else raise ConfigError."""
    problem = hz_problem(hz)
    if problem is not None:
        raise ConfigError(problem)
    return float(hz)


DEFAULT_COUNTER_HZ: float | None = None
"""The default ``telemetry.counter_hz``: None, derive the rate from the measured cost of a counter
read (:func:`measured_counter_every`). A number reads the counters at that rate (at least every
slot); a rate of ``hz`` or more reads them with every sample whatever they cost."""

COUNTER_READ_BUDGET = 0.03
"""The share of one CPU core that the cumulative counters' reads may take when their rate is
derived (``telemetry.counter_hz: null``): n = ceil(hz x extra cost of a whole read / budget).
Measured on an H200 (driver 580.159), the energy counter alone costs 2.4-3 ms a read and updates
every 100 ms, the thermal violation time 0.4-0.6 ms and each PCIe counter 0.08-0.14 ms, against
13 µs for every other metric together (bench/nvml_costs.py, docs/devices-nvml.md): ~3 ms at
100 Hz gives n = 10, the 10 Hz that was the fixed default; a device whose counters cost little
(the synthetic device, the NVML stand-in, AMD SMI) gets them with every sample, which places
each counter tick within one sample period (docs/attribution.md, Energy bounds)."""

AUTO_EVERY = 0
""":func:`counter_every`'s answer for a derived rate: measured when the devices are open."""


def counter_every(hz: float, counter_hz: float | None) -> int:
    """Read the cumulative counters on every n-th slot of a sampler at ``hz``: n for
    ``counter_hz``, :data:`AUTO_EVERY` for None (derived from the measured cost once the devices
    are open: :func:`effective_counter_every`). Raises ConfigError for a rate that is not a
    positive number."""
    if counter_hz is None:
        return AUTO_EVERY
    problem = counter_hz_problem(counter_hz)
    if problem is not None:
        raise ConfigError(problem)
    return max(1, round(hz / float(counter_hz)))


def counter_hz_problem(counter_hz: object) -> str | None:
    """Why ``counter_hz`` is not a counter rate (None, or a positive finite number; not a bool,
    not text), naming ``telemetry.counter_hz``; None when it is. The one check: the config's
    checks and :func:`counter_every` ask it."""
    if counter_hz is None:
        return None
    ok = False
    if not isinstance(counter_hz, (bool, str, bytes)):
        try:
            value = float(counter_hz)  # type: ignore[arg-type]
            ok = math.isfinite(value) and value > 0
        except (TypeError, ValueError):
            ok = False
    if ok:
        return None
    return (
        f"telemetry.counter_hz={counter_hz!r} is not a positive finite rate; use e.g. "
        "telemetry.counter_hz=10 (Hz), or null to derive it from the measured cost of a counter read"
    )


def counter_read_cost_ns(
    devices: Sequence[Device], reads: int = 5, clock: Callable[[], int] = time.perf_counter_ns
) -> int:
    """What reading the cumulative counters adds to a sample (ns): over the devices that read
    them apart, the median of ``reads`` whole reads less the median of as many gauge reads,
    summed. A device that fails here adds nothing (the loop meets the failure and handles it)."""
    total = 0
    for d in devices:
        if not isinstance(d, ReadsGaugesApart):
            continue
        whole, gauges = [], []
        try:
            for _ in range(reads):
                t0 = clock()
                d.read()
                whole.append(clock() - t0)
                t0 = clock()
                d.read_gauges()
                gauges.append(clock() - t0)
        except Exception:
            continue
        total += max(0, int(statistics.median(whole) - statistics.median(gauges)))
    return total


def measured_counter_every(hz: float, cost_ns: int, budget: float = COUNTER_READ_BUDGET) -> int:
    """Slots per counter read so that the counters' extra ``cost_ns`` a read, at ``hz`` slots a
    second, takes at most ``budget`` of a core: ceil(hz x cost / budget), at least 1."""
    return max(1, math.ceil(hz * cost_ns / 1e9 / budget - 1e-9))


def effective_counter_every(devices: Sequence[Device], every: int, hz: float | None = None) -> int:
    """What :func:`run_sample_loop` applies: ``every`` where some device reads its counters
    apart (devices/base.py ``ReadsGaugesApart``), else 1 (every slot is whole).
    :data:`AUTO_EVERY` measures the counters' cost on those devices now
    (:func:`counter_read_cost_ns`, :func:`measured_counter_every`; ``hz`` needed)."""
    if not any(isinstance(d, ReadsGaugesApart) for d in devices):
        return 1
    if every == AUTO_EVERY:
        if hz is None:
            raise ValueError("a derived counter rate needs the sampling rate hz")
        return measured_counter_every(hz, counter_read_cost_ns(devices))
    return max(1, every)


def figures_period_ns(hz: float, every: int) -> int:
    """How often whole samples (counters read), the ones a live figure waits for, arrive at
    ``hz`` with counters on every ``every``-th slot (ns). The session and the telemetry
    process both slice live samples by it, so that their figures agree."""
    return round(1e9 / hz) * every


@dataclass
class SamplerHealth:
    """The sampler's own record of how it did (counts, and ns of CLOCK_MONOTONIC)."""

    hz: float
    counter_every: int = 1  # cumulative counters read on every n-th slot (devices with read_gauges)
    started_mono_ns: int = 0
    stopped_mono_ns: int = 0
    samples: int = 0
    slots: int = 0  # deadlines that came due while running
    on_time: int = 0  # samples started within half a period of their deadline
    deadlines_missed: int = 0  # slots skipped entirely because the sampler was a period or more late
    late_max_ns: int = 0
    read_ns_total: int = 0
    read_ns_max: int = 0
    devices_lost: int = 0
    errors: int = 0
    stop_reason: str | None = None
    rows_lost: int = 0  # process mode: rows the sampling process overwrote before they were taken
    startup_ns: int = 0  # from start() until sampling could begin (process mode: spawn + imports + open)
    # Per schema metric: readings in which a metric its device supported at open came back null
    # (a read that failed while sampling; cumulative counters only on the slots that read them).
    nulls: list[int] = field(default_factory=lambda: [0] * len(METRICS))

    def deadline_ratio(self) -> float:
        """Fraction of due deadlines met on time (1.0 when none came due)."""
        return self.on_time / self.slots if self.slots else 1.0

    def read_ns_mean(self) -> float:
        return self.read_ns_total / self.samples if self.samples else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["nulls"] = {m.name: n for m, n in zip(METRICS, self.nulls, strict=True) if n}
        d["deadline_ratio"] = self.deadline_ratio()
        d["read_ns_mean"] = self.read_ns_mean()
        return d


def health_counts(h: SamplerHealth) -> tuple[float, float, float]:
    """What a rank sends of its sampler's health each step (steps/report.py ``HEALTH_FIELDS``):
    deadlines missed, null readings of supported metrics (counts), and 1.0 once the sampler
    stopped (a device lost, a stop reason), else 0.0."""
    return float(h.deadlines_missed), float(sum(h.nulls)), 1.0 if (h.devices_lost or h.stop_reason) else 0.0


class NullWatch:
    """Counts, per metric, the readings in which a metric that its device supported at open came
    back null: a read that failed while sampling (NOT_SUPPORTED for a while, a timeout). Each
    (device, metric) is logged once, at WARNING, in whichever process samples; the counts go to
    ``health.nulls`` and the manifest. Metrics unsupported at open are not counted (the manifest's
    ``supported_metrics`` says so), nor cumulative counters on slots that do not read them."""

    def __init__(self, devices: Sequence[Device], counts: list[int]) -> None:
        self.counts = counts
        self._whole: dict[int, tuple[int, ...]] = {}
        self._gauges: dict[int, tuple[int, ...]] = {}
        for d in devices:
            try:
                supported = d.supported_metrics()
            except Exception:  # a backend bug: watch nothing on it rather than stop sampling
                supported = {}
            on = tuple(i for i, m in enumerate(METRICS) if supported.get(m.name))
            self._whole[d.identity.index] = on
            self._gauges[d.identity.index] = tuple(i for i in on if not METRICS[i].cumulative)
        self._logged: set[tuple[int, int]] = set()

    def check(self, idx: int, reading: Sequence[Any], whole: bool) -> None:
        """Count the nulls of one reading of device ``idx`` (``whole``: its counters were read)."""
        for i in (self._whole if whole else self._gauges).get(idx, ()):
            if reading[i] is None:
                self.counts[i] += 1
                if (idx, i) not in self._logged:
                    self._logged.add((idx, i))
                    log.warning(
                        "device %d: %s read null while sampling (it was supported at open); such "
                        "readings are counted in the manifest (sampler.nulls)",
                        idx,
                        METRICS[i].name,
                    )


def run_sample_loop(
    devices: Sequence[Device],
    period_ns: int,
    health: SamplerHealth,
    emit: Callable[[Row], None],
    should_stop: Callable[[], bool],
    sleep: Callable[[float], object] = time.sleep,
    on_slot: Callable[[int], object] | None = None,
    counter_every: int = 1,
) -> None:
    """Read every device once per ``period_ns`` until ``should_stop()`` (checked once per slot).

    Deadlines are absolute (``deadline += period``); a loop a whole period or more behind skips
    the lost slots (``deadlines_missed``) rather than bursting to catch up. Each reading goes to
    ``emit((t_mono_ns, t_wall_ns, read_ns, device_index, reading))``; ``health`` is updated in
    place; ``sleep(seconds)`` waits for the next deadline (it may return early). A device that
    raises is dropped (DeviceLost: one error line; anything else: logged with its traceback);
    with none left the loop ends. ``on_slot(t_mono_ns)``, after each slot, gets the time of its
    first reading: from then on every device still sampled has a row at or after that time
    (what live figures wait for).

    ``counter_every``: a device with a ``read_gauges()`` method (a ``read()`` with the cumulative
    counters left None, where those are dear to read) is read whole only on every n-th slot and
    on the last, and through ``read_gauges()`` on the others; ``on_slot`` then follows only the
    whole slots, so that a live figure waits for counter values past its window's end (a counter
    delta needs them). Never raises.
    """
    h = health
    period = period_ns
    half = period // 2
    mono = time.monotonic_ns
    live = [(d, d.identity.index) for d in devices]
    every = h.counter_every = effective_counter_every(devices, counter_every, h.hz)
    gauges: dict[int, Callable[[], Any]] = {}
    if every > 1:
        gauges = {idx: d.read_gauges for d, idx in live if isinstance(d, ReadsGaugesApart)}
    nulls = NullWatch([d for d, _ in live], h.nulls)
    k = 0
    h.started_mono_ns = deadline = mono()
    try:
        while live and not should_stop():
            now = mono()
            late = now - deadline
            h.slots += 1
            if late < half:
                h.on_time += 1
            if late > h.late_max_ns:
                h.late_max_ns = late
            whole = k % every == 0
            k += 1
            t_slot = _sample_once(live, h, emit, nulls, None if whole else gauges)
            if on_slot is not None and t_slot is not None and whole:
                on_slot(t_slot)
            deadline += period
            now = mono()
            if now - deadline >= period:
                # A period or more behind: skip the lost slots rather than burst to catch up.
                skipped = (now - deadline) // period
                h.deadlines_missed += skipped
                h.slots += skipped
                deadline += skipped * period
            wait = deadline - now
            if wait > 0:
                sleep(wait / 1e9)
        if live:
            # One last sample at stop, so a window that closed just before stop() is
            # bracketed by samples on both sides and can be attributed.
            t_slot = _sample_once(live, h, emit, nulls)
            if on_slot is not None and t_slot is not None:
                on_slot(t_slot)
        if not live:
            h.stop_reason = "no devices left"
            log.error("telemetry sampler stopped: no device left to sample; training goes on")
        else:
            h.stop_reason = "stopped"
    except Exception as exc:  # never propagate into the process
        h.errors += 1
        h.stop_reason = f"crashed: {exc!r}"
        log.exception("telemetry sampler crashed; training goes on")
    finally:
        h.stopped_mono_ns = mono()


def _sample_once(
    devices: list[tuple[Device, int]],
    h: SamplerHealth,
    emit: Callable[[Row], None],
    nulls: NullWatch,
    gauges: dict[int, Callable[[], Any]] | None = None,
) -> int | None:
    """Read every device once (through ``gauges[index]`` where given, else ``read()``); a device
    that fails is removed from ``devices``. Returns the time of the first reading (None: no
    device read)."""
    mono = time.monotonic_ns
    first: int | None = None
    for entry in tuple(devices):
        dev, idx = entry
        t0 = mono()
        tw = time.time_ns()
        whole = not (gauges and idx in gauges)
        try:
            reading = dev.read() if whole else gauges[idx]()  # type: ignore[index]
        except DeviceLost as exc:
            h.devices_lost += 1
            devices.remove(entry)
            log.error("device %d lost (%s): sampling of it stopped; training goes on", idx, exc)
            continue
        except Exception as exc:  # a backend bug must not reach training
            h.errors += 1
            devices.remove(entry)
            log.exception("device %d: unexpected error in read(), sampling of it stopped: %s", idx, exc)
            continue
        dt = mono() - t0
        emit((t0, tw, dt, idx, reading))
        nulls.check(idx, reading, whole)
        if first is None:
            first = t0
        h.samples += 1
        h.read_ns_total += dt
        if dt > h.read_ns_max:
            h.read_ns_max = dt
    return first
