"""The exported values of one rank and their text exposition (Prometheus 0.0.4 text format).

:class:`ExportState` holds, per device, the newest value of every exported sample column, the
time each throttle bit was set, and the last step's figures; :meth:`ExportState.render` writes
them in the exposition format. Our own renderer, not prometheus_client's: that library appends
``_total`` to every counter name, and dcgm's counters (``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION``,
``DCGM_FI_DEV_CLOCKS_EVENT_REASON_*_NS``) have none. It runs in the telemetry process only.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from charllm_nemo.devices.contract import INT_NULL, THROTTLE_BITS
from charllm_nemo.telemetry.export.names import (
    DEVICE_FAMILIES,
    EXPORTER_FAMILIES,
    STEP_FAMILIES,
    THROTTLE_FAMILIES,
    Family,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FREQUENCY_STEPS = 16
"""Step durations the exported frequency (``charllm_power_dominant_frequency_hertz``) is the
reciprocal median of: the last 16, so one slow step (a checkpoint) does not move it."""


def escape_label(value: str) -> str:
    """A label value as the exposition format quotes it."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def label_text(labels: Mapping[str, Any]) -> str:
    """``{a="1",b="x"}`` of the labels whose value is not None or empty ("" when none is left)."""
    parts = [f'{k}="{escape_label(str(v))}"' for k, v in labels.items() if v is not None and str(v) != ""]
    return "{" + ",".join(parts) + "}" if parts else ""


def format_value(v: float) -> str:
    """A sample value: integers without a decimal point, floats by repr (round-trips exactly)."""
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    f = float(v)
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    return repr(f)


