"""The job as the power grid sees it: every rank's instant power on one wall-clock time base,
resampled to a common grid and summed per node, per job and per named group (a rack), and what
the grid cares about in it (:mod:`.grid_metrics`): swing per iteration, ramp rates, spectrum,
and what a power floor would cost. Tables ``grid_power`` and ``grid_whatif``
(docs/analysis.md, *The job as the grid sees it*).

Time base: each rank's samples carry ``t_mono_ns`` (its host's CLOCK_MONOTONIC) and ``t_wall_ns``
(its wall clock). A rank's wall time is ``t_mono_ns`` plus the offset of the manifest's ``clock``
record when the run wrote one (telemetry/clock.py, with the host's NTP/PTP state, whose maximum
error bounds the alignment between hosts), else the median ``t_wall_ns - t_mono_ns`` of its
samples; then the hosts' wall clocks are trusted as they are and the alignment error is unknown.

Memory: one rank's samples at a time; the aggregates are one float array per node, group and
the job (an hour at 10 ms is 360,000 points, 2.9 MB each)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from charllm_nemo.analysis import grid_metrics as gm
from charllm_nemo.analysis.load import Run
from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.figures import finite_or_none
from charllm_nemo.telemetry.filecheck import printable
from charllm_nemo.telemetry.layout import UnsafeFileError, read_bounded
from charllm_nemo.telemetry.reader import CorruptSegmentWarning, read_segments
from charllm_nemo.telemetry.sampler import SAMPLES_SCHEMA
from charllm_nemo.telemetry.store import WINDOWS_SCHEMA

Array = np.ndarray[Any, Any]

POWER_SCOPE = (
    "GPU-visible power (the sampled GPUs' instant board power; CPU, NIC, switches and cooling not included)"
)
"""What the waveform is, said beside every figure of it (``power_instant_w`` summed)."""

MODULE_POWER_SCOPE = (
    "module power (GPU+CPU+memory of the Grace module: NVML power scope MODULE; NIC, switches "
    "and cooling not included)"
)
"""What the waveform is when every sampled GPU reports its module's power (``power_module_w``:
GH200 / GB200, devices-nvml.md): that is summed instead of the GPUs' own."""


def scope_name(power_scope: str) -> str:
    """The short name of a ``power_scope`` label: ``module`` or ``GPU-visible``."""
    return "module" if power_scope == MODULE_POWER_SCOPE else "GPU-visible"


MAX_GAP_S = 0.1
"""Samples further apart than this are not interpolated across: the grid points between are
uncovered, and an aggregate over them is not drawn (NaN), rather than read low."""

MAX_GRID_POINTS = 20_000_000
"""Longest waveform built (55 h at 10 ms; each sum holds 12 bytes a point): a device whose samples
would stretch the job past it (a clock years off, a longer run at this step) is left out, with a
line in ``problems`` (a longer run needs a longer ``--wave-step-ms``)."""

RACK_MAP_CAP = 16 * 2**20
"""Largest host -> group map file read."""


@dataclass(frozen=True)
class GridOptions:
    """How the waveform is built and read: the grid step, the fleet to scale to, the critical
    band, the power floors of the what-if (W per GPU; empty: six floors from the job's mean GPU
    trough to its peak), host -> group (rack), the ramp window (0: one grid step), Welch's
    segment length."""

    step_s: float = 0.01
    fleet_gpus: int | None = None
    band_hz: tuple[float, float] = (0.1, 20.0)
    floors_w: tuple[float, ...] = ()
    groups: Mapping[str, str] = field(default_factory=dict)
    ramp_window_s: float = 0.0
    segment_s: float = 20.0

    def __post_init__(self) -> None:
        if not (0.0005 <= self.step_s <= 10.0):
            raise ConfigError(f"grid step {self.step_s} s: give 0.0005 to 10 s (default 0.01)")
        lo, hi = self.band_hz
        if not (0 <= lo < hi):
            raise ConfigError(f"critical band {lo}-{hi} Hz: give LO < HI, both >= 0 (default 0.1 20)")
        if self.fleet_gpus is not None and not 0 < self.fleet_gpus <= 10**9:
            raise ConfigError(f"--fleet-gpus {self.fleet_gpus}: give a count of GPUs, 1 to 10^9")
        if any(not (math.isfinite(f) and f >= 0) for f in self.floors_w):
            raise ConfigError(f"power floors {list(self.floors_w)}: give watts per GPU, >= 0")


