"""The energy report of a run: energy to train, per rank and in all, tokens per joule and energy
per step, each with the measurement's uncertainty; optional carbon; MLPerf Training's power
rules as a checked statement.

Everything is computed from the tables of :func:`charllm_nemo.analysis.analyze.analyze` (the
``ranks`` table: one row per rank and device over the whole sampled time; the ``runs`` table:
the measured steps) and the run's manifests. The uncertainty is a bound, the sum over devices
of each device's ``energy_bound_j`` over its whole sampled span (docs/attribution.md, *Energy
bounds*: the counter's tick timing, one counter read interval at the larger of the two ends, plus
the power trapezoid's worst case over the edges; no bound across a sampling gap of the power
timeline, and then the report says "unbounded" and names the device). Before 2026-12-06 it
charged ``2 x counter update period x power`` a device, 40-700x the error actually made; that rule
remains only for ``ranks`` tables without the attribution's columns (the Spark engine's).

Corrupt inputs (:func:`check_device_row`: a negative power or energy, a counter that goes down
more than once or disagrees with the integrated power by more than half) raise
:class:`EnergyDataError` naming the column: no total, no tokens/J, no MLPerf statement.

* **ranks missing**: ranks the run declared (``world_size``) with no samples are not in the sum:
  the total is then a lower bound, and says so (``ranks_missing``), with a scaled estimate.

Carbon (optional): ``energy (kWh) x PUE x grid intensity (g CO2e / kWh)``; the intensity is a
constant or a time series (CSV ``time,g_per_kwh``: unix seconds or ISO 8601), held from each
point to the next and averaged over the run's wall-clock span (time-weighted: the run's power
is taken as even over its span; say so where that matters).
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.figures import finite_or_none
from charllm_nemo.telemetry.filecheck import printable
from charllm_nemo.telemetry.layout import UnsafeFileError, read_bounded

MLPERF_MIN_HZ = 1.0
MLPERF_MIN_SAMPLES = 60
"""MLPerf Training power rules checked here (all nodes measured, >= 1 Hz, >= 60 samples a
device); the rules have more (an approved meter, the whole system's AC power) that a GPU
counter cannot show, and the statement says so."""

GRID_CSV_CAP = 16 * 1024 * 1024
"""Largest grid-intensity CSV read (bytes): a year of 5-minute points is ~3 MiB."""


MAX_G_PER_KWH = 5000.0
"""Largest grid carbon intensity accepted (g CO2e / kWh): no grid, nor a lignite plant alone
(~1,100), comes near it; a value above is a unit slip (g/MWh) or hostile input, which would make
the carbon figure overflow to inf."""

MAX_GRID_TIME_S = 1e11
"""Largest grid-intensity time accepted, in unix seconds (year ~5100): times are multiplied with
intensities, and a 1e308 would overflow."""


def check_intensity(g: float, where: str) -> None:
    """ConfigError naming ``where`` unless ``g`` is a finite g CO2e / kWh in [0, MAX_G_PER_KWH]."""
    if not (math.isfinite(g) and 0 <= g <= MAX_G_PER_KWH):
        raise ConfigError(
            f"{where}: g_per_kwh {g!r} is not a finite number in [0, {MAX_G_PER_KWH:.0f}] g CO2e/kWh "
            "(grids are ~20-1,100; give the value in g per kWh)"
        )


@dataclass(frozen=True)
class GridIntensity:
    """Grid carbon intensity: ``points`` of (unix seconds, g CO2e / kWh), time-ordered; a single
    point is a constant."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        for t, g in self.points:
            check_intensity(g, "--grid-g-per-kwh")
            if not (math.isfinite(t) and abs(t) <= MAX_GRID_TIME_S):
                raise ConfigError(
                    f"grid intensity time {t!r}: not unix seconds within +-{MAX_GRID_TIME_S:.0e}"
                )

    def mean_over(self, start_s: float, end_s: float) -> float:
        """Time-weighted mean intensity over [start_s, end_s], each point held until the next
        (the first also before it)."""
        if end_s <= start_s:
            return self._at(start_s)
        total, t = 0.0, start_s
        for p, _ in self.points:
            if start_s < p < end_s:
                total += self._at(t) * (p - t)
                t = p
        total += self._at(t) * (end_s - t)
        return total / (end_s - start_s)

    def _at(self, t: float) -> float:
        value = self.points[0][1]
        for p, v in self.points:
            if p <= t:
                value = v
            else:
                break
        return value


def _time(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return datetime.fromisoformat(text.strip().replace("Z", "+00:00")).timestamp()


def read_grid_csv(path: Path) -> GridIntensity:
    """A ``time,g_per_kwh`` CSV (header optional), through the hardened reader. ConfigError
    naming the file and line on anything else."""
    try:
        text = read_bounded(path, GRID_CSV_CAP).decode("utf-8")
    except (OSError, UnicodeDecodeError, UnsafeFileError) as exc:
        raise ConfigError(f"--grid-csv {printable(path)}: unreadable ({printable(exc)})") from exc
    points = []
    rows = csv.reader(io.StringIO(text))
    lineno = 0
    while True:
        lineno += 1
        try:
            row = next(rows)
        except StopIteration:
            break
        except csv.Error as exc:  # a field over csv's limit (128 KiB), a NUL, an open quote
            raise ConfigError(
                f"--grid-csv {printable(path)}:{lineno}: not a CSV line ({printable(exc)}); expected "
                "'time,g_per_kwh'"
            ) from exc
        if not row or (lineno == 1 and row[0].strip().lower() in ("time", "t", "timestamp")):
            continue
        try:
            t, g = _time(row[0]), float(row[1])
        except (ValueError, IndexError) as exc:
            raise ConfigError(
                f"--grid-csv {printable(path)}:{lineno}: expected 'time,g_per_kwh' (unix seconds or "
                f"ISO 8601, a number), got {printable(','.join(row))}"
            ) from exc
        if not (math.isfinite(t) and abs(t) <= MAX_GRID_TIME_S):
            raise ConfigError(
                f"--grid-csv {printable(path)}:{lineno}: time {printable(row[0])} is not unix seconds "
                f"within +-{MAX_GRID_TIME_S:.0e} (or an ISO 8601 date)"
            )
        check_intensity(g, f"--grid-csv {printable(path)}:{lineno}")
        points.append((t, g))
    if not points:
        raise ConfigError(f"--grid-csv {printable(path)}: no data rows (expected 'time,g_per_kwh' lines)")
    return GridIntensity(tuple(sorted(points)))


def _sum(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return math.fsum(known) if known else None


class EnergyDataError(ValueError):
    """The run's energy data cannot be reported: a column holds values no device produces (a
    negative power, a counter that goes down again and again or never moves while power is drawn).
    The message names the column, the rank and the device; ``charllm energy`` exits 1."""


DISAGREEMENT_LIMIT = 0.5
"""Counter and integrated power further apart than this share (a stuck, jumping or foreign
counter) make the counter's column bad. Measured agreement: within 0.1 % on an H200 under load
(docs/devices-nvml.md), within ~1 % on the synthetic device."""


def _where(row: dict[str, Any]) -> str:
    return f"rank {printable(row.get('rank'))} device {printable(row.get('device_index'))}"


def check_device_row(row: dict[str, Any]) -> None:
    """Raise :class:`EnergyDataError` naming the bad column where one ``ranks`` row's energy
    inputs are corrupt; pass otherwise (a missing figure is not corrupt, only absent)."""
    where = _where(row)
    for name in ("power_avg_w", "power_peak_w", "energy_j", "energy_trapezoid_j", "energy_counter_j"):
        v = finite_or_none(row.get(name))
        if v is not None and v < 0:
            raise EnergyDataError(
                f"ranks.{name} = {v:.6g} for {where}: negative; the samples' power_instant_w / "
                "energy_mj are corrupt there (charllm inspect shows the samples)"
            )
    resets = finite_or_none(row.get("energy_counter_resets")) or 0
    if resets > 1:
        raise EnergyDataError(
            f"energy_mj of {where} went down {int(resets)} times (ranks.energy_counter_resets): a "
            "counter that resets more than once in a run is corrupt, so its energy is not reported"
        )
    counter = finite_or_none(row.get("energy_counter_j"))
    power = finite_or_none(row.get("energy_trapezoid_j"))
    if counter is not None and power is not None and power > 0 and resets == 0:
        gap = abs(counter - power) / power
        if gap > DISAGREEMENT_LIMIT:
            raise EnergyDataError(
                f"energy_mj of {where} disagrees with power_instant_w by {gap * 100:.0f} % "
                f"(ranks.energy_counter_j = {counter:.6g} J, ranks.energy_trapezoid_j = {power:.6g} J; "
                f"more than {DISAGREEMENT_LIMIT * 100:.0f} %): one of the two is corrupt"
            )


def device_energy(row: dict[str, Any], hz: float | None) -> dict[str, Any]:
    """One ``ranks`` table row's energy over its sampled time, the method, and its bound (J).

    The energy and its bound are the attribution's over the device's whole sampled span
    (``energy_j``, ``energy_bound_j``; docs/attribution.md, *Energy bounds*). A table without
    them (the Spark engine's) falls back to the counter's total with ``2 x update period x
    power`` at its edges and the uncovered share of the energy."""
    check_device_row(row)
    duration = finite_or_none(row.get("duration_s"))
    n = finite_or_none(row.get("n_samples")) or 0.0
    power = finite_or_none(row.get("power_avg_w"))
    period = 1.0 / hz if hz else None
    coverage = None
    if duration and period:
        coverage = min(1.0, n * period / duration) if duration > 0 else None
    counter_period = finite_or_none(row.get("energy_counter_period_s"))
    out: dict[str, Any] = {
        "rank": row.get("rank"),
        "device_index": row.get("device_index"),
        "host": row.get("host"),
        "duration_s": duration,
        "samples": int(n),
        "sample_hz": n / duration if duration else None,
        "coverage": coverage,
        "counter_update_period_s": counter_period,
    }
    if "energy_bound_j" in row:
        energy = finite_or_none(row.get("energy_j"))
        bound = finite_or_none(row.get("energy_bound_j")) if energy is not None else None
        method = str(row.get("energy_method") or "none") if energy is not None else "none"
        out.update(
            energy_j=energy,
            method=method,
            uncertainty_j=bound,
            bound_basis="attribution (docs/attribution.md, Energy bounds)"
            if bound is not None
            else ("no bound: a sampling gap or no instant power" if energy is not None else None),
        )
        return out
    counter = finite_or_none(row.get("energy_counter_j"))
    integrated = finite_or_none(row.get("energy_trapezoid_j"))
    energy, method = (counter, "counter") if counter is not None else (integrated, "integrated power")
    edge = (counter_period or period) if method == "counter" else period
    if power is None and energy is not None and duration:
        power = energy / duration
    parts = [
        2 * edge * power if edge is not None and power is not None else None,
        (1 - coverage) * energy if coverage is not None and energy is not None else None,
        2e-3 if method == "counter" else None,
    ]
    out.update(
        energy_j=energy,
        method=method if energy is not None else "none",
        uncertainty_j=math.fsum(x for x in parts if x) if energy is not None else None,
        bound_basis="2 x counter update period x power + uncovered share (no attribution columns)",
    )
    return out


def run_energy(
    info: dict[str, Any],
    device_rows: list[dict[str, Any]],
    manifests: dict[int, dict[str, Any]],
    *,
    grid: GridIntensity | None = None,
    pue: float = 1.0,
) -> dict[str, Any]:
    """The energy report of one run: ``info`` is its ``runs`` table row, ``device_rows`` its
    ``ranks`` table rows, ``manifests`` its ranks' manifests. JSON-ready."""
    hz = finite_or_none(info.get("sampling_hz"))
    devices = [device_energy(r, hz) for r in device_rows]
    total = _sum([d["energy_j"] for d in devices])
    measured = [d for d in devices if d["energy_j"] is not None]
    # Bounds add; one device with energy but no bound leaves the total unbounded (said, not 0).
    unbounded = [d for d in measured if d["uncertainty_j"] is None]
    bound = None if unbounded or not measured else math.fsum(d["uncertainty_j"] for d in measured)
    declared = [info.get("world_size")] + [m.get("world_size") for m in manifests.values()]
    worlds = [w for w in declared if isinstance(w, int) and not isinstance(w, bool) and w > 0]
    world = max(worlds) if worlds else None  # a rank folder missing still declares its world
    measured_ranks = sorted(
        {int(d["rank"]) for d in devices if d["energy_j"] is not None and d["rank"] is not None}
    )
    missing = (world - len(measured_ranks)) if isinstance(world, int) and world >= len(measured_ranks) else 0
    steps = info.get("measured_steps")
    step_energy = finite_or_none(info.get("energy_j"))
    for name in ("energy_j", "tokens_per_j", "energy_per_token_j", "power_avg_w"):
        v = finite_or_none(info.get(name))
        if v is not None and v < 0:
            raise EnergyDataError(
                f"runs.{name} = {v:.6g} for run {printable(info.get('run'))}: negative, from a corrupt "
                "energy_mj or power_instant_w column (charllm energy reports nothing from it)"
            )
    out: dict[str, Any] = {
        "run": info.get("run"),
        "synthetic": bool(info.get("synthetic")),
        "energy_j": total,
        "energy_kwh": total / 3.6e6 if total is not None else None,
        "uncertainty_j": bound,
        "uncertainty_share": bound / total if bound is not None and total else None,
        "unbounded_devices": [f"rank {d['rank']} device {d['device_index']}" for d in unbounded],
        "energy_per_step_bound_j": finite_or_none(info.get("energy_bound_j")) / steps
        if finite_or_none(info.get("energy_bound_j")) is not None and steps
        else None,
        "power_avg_w": finite_or_none(info.get("power_avg_w")),
        "ranks_measured": len(measured_ranks),
        "ranks_missing": missing,
        "energy_scaled_to_world_j": total * world / len(measured_ranks)
        if missing and total is not None and measured_ranks and isinstance(world, int)
        else None,
        "measured_steps": steps,
        "energy_per_step_j": step_energy / steps if step_energy is not None and steps else None,
        "tokens_per_j": finite_or_none(info.get("tokens_per_j")),
        "energy_per_token_j": finite_or_none(info.get("energy_per_token_j")),
        "per_device": devices,
        "mlperf": mlperf_check(devices, manifests, world, hz),
    }
    if grid is not None and total is not None:
        start, end = _wall_span(manifests)
        intensity = grid.mean_over(start, end) if start is not None and end is not None else grid.points[0][1]
        kwh = total / 3.6e6 * pue
        out["carbon"] = {
            "pue": pue,
            "grid_g_per_kwh": intensity,
            "grid_points": len(grid.points),
            "facility_kwh": kwh,
            "co2e_g": kwh * intensity,
            "co2e_g_bound": (bound or 0.0) / 3.6e6 * pue * intensity,
            "weighting": "time over the run's wall-clock span" if len(grid.points) > 1 else "constant",
        }
    return out


def _wall_span(manifests: dict[int, dict[str, Any]]) -> tuple[float | None, float | None]:
    starts = [v for m in manifests.values() if isinstance(v := m.get("started_wall_ns"), int)]
    ends = [v for m in manifests.values() if isinstance(v := m.get("ended_wall_ns"), int)]
    return (min(starts) / 1e9 if starts else None, max(ends) / 1e9 if ends else None)


def mlperf_check(
    devices: list[dict[str, Any]], manifests: dict[int, dict[str, Any]], world: Any, hz: float | None
) -> dict[str, Any]:
    """MLPerf Training's power rules that the data can show: every node measured, >= 1 Hz,
    >= 60 samples a device. ``meets``: all three hold; ``reasons``: each that does not."""
    reasons = []
    hosts = {str(m.get("host")) for m in manifests.values() if m.get("host")}
    measured_hosts = {str(d["host"]) for d in devices if d["energy_j"] is not None and d.get("host")}
    if hosts - measured_hosts:
        reasons.append(
            f"node(s) without energy: {', '.join(sorted(printable(h) for h in hosts - measured_hosts))}"
        )
    if isinstance(world, int):
        ranks = {d["rank"] for d in devices if d["energy_j"] is not None}
        if len(ranks) < world:
            reasons.append(f"{world - len(ranks)} of {world} ranks without energy")
    slow = [d for d in devices if d["sample_hz"] is not None and d["sample_hz"] < MLPERF_MIN_HZ]
    if (hz is not None and hz < MLPERF_MIN_HZ) or slow:
        reasons.append(f"sampled below {MLPERF_MIN_HZ:g} Hz")
    few = [d for d in devices if d["samples"] < MLPERF_MIN_SAMPLES]
    if few:
        reasons.append(f"{len(few)} device(s) with fewer than {MLPERF_MIN_SAMPLES} samples")
    if not devices:
        reasons.append("no device measured")
    return {
        "meets": not reasons,
        "checked": [
            "all nodes measured",
            f">= {MLPERF_MIN_HZ:g} Hz",
            f">= {MLPERF_MIN_SAMPLES} samples a device",
        ],
        "reasons": reasons,
        "not_checked": "an approved power meter and the whole system's AC power (a GPU counter is not that)",
    }


def energy_reports(
    analysis: Any, *, grid: GridIntensity | None = None, pue: float = 1.0
) -> list[dict[str, Any]]:
    """One energy report per analysed run (:class:`~charllm_nemo.analysis.analyze.Analysis`)."""
    if not (math.isfinite(pue) and pue >= 1.0):
        raise ConfigError(f"--pue {pue}: a power usage effectiveness is a finite number >= 1 (e.g. 1.2)")
    runs = {r["run"]: r for r in analysis.tables["runs"].to_pylist()}
    ranks = analysis.tables["ranks"].to_pylist()
    out = []
    for run in analysis.runs:
        info = runs.get(run.key)
        if info is None:
            continue
        hosts = {r: m.get("host") for r, m in run.manifests.items()}
        rows = [dict(r, host=hosts.get(int(r["rank"]))) for r in ranks if r.get("run") == run.key]
        out.append(run_energy(info, rows, run.manifests, grid=grid, pue=pue))
    return out


def _f(v: Any, unit: str = "") -> str:
    return "n/a" if v is None else f"{v:.4g}{unit}"


def render(reports: list[dict[str, Any]]) -> str:
    """The energy reports as console text (strings from the run escaped)."""
    lines = []
    for r in reports:
        share = r["uncertainty_share"]
        lines.append(
            f"{printable(r['run'])}{' (synthetic device)' if r['synthetic'] else ''}: "
            f"{_f(r['energy_j'], ' J')} +- "
            f"{'unbounded' if r['uncertainty_j'] is None else _f(r['uncertainty_j'], ' J')}"
            f"{'' if share is None else f' ({share * 100:.2g} %)'} over {r['ranks_measured']} rank(s)"
        )
        if r["ranks_missing"]:
            lines.append(
                f"  {r['ranks_missing']} rank(s) missing: a lower bound; scaled to the world "
                f"{_f(r['energy_scaled_to_world_j'], ' J')}"
            )
        if r["unbounded_devices"]:
            lines.append(
                f"  no bound for {', '.join(r['unbounded_devices'])} (a sampling gap or no instant power)"
            )
        lines.append(
            f"  per step {_f(r['energy_per_step_j'], ' J')} +- {_f(r['energy_per_step_bound_j'], ' J')} "
            f"over {r['measured_steps']} measured steps ({_f(r['power_avg_w'], ' W')} a device over "
            f"them); {_f(r['tokens_per_j'])} tokens/J"
        )
        for d in r["per_device"]:
            lines.append(
                f"  rank {d['rank']} device {d['device_index']}: {_f(d['energy_j'], ' J')} +- "
                f"{_f(d['uncertainty_j'], ' J')} ({d['method']}), coverage {_f(d['coverage'])}, "
                f"counter period {_f(d['counter_update_period_s'], ' s')}"
            )
        c = r.get("carbon")
        if c:
            lines.append(
                f"  carbon: {_f(c['co2e_g'], ' g CO2e')} +- {_f(c['co2e_g_bound'], ' g')} "
                f"({_f(c['facility_kwh'], ' kWh')} at PUE {c['pue']:g}, "
                f"{_f(c['grid_g_per_kwh'])} g/kWh, {c['weighting']})"
            )
        m = r["mlperf"]
        verdict = "meets" if m["meets"] else "does not meet"
        why = "" if m["meets"] else ": " + "; ".join(m["reasons"])
        lines.append(f"  MLPerf Training power rules ({', '.join(m['checked'])}): {verdict}{why}")
    return "\n".join(lines)