class ExportState:
    """What one rank exports. ``devices``: (index, uuid, model name) of each device the rank
    samples; ``labels``: the rank's labels (names.RANK_LABELS, a None value left out); ``host``:
    the Hostname label. Thread-safe: the collector thread updates, the HTTP thread renders."""

    def __init__(
        self,
        devices: Sequence[tuple[int, str | None, str | None]],
        labels: Mapping[str, Any],
        host: str,
    ) -> None:
        self._lock = threading.Lock()
        self.rank_labels = dict(labels)
        self.devices = [int(d[0]) for d in devices]
        self._identity = {int(i): (uuid, name) for i, uuid, name in devices}
        self.host = host
        self.parallel: dict[str, int] = {}
        self._device_labels: dict[int, str] = {}
        self._rank_text = ""
        self._relabel()
        self.latest: dict[int, dict[str, float]] = {i: {} for i in self.devices}
        self.throttle_ns: dict[int, dict[str, int]] = {
            i: dict.fromkeys(THROTTLE_BITS, 0) for i in self.devices
        }
        self._last_mask: dict[int, tuple[int, int]] = {}  # device -> (t_mono_ns, mask) of its newest mask
        self.step: dict[int, dict[str, float]] = {i: {} for i in self.devices}
        self.steps = 0
        self._durations: deque[float] = deque(maxlen=FREQUENCY_STEPS)
        self.energy_total_j: dict[int, float] = dict.fromkeys(self.devices, 0.0)
        self.scrapes = 0
        self.update_s = 0.0

    def _relabel(self) -> None:
        rank = {**self.rank_labels, **{k: v for k, v in self.parallel.items()}}
        self._rank_text = label_text(rank)
        for i in self.devices:
            uuid, name = self._identity.get(i, (None, None))
            dev = {"gpu": i, "UUID": uuid, "modelName": name, "Hostname": self.host}
            self._device_labels[i] = label_text({**dev, **rank})

    def set_parallel(self, labels: Mapping[str, int]) -> None:
        """The rank's parallel ranks (pp_stage, tp_rank, ...), as the step windows carry them."""
        if dict(labels) != self.parallel:
            with self._lock:
                self.parallel = dict(labels)
                self._relabel()

    # -- updates (collector thread) ------------------------------------------------------
    def take_samples(self, cols: Mapping[str, np.ndarray[Any, Any]]) -> None:
        """The newest non-null value of each exported column per device, and the throttle bits'
        held time, from one chunk of sample columns (``t_mono_ns``, ``device_index``, metrics)."""
        dev = cols["device_index"]
        if dev.size == 0:
            return
        single = bool((dev == dev[0]).all())
        for idx in [int(dev[0])] if single else np.unique(dev).tolist():
            if idx not in self.latest:
                continue
            rows = slice(None) if single else dev == idx
            newest: dict[str, float] = {}
            for fam in DEVICE_FAMILIES:
                a = cols.get(fam.source)
                if a is None:
                    continue
                a = a if single else a[rows]
                v = a[-1].item()  # the newest row holds it but for counters read apart (NVML)
                if (v != v) if a.dtype.kind == "f" else v == INT_NULL:
                    ok = ~np.isnan(a) if a.dtype.kind == "f" else a != INT_NULL
                    hit = np.flatnonzero(ok)
                    if not hit.size:
                        continue
                    v = a[hit[-1]].item()
                newest[fam.source] = v
            held = self._held(idx, cols["t_mono_ns"][rows], cols["throttle_reasons"][rows])
            with self._lock:
                self.latest[idx].update(newest)
                totals = self.throttle_ns[idx]
                for name, ns in held.items():
                    totals[name] += ns

    def _held(self, idx: int, t: np.ndarray[Any, Any], mask: np.ndarray[Any, Any]) -> dict[str, int]:
        """ns each throttle bit was held over these samples: a mask holds until the next one."""
        ok = mask != INT_NULL
        t, mask = t[ok], mask[ok]
        if t.size == 0:
            return {}
        prev = self._last_mask.get(idx)
        if prev is not None:
            t = np.concatenate([[prev[0]], t])
            mask = np.concatenate([[prev[1]], mask])
        self._last_mask[idx] = (int(t[-1]), int(mask[-1]))
        if t.size < 2:
            return {}
        held_mask = mask[:-1]
        first = int(held_mask[0])
        if (held_mask == first).all():  # the common case: one mask throughout
            span = int(t[-1] - t[0])
            return {name: span for name, bit in THROTTLE_BITS.items() if first & bit}
        dt = np.diff(t)
        return {name: int(dt[(held_mask & bit) != 0].sum()) for name, bit in THROTTLE_BITS.items()}

    def take_step(
        self, step: int, duration_s: float, per_device: Mapping[int, Mapping[str, float]], rates: Any
    ) -> None:
        """One finished step's figures: ``per_device`` the attribution (energy_j, power_avg_w,
        throttle_any_limiting_s, power_swing_w) per device; ``rates``: (tokens per step, FLOPs
        per step per device, peak FLOP/s per device), 0 where unknown. The step frequency is
        1 / the median of the last :data:`FREQUENCY_STEPS` step durations."""
        tokens, flops, peak = rates
        tok_s = tokens / duration_s if tokens > 0 and duration_s > 0 else math.nan
        if duration_s > 0:
            self._durations.append(duration_s)
        freq = 1.0 / statistics.median(self._durations) if self._durations else math.nan
        mfu = flops / duration_s / peak if flops > 0 and peak > 0 and duration_s > 0 else math.nan
        with self._lock:
            self.steps += 1
            for idx, fig in per_device.items():
                if idx not in self.step:
                    continue
                energy = float(fig.get("energy_j", math.nan))
                limiting = float(fig.get("throttle_any_limiting_s", math.nan))
                self.step[idx] = {
                    "step": float(step),
                    "step_time_s": duration_s,
                    "energy_j": energy,
                    "power_avg_w": float(fig.get("power_avg_w", math.nan)),
                    "throttle_share": limiting / duration_s if duration_s > 0 else math.nan,
                    "tokens_per_s": tok_s,
                    "mfu": mfu,
                    "power_swing_w": float(fig.get("power_swing_w", math.nan)),
                    "step_frequency_hz": freq,
                }
                if math.isfinite(energy):
                    self.energy_total_j[idx] += energy

    # -- rendering (any thread) ------------------------------------------------------------
    def points(self) -> list[tuple[Family, int | None, float]]:
        """Every series as (family, device index or None for a rank series, value), a snapshot
        (the OTLP push's input; :meth:`render` writes the same series as text)."""
        out: list[tuple[Family, int | None, float]] = []
        with self._lock:
            for fam in DEVICE_FAMILIES:
                for i in self.devices:
                    v = self.latest[i].get(fam.source)
                    if v is not None and v == v:
                        out.append((fam, i, float(v) * fam.scale))
            for fam in THROTTLE_FAMILIES:
                out.extend((fam, i, float(self.throttle_ns[i][fam.source])) for i in self.devices)
            for fam in STEP_FAMILIES:
                for i in self.devices:
                    if fam.source == "steps":
                        v = float(self.steps)
                    elif fam.source == "energy_total_j":
                        v = self.energy_total_j[i] if self.steps else math.nan
                    else:
                        v = self.step[i].get(fam.source, math.nan)
                    if v == v:
                        out.append((fam, i, float(v)))
            out.extend(
                (fam, None, float(self.scrapes if fam.source == "scrapes" else self.update_s))
                for fam in EXPORTER_FAMILIES
            )
        return out

    def device_attributes(self, idx: int) -> dict[str, Any]:
        """A device's labels beyond the rank's (gpu, UUID, modelName, the parallel ranks)."""
        uuid, name = self._identity.get(idx, (None, None))
        return {"gpu": idx, "UUID": uuid, "modelName": name, **self.parallel}

    def render(self, count_scrape: bool = True) -> bytes:
        """Every series in the text exposition format."""
        out: list[str] = []
        with self._lock:
            if count_scrape:
                self.scrapes += 1
            for fam in DEVICE_FAMILIES:
                self._family(out, fam, {i: self.latest[i].get(fam.source) for i in self.devices})
            for fam in THROTTLE_FAMILIES:
                self._family(out, fam, {i: self.throttle_ns[i][fam.source] for i in self.devices})
            for fam in STEP_FAMILIES:
                if fam.source == "steps":
                    values: dict[int, Any] = {i: self.steps for i in self.devices}
                elif fam.source == "energy_total_j":
                    values = dict(self.energy_total_j) if self.steps else {}
                else:
                    values = {i: self.step[i].get(fam.source) for i in self.devices}
                self._family(out, fam, values)
            for fam in EXPORTER_FAMILIES:
                value = self.scrapes if fam.source == "scrapes" else self.update_s
                out.append(f"# HELP {fam.name} {fam.help}\n# TYPE {fam.name} {fam.type}\n")
                out.append(f"{fam.name}{self._rank_text} {format_value(value)}\n")
        return "".join(out).encode()

    def _family(self, out: list[str], fam: Family, values: Mapping[int, Any]) -> None:
        lines = []
        for idx, v in values.items():
            if v is None or (isinstance(v, float) and math.isnan(v)):
                continue
            if fam.scale != 1.0:
                v = float(v) * fam.scale
            lines.append(f"{fam.name}{self._device_labels[idx]} {format_value(v)}\n")
        if lines:
            out.append(f"# HELP {fam.name} {fam.help}\n# TYPE {fam.name} {fam.type}\n")
            out.extend(lines)