def read_group_map(path: Path) -> dict[str, str]:
    """A host -> group (rack) map: one ``host group`` or ``host,group`` pair per line; blank
    lines and ``#`` comments skipped. Read through the hardened reader; ConfigError naming the
    file and line on anything else."""
    try:
        text = read_bounded(path, RACK_MAP_CAP).decode("utf-8")
    except (OSError, UnicodeDecodeError, UnsafeFileError) as exc:
        raise ConfigError(f"--rack-map {printable(path)}: unreadable ({printable(exc)})") from exc
    out: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = [p.strip() for p in line.replace(",", " ").split()]
        if len(parts) != 2:
            raise ConfigError(
                f"--rack-map {printable(path)}:{lineno}: expected 'host rack', got {printable(line)}"
            )
        out[parts[0]] = parts[1]
    return out


@dataclass
class RankClock:
    """How one rank's monotonic timestamps become wall-clock time, and how far to trust it."""

    wall_minus_mono_ns: int
    source: str  # "manifest" | "samples"
    sync: str  # ntp | ptp | none | unknown
    error_ns: float | None  # the wall clock's error estimate against true time; None: unknown


def rank_clock(manifest: Mapping[str, Any], t_mono: Array, t_wall: Array) -> RankClock | None:
    """The manifest's ``clock`` record (telemetry/clock.py; docs/store.md) when the run wrote one,
    else the samples' own wall clock (None when neither gives a mapping).

    From the record: the offset is the middle of the start's and the close's wall-minus-monotonic
    measurements (the start's alone when the run was not closed); its error against true time,
    when the host's clock was synchronized at both, is the kernel's maximum error (the larger of
    the two) plus the measurement's uncertainty plus half the offset's drift over the run; a host
    not known to be synchronized has an unknown error."""
    clock = manifest.get("clock")
    start = clock.get("wall_minus_monotonic_ns_start") if isinstance(clock, Mapping) else None
    if isinstance(clock, Mapping) and isinstance(start, int):
        end = clock.get("wall_minus_monotonic_ns_end")
        end = end if isinstance(end, int) else start
        syncs = [s for s in (clock.get("sync"), clock.get("sync_end")) if s is not None]
        first = syncs[0] if syncs and isinstance(syncs[0], Mapping) else {}
        source = str(first.get("source") or "unknown")
        max_errors = [
            s["max_error_ns"]
            for s in syncs
            if isinstance(s, Mapping)
            and s.get("synchronized") is True
            and isinstance(s.get("max_error_ns"), int)
        ]
        unc = clock.get("measure_uncertainty_ns")
        error = None
        if syncs and len(max_errors) == len(syncs):
            error = float(max(max_errors)) + (unc if isinstance(unc, int) else 0) + abs(end - start) / 2
        return RankClock((start + end) // 2, "manifest", source, error)
    ok = (t_wall > 0) & (t_mono > 0)
    if not ok.any():
        return None
    return RankClock(int(np.median(t_wall[ok] - t_mono[ok])), "samples", "unknown", None)


class _Sum:
    """A sum of series on the absolute grid (index k: wall time ``k x step``), growing as series
    arrive, and how many series covered each point."""

    def __init__(self) -> None:
        self.k0 = 0
        self.total = np.zeros(0)
        self.count = np.zeros(0, np.int32)
        self.members = 0

    def span_with(self, k0: int, n: int) -> int:
        """Points the sum would hold with a series of ``n`` points from ``k0`` added."""
        if len(self.total) == 0:
            return n
        return max(self.k0 + len(self.total), k0 + n) - min(self.k0, k0)

    def add(self, k0: int, x: Array) -> None:
        self.members += 1
        if len(self.total) == 0:
            self.k0, self.total, self.count = k0, np.zeros(len(x)), np.zeros(len(x), np.int32)
        lo, hi = min(self.k0, k0), max(self.k0 + len(self.total), k0 + len(x))
        if lo < self.k0 or hi > self.k0 + len(self.total):
            total, count = np.zeros(hi - lo), np.zeros(hi - lo, np.int32)
            total[self.k0 - lo : self.k0 - lo + len(self.total)] = self.total
            count[self.k0 - lo : self.k0 - lo + len(self.count)] = self.count
            self.k0, self.total, self.count = lo, total, count
        ok = np.isfinite(x)
        sl = slice(k0 - self.k0, k0 - self.k0 + len(x))
        self.total[sl] += np.where(ok, x, 0.0)
        self.count[sl] += ok

    def series(self, k0: int, n: int) -> Array:
        """Points ``k0 .. k0 + n`` of the sum; NaN where a member did not cover the point."""
        out = np.full(n, np.nan)
        a, b = max(k0, self.k0), min(k0 + n, self.k0 + len(self.total))
        if b > a:
            full = self.count[a - self.k0 : b - self.k0] == self.members
            out[a - k0 : b - k0] = np.where(full, self.total[a - self.k0 : b - self.k0], np.nan)
        return out


class _Sums:
    """The job's, each node's and each group's :class:`_Sum` of one power column."""

    def __init__(self, groups: Mapping[str, str]) -> None:
        self.job = _Sum()
        self.nodes: dict[str, _Sum] = {}
        self.groups: dict[str, _Sum] = {}
        self._group_of = groups

    def add(self, host: str, k0: int, x: Array) -> None:
        self.job.add(k0, x)
        self.nodes.setdefault(host, _Sum()).add(k0, x)
        if host in self._group_of:
            self.groups.setdefault(self._group_of[host], _Sum()).add(k0, x)


@dataclass
class JobWaveform:
    """A run's power on one grid: ``t0_ns`` (wall clock of point 0), ``step_s``; the job's, each
    node's and each group's sums (W, NaN where some GPU of it was not covered), the GPUs in each,
    the iterations (grid index ranges), the alignment error (s; None: unknown); what the watts are
    (``power_scope``: :data:`POWER_SCOPE` or :data:`MODULE_POWER_SCOPE`) and the samples column
    summed (``power_column``)."""

    t0_ns: int
    step_s: float
    job: Array
    n_gpus: int
    nodes: dict[str, tuple[Array, int]]
    groups: dict[str, tuple[Array, int]]
    iterations: list[tuple[int, int]]
    iteration_period_s: float
    alignment_error_s: float | None
    time_base: str
    power_scope: str = POWER_SCOPE
    power_column: str = "power_instant_w"


def job_waveform(run: Run, options: GridOptions, problems: list[str]) -> JobWaveform | None:
    """Read ``run`` one rank at a time and build its waveform (None when no rank has instant
    power; with a line in ``problems`` when the ranks' samples never overlap). A segment that
    cannot be read is skipped here without a line: the analysis's own read of it reports it.

    Where every device with instant power also reports its module's power (``power_module_w``,
    NVML power scope MODULE: a Grace module's GPU + CPU + memory), the module power is summed
    instead and the waveform says so (``power_scope``); where only some do, the GPUs' own power
    is summed, with a line in ``problems``. Both sums are built while the module power lasts."""
    seen: list[str] = []
    step_ns = max(1, round(options.step_s * 1e9))
    gpu_sums: _Sums = _Sums(options.groups)
    module_sums: _Sums | None = _Sums(options.groups)
    without_module: list[str] = []  # "rank r device d" with instant power but no module power
    clocks: dict[str, list[RankClock]] = {}
    steps: tuple[Array, Array] | None = None
    for r in run.ranks:
        files = run.files.ranks[r]
        cols = ["t_mono_ns", "t_wall_ns", "device_index", "power_instant_w", "power_module_w"]
        with warnings.catch_warnings():  # warned of once, by the analysis's own read
            warnings.simplefilter("ignore", CorruptSegmentWarning)
            t = read_segments(files.samples, "samples", SAMPLES_SCHEMA, seen, cols)
        if t is None or t.num_rows == 0:
            continue
        mono = _ints(t, "t_mono_ns")
        clock = rank_clock(run.manifests.get(r, {}), mono, _ints(t, "t_wall_ns"))
        power = t.column("power_instant_w").to_numpy(zero_copy_only=False).astype(np.float64)
        module = t.column("power_module_w").to_numpy(zero_copy_only=False).astype(np.float64)
        if clock is None or not np.isfinite(power).any():
            continue
        host = str(run.manifests.get(r, {}).get("host") or "?")
        clocks.setdefault(host, []).append(clock)
        if abs(clock.wall_minus_mono_ns) >= 2**62:
            continue
        sane = (mono > 0) & (mono < 2**62)  # no int64 overflow below
        wall = np.where(sane, mono, 0) + clock.wall_minus_mono_ns
        devs = _ints(t, "device_index")
        for d in np.unique(devs):
            mine = devs == d
            w, p = wall[mine], power[mine]
            ok = np.isfinite(p) & sane[mine] & (w > 0)
            if ok.sum() < 2:
                continue
            k0, k1 = -(-int(w[ok].min()) // step_ns), int(w[ok].max()) // step_ns  # the absolute grid
            if k1 <= k0:
                continue
            if gpu_sums.job.span_with(k0, k1 - k0 + 1) > MAX_GRID_POINTS:
                problems.append(
                    f"{run.path}: rank {r} device {d}'s samples would stretch the job power waveform past "
                    f"{MAX_GRID_POINTS} points of {options.step_s:g} s (a clock far off, or a run this long "
                    "needs a longer --wave-step-ms); left out of it"
                )
                continue
            grid = np.arange(k1 - k0 + 1) * (step_ns / 1e9)  # s since grid point k0
            gpu_sums.add(host, k0, gm.resample_linear((w[ok] - k0 * step_ns) / 1e9, p[ok], grid, MAX_GAP_S))
            m = module[mine]
            okm = np.isfinite(m) & sane[mine] & (w > 0)
            if okm.sum() < 2:
                without_module.append(f"rank {r} device {d}")
                module_sums = None  # one device without it: the GPUs' own power is summed
            elif module_sums is not None:
                x = gm.resample_linear((w[okm] - k0 * step_ns) / 1e9, m[okm], grid, MAX_GAP_S)
                module_sums.add(host, k0, x)
        if steps is None:
            steps = _step_times(files.windows, clock, seen)
    if gpu_sums.job.members == 0:  # no instant power (a backend without it): no waveform, no row
        return None
    with_module = gpu_sums.job.members - len(without_module)
    if with_module and without_module:
        problems.append(
            f"{run.path}: {with_module} GPU(s) report module power (NVML power scope MODULE) but "
            f"{', '.join(without_module[:4])}{' ...' if len(without_module) > 4 else ''} do(es) not: "
            "the job power waveform sums the GPUs' own power (GPU-visible) for all of them"
        )
    sums, scope, column = (
        (module_sums, MODULE_POWER_SCOPE, "power_module_w")
        if module_sums is not None
        else (gpu_sums, POWER_SCOPE, "power_instant_w")
    )
    job = sums.job
    covered = np.flatnonzero(job.count == job.members)
    if len(covered) < 2:
        problems.append(f"{run.path}: the ranks' samples never overlap in time; no job power waveform")
        return None
    k0, n = job.k0 + int(covered[0]), int(covered[-1] - covered[0]) + 1
    x = job.series(k0, n)
    t0_ns = k0 * step_ns
    iterations, period = _iterations(x, options, steps, t0_ns)
    error, base = _alignment(clocks)
    return JobWaveform(
        t0_ns, options.step_s, x, job.members,
        {h: (s.series(k0, n), s.members) for h, s in sorted(sums.nodes.items())},
        {g: (s.series(k0, n), s.members) for g, s in sorted(sums.groups.items())},
        iterations, period, error, base, scope, column,
    )  # fmt: skip


def _ints(t: pa.Table, name: str) -> Array:
    return np.asarray(t.column(name).fill_null(0).to_numpy(), dtype=np.int64)


def _step_times(paths: tuple[Path, ...], clock: RankClock, problems: list[str]) -> tuple[Array, Array] | None:
    """(begins, ends) of one rank's step windows in wall-clock ns (None: no step windows)."""
    cols = ["kind", "t_begin_mono_ns", "t_end_mono_ns"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CorruptSegmentWarning)
        w = read_segments(paths, "windows", WINDOWS_SCHEMA, problems, cols)
    if w is None or w.num_rows == 0:
        return None
    kind = np.asarray(w.column("kind").to_pylist(), dtype=object)
    b, e = _ints(w, "t_begin_mono_ns"), _ints(w, "t_end_mono_ns")
    keep = (kind == "step") & (b > 0) & (e > b) & (e < 2**62)
    if not keep.any():
        return None
    return b[keep] + clock.wall_minus_mono_ns, e[keep] + clock.wall_minus_mono_ns


def _iterations(
    x: Array, options: GridOptions, steps: tuple[Array, Array] | None, t0_ns: int
) -> tuple[list[tuple[int, int]], float]:
    """The iterations as grid ranges and their median period: rank 0's step windows (the first
    rank with any), else chunks of the dominant period."""
    if steps is not None:
        b, e = (steps[0] - t0_ns) / 1e9, (steps[1] - t0_ns) / 1e9
        bounds = gm.iteration_bounds(len(x), options.step_s, b, e)
        period = float(np.median(np.diff(np.sort(b)))) if len(b) > 1 else math.nan
        if bounds:
            return bounds, period
    spec = gm.spectrum(x, options.step_s, options.band_hz, options.segment_s)
    if not math.isfinite(spec.dominant_hz) or spec.dominant_hz <= 0:
        return [], math.nan
    return gm.period_bounds(len(x), options.step_s, 1.0 / spec.dominant_hz), math.nan


def _alignment(clocks: dict[str, list[RankClock]]) -> tuple[float | None, str]:
    """The alignment error between hosts (s): ranks of one host share its clock (0); across
    hosts, the two largest error estimates added (None when a host's is unknown, or when ranks
    name no host: they may sit on several). And the time base in words."""
    sources = sorted({f"{c.source}/{c.sync}" for cs in clocks.values() for c in cs})
    base = "wall clock = t_mono_ns + " + ", ".join(
        "manifest clock mapping (sync " + s.split("/")[1] + ")"
        if s.startswith("manifest")
        else "samples' t_wall_ns"
        for s in sources
    )
    if len(clocks) == 1 and "?" not in clocks:
        return 0.0, base + "; one host, one clock"
    if len(clocks) == 1 and len(clocks["?"]) == 1:
        return 0.0, base + "; one rank, one clock"
    errs = [[c.error_ns for c in cs] for cs in clocks.values()]
    if "?" in clocks or any(e is None for host in errs for e in host):  # "?": ranks of unnamed hosts
        return (
            None,
            base
            + "; the hosts' clock sync is not recorded (or a rank names no host): alignment error unknown",
        )
    top = sorted((max(float(e) for e in host if e is not None) for host in errs), reverse=True)
    return (top[0] + top[1]) / 1e9, base


GRID_POWER_COLUMNS: tuple[str, ...] = (
    "run", "scope", "name", "gpus", "power_scope", "power_column", "time_base", "alignment_error_s", "step_s",
    "resample", "duration_s", "peak_w", "trough_w", "mean_w", "iterations", "iteration_period_s",
    "iteration_hz", "swing_p50_w", "swing_max_w", "swing_pct_of_peak", "ramp_window_s",
    "ramp_up_p50_w_per_s", "ramp_up_p99_w_per_s", "ramp_up_max_w_per_s",
    "ramp_down_p50_w_per_s", "ramp_down_p99_w_per_s", "ramp_down_max_w_per_s",
    "dominant_hz", "dominant_amplitude_w", "band_lo_hz", "band_hi_hz", "band_share",
    "swing_1s_avg_w", "ramp_1s_avg_max_w_per_s", "fleet_gpus", "fleet_swing_mw",
    "fleet_ramp_up_max_mw_per_s", "fleet_ramp_down_max_mw_per_s", "fleet_dominant_amplitude_mw",
)  # fmt: skip
"""``grid_power``'s columns (docs/analysis.md)."""

WHATIF_COLUMNS: tuple[str, ...] = (
    "run", "floor_w", "floor_source", "gpus", "iterations", "energy_j", "extra_energy_j", "extra_energy_pct",
    "extra_energy_per_step_j", "extra_energy_per_token_j", "swing_p50_w", "swing_remaining_p50_w",
    "swing_remaining_pct", "fleet_gpus", "fleet_extra_power_mw",
)  # fmt: skip
"""``grid_whatif``'s columns (docs/analysis.md)."""


def training_span(x: Array, wf: JobWaveform) -> Array:
    """``x`` from the first iteration's start to the last one's end (the whole of ``x`` without
    iterations): the spectrum and the 1 s averages read training, not the warm-up or the idle
    time before and after it."""
    return x[wf.iterations[0][0] : wf.iterations[-1][1]] if wf.iterations else x


def scope_row(x: Array, gpus: int, wf: JobWaveform, options: GridOptions) -> dict[str, Any]:
    """One ``grid_power`` row's figures for the series ``x`` of ``gpus`` GPUs."""
    dt = wf.step_s
    peak = float(np.nanmax(x)) if np.isfinite(x).any() else math.nan
    sw = gm.swing(x, wf.iterations)
    window = options.ramp_window_s or dt
    rp = gm.ramps(x, dt, wf.iterations, window)
    steady = training_span(x, wf)
    spec = gm.spectrum(steady, dt, options.band_hz, options.segment_s)
    coarse = gm.block_average(gm.longest_covered(steady), dt, 1.0)
    row: dict[str, Any] = {
        "gpus": gpus, "power_scope": wf.power_scope, "power_column": wf.power_column,
        "time_base": wf.time_base, "alignment_error_s": wf.alignment_error_s, "step_s": dt,
        "resample": "linear", "duration_s": len(x) * dt, "peak_w": peak,
        "trough_w": float(np.nanmin(x)) if np.isfinite(x).any() else math.nan,
        "mean_w": float(np.nanmean(x)) if np.isfinite(x).any() else math.nan,
        "iterations": sw.iterations, "iteration_period_s": wf.iteration_period_s,
        "iteration_hz": 1.0 / wf.iteration_period_s if wf.iteration_period_s > 0 else math.nan,
        "swing_p50_w": sw.p50_w, "swing_max_w": sw.max_w,
        "swing_pct_of_peak": 100 * sw.p50_w / peak if peak > 0 else math.nan,
        "ramp_window_s": max(1, round(window / dt)) * dt,
        "ramp_up_p50_w_per_s": rp.up[0], "ramp_up_p99_w_per_s": rp.up[1], "ramp_up_max_w_per_s": rp.up[2],
        "ramp_down_p50_w_per_s": rp.down[0], "ramp_down_p99_w_per_s": rp.down[1],
        "ramp_down_max_w_per_s": rp.down[2],
        "dominant_hz": spec.dominant_hz, "dominant_amplitude_w": spec.dominant_amplitude_w,
        "band_lo_hz": options.band_hz[0], "band_hi_hz": options.band_hz[1], "band_share": spec.band_share,
        "swing_1s_avg_w": float(np.ptp(coarse)) if len(coarse) > 1 else math.nan,
        "ramp_1s_avg_max_w_per_s": float(np.max(np.abs(np.diff(coarse)))) if len(coarse) > 1 else math.nan,
    }  # fmt: skip
    n = options.fleet_gpus
    scale = n / gpus / 1e6 if n else math.nan
    row.update(
        fleet_gpus=n,
        fleet_swing_mw=sw.p50_w * scale,
        fleet_ramp_up_max_mw_per_s=rp.up[2] * scale,
        fleet_ramp_down_max_mw_per_s=rp.down[2] * scale,
        fleet_dominant_amplitude_mw=spec.dominant_amplitude_w * scale,
    )
    return {k: (finite_or_none(v) if isinstance(v, float) else v) for k, v in row.items()}


def default_floors(wf: JobWaveform) -> tuple[float, ...]:
    """Six floors (W per GPU) from the job's mean GPU trough to its peak."""
    mean_gpu = wf.job / wf.n_gpus
    if not np.isfinite(mean_gpu).any():
        return ()
    lo, hi = float(np.nanmin(mean_gpu)), float(np.nanmax(mean_gpu))
    return tuple(float(round(v, 1)) for v in np.linspace(lo, hi, 6))


def whatif_rows(
    run: str, wf: JobWaveform, options: GridOptions, tokens_per_step: float | None
) -> list[dict[str, Any]]:
    """One ``grid_whatif`` row per floor."""
    floors, source = (options.floors_w, "given") if options.floors_w else (default_floors(wf), "auto")
    base = gm.swing(wf.job, wf.iterations).p50_w
    iters = len(wf.iterations)
    out = []
    for f in floors:
        w = gm.floor_what_if(wf.job, wf.n_gpus, wf.step_s, f, wf.iterations)
        per_step = w.extra_energy_j / iters if iters else math.nan
        span = (wf.iterations[-1][1] - wf.iterations[0][0]) * wf.step_s if iters else math.nan
        row = {
            "run": run, "floor_w": f, "floor_source": source, "gpus": wf.n_gpus, "iterations": iters,
            "energy_j": w.energy_j, "extra_energy_j": w.extra_energy_j,
            "extra_energy_pct": 100 * w.extra_energy_j / w.energy_j if w.energy_j > 0 else math.nan,
            "extra_energy_per_step_j": per_step,
            "extra_energy_per_token_j": per_step / tokens_per_step if tokens_per_step else math.nan,
            "swing_p50_w": base, "swing_remaining_p50_w": w.swing_p50_w,
            "swing_remaining_pct": 100 * w.swing_p50_w / base if base > 0 else math.nan,
            "fleet_gpus": options.fleet_gpus,
            "fleet_extra_power_mw": w.extra_energy_j / span / wf.n_gpus * options.fleet_gpus / 1e6
            if options.fleet_gpus and span > 0 else math.nan,
        }  # fmt: skip
        out.append({k: (finite_or_none(v) if isinstance(v, float) else v) for k, v in row.items()})
    return out


def grid_tables(
    runs: list[Run], runs_table: pa.Table, options: GridOptions, problems: list[str]
) -> dict[str, pa.Table]:
    """``grid_power`` (one row per run x scope: the job, each node, each group) and
    ``grid_whatif`` (one row per run x floor); empty dict when no run has instant power."""
    info = {r["run"]: r for r in runs_table.to_pylist()}
    power, whatif = [], []
    for run in runs:
        wf = job_waveform(run, options, problems)
        if wf is None:
            continue
        scopes = [("job", "job", wf.job, wf.n_gpus)]
        scopes += [("node", h, x, g) for h, (x, g) in wf.nodes.items()]
        scopes += [("group", k, x, g) for k, (x, g) in wf.groups.items()]
        for scope, name, x, gpus in scopes:
            power.append({"run": run.key, "scope": scope, "name": name, **scope_row(x, gpus, wf, options)})
        row = info.get(run.key, {})
        gbs, seq = row.get("global_batch_size"), row.get("seq_length")
        whatif += whatif_rows(run.key, wf, options, gbs * seq if gbs and seq else None)
    if not power:
        return {}
    return {
        "grid_power": pa.Table.from_pylist([{c: r.get(c) for c in GRID_POWER_COLUMNS} for r in power]),
        "grid_whatif": pa.Table.from_pylist([{c: r.get(c) for c in WHATIF_COLUMNS} for r in whatif]),
    }
