"""The job power waveform: every rank's instant power on one wall-clock time base, resampled to
a common grid and summed per node, per job and per named group (a rack). :mod:`.grid_power`
reads what the grid cares about in it and makes the tables (docs/grid.md).

Time base: each rank's samples carry ``t_mono_ns`` (its host's CLOCK_MONOTONIC) and ``t_wall_ns``
(its wall clock). A rank's wall time is ``t_mono_ns`` plus the offset of the manifest's ``clock``
record when the run wrote one (telemetry/clock.py, with the host's NTP/PTP state, whose maximum
error bounds the alignment between hosts), else the median ``t_wall_ns - t_mono_ns`` of its
samples; then the hosts' wall clocks are trusted as they are and the alignment error is unknown.

Two steps: :func:`rank_wave` puts one rank's devices on the grid (where its samples are: the
analysis's worker processes do it from the arrays they already read, so the samples are read
once), and :class:`WaveBuilder` adds the ranks' series in rank order into the sums.
:func:`job_waveform` does both for a run read here (figures, the Spark engine).

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
from charllm_nemo.analysis.metrics import distinct
from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.reader import CorruptSegmentWarning, read_segments
from charllm_nemo.telemetry.sampler import SAMPLES_SCHEMA
from charllm_nemo.telemetry.schema import INT_NULL
from charllm_nemo.telemetry.store import WINDOWS_SCHEMA
from charllm_nemo.telemetry.timelines import null_broadcast

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

MAX_GAP_S = 0.1
"""Samples further apart than this are not interpolated across: the grid points between are
uncovered, and an aggregate over them is not drawn (NaN), rather than read low."""

MAX_GRID_POINTS = 20_000_000
"""Longest waveform built (55 h at 10 ms; each sum holds 12 bytes a point): a device whose samples
would stretch the job past it (a clock years off, a longer run at this step) is left out, with a
line in ``problems`` (a longer run needs a longer ``--wave-step-ms``)."""


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


WAVE_SAMPLE_COLUMNS: tuple[str, ...] = (
    "t_mono_ns", "t_wall_ns", "device_index", "power_instant_w", "power_module_w",
)  # fmt: skip
"""The sample columns :func:`rank_wave` reads."""


@dataclass
class DeviceWave:
    """One device's power on the absolute grid: ``n`` points from index ``k0`` (wall time
    ``k0 x step``); ``power`` None when ``n`` is over :data:`MAX_GRID_POINTS` (not resampled);
    ``module`` None when the device has fewer than 2 module-power samples."""

    device: int
    k0: int
    n: int
    power: Array | None
    module: Array | None


@dataclass
class RankWave:
    """One rank's part of the job waveform (:func:`rank_wave`): its host, its clock, its devices'
    series and its step windows in wall-clock ns (None: none)."""

    host: str
    clock: RankClock
    devices: list[DeviceWave] = field(default_factory=list)
    steps: tuple[Array, Array] | None = None


def rank_wave(
    manifest: Mapping[str, Any],
    samples: Mapping[str, Array],
    windows: Mapping[str, Array] | None,
    step_s: float,
) -> RankWave | None:
    """One rank's devices on the grid of ``step_s``: ``samples`` holds :data:`WAVE_SAMPLE_COLUMNS`
    as numpy arrays (ints: 0 or INT_NULL for null; floats: NaN), ``windows`` its ``kind``,
    ``t_begin_mono_ns`` and ``t_end_mono_ns`` (None: none read). None when the rank has no clock
    mapping or no instant power (it is then not part of the waveform)."""
    mono = samples["t_mono_ns"]
    if mono.size == 0:
        return None
    clock = rank_clock(manifest, mono, samples["t_wall_ns"])
    power = samples["power_instant_w"]
    if clock is None or not np.isfinite(power).any():
        return None
    wave = RankWave(str(manifest.get("host") or "?"), clock)
    if abs(clock.wall_minus_mono_ns) >= 2**62:
        return wave
    step_ns = max(1, round(step_s * 1e9))
    module = samples["power_module_w"]
    sane = (mono > 0) & (mono < 2**62)  # no int64 overflow below
    wall = np.where(sane, mono, 0) + clock.wall_minus_mono_ns
    devs = samples["device_index"]
    devs = np.where(devs == INT_NULL, 0, devs)  # null (and -1): device 0, as the read with nulls as 0 gives
    ids = distinct(devs)
    for d in ids:
        mine: Any = slice(None) if ids.size == 1 else devs == d  # one device: no copies
        w, p = wall[mine], power[mine]
        ok = np.isfinite(p) & sane[mine] & (w > 0)
        if ok.sum() < 2:
            continue
        everywhere = bool(ok.all())  # the usual device: no copies of its samples
        wk, pk = (w, p) if everywhere else (w[ok], p[ok])
        k0, k1 = -(-int(wk.min()) // step_ns), int(wk.max()) // step_ns  # the absolute grid
        if k1 <= k0:
            continue
        n = k1 - k0 + 1
        if n > MAX_GRID_POINTS:  # left out, with a line, by the builder: not resampled
            wave.devices.append(DeviceWave(int(d), k0, n, None, None))
            continue
        grid = np.arange(n) * (step_ns / 1e9)  # s since grid point k0
        x = gm.resample_linear((wk - k0 * step_ns) / 1e9, pk, grid, MAX_GAP_S)
        m = module[mine]
        xm = None
        if not null_broadcast(m):  # an all-null column as loaded: no pass
            okm = np.isfinite(m) & sane[mine] & (w > 0)
            if okm.sum() >= 2:
                xm = gm.resample_linear((w[okm] - k0 * step_ns) / 1e9, m[okm], grid, MAX_GAP_S)
        wave.devices.append(DeviceWave(int(d), k0, n, x, xm))
    if windows is not None:
        wave.steps = _steps(windows, clock)
    return wave


class WaveBuilder:
    """A run's waveform built from its ranks' :class:`RankWave` (added in rank order), with
    the problems met in ``problems``."""

    def __init__(self, path: Path, options: GridOptions) -> None:
        self.path = path
        self.options = options
        self.problems: list[str] = []
        self.gpu_sums = _Sums(options.groups)
        self.module_sums: _Sums | None = _Sums(options.groups)
        self.without_module: list[str] = []  # "rank r device d" with instant power but no module power
        self.clocks: dict[str, list[RankClock]] = {}
        self.steps: tuple[Array, Array] | None = None

    def add(self, rank: int, wave: RankWave | None) -> None:
        """Add rank ``rank``'s part (None: it has none)."""
        if wave is None:
            return
        self.clocks.setdefault(wave.host, []).append(wave.clock)
        for dev in wave.devices:
            if dev.power is None or self.gpu_sums.job.span_with(dev.k0, dev.n) > MAX_GRID_POINTS:
                self.problems.append(
                    f"{self.path}: rank {rank} device {dev.device}'s samples would stretch the job power "
                    f"waveform past {MAX_GRID_POINTS} points of {self.options.step_s:g} s (a clock far off, "
                    "or a run this long needs a longer --wave-step-ms); left out of it"
                )
                continue
            self.gpu_sums.add(wave.host, dev.k0, dev.power)
            if dev.module is None:
                self.without_module.append(f"rank {rank} device {dev.device}")
                self.module_sums = None  # one device without it: the GPUs' own power is summed
            elif self.module_sums is not None:
                self.module_sums.add(wave.host, dev.k0, dev.module)
        if self.steps is None and abs(wave.clock.wall_minus_mono_ns) < 2**62:
            self.steps = wave.steps

    def finish(self) -> JobWaveform | None:
        """The waveform (None when no rank has instant power, or when the ranks' samples never
        overlap: then with a line in ``problems``)."""
        gpu_sums, without_module = self.gpu_sums, self.without_module
        if gpu_sums.job.members == 0:  # no instant power (a backend without it): no waveform, no row
            return None
        with_module = gpu_sums.job.members - len(without_module)
        if with_module and without_module:
            self.problems.append(
                f"{self.path}: {with_module} GPU(s) report module power (NVML power scope MODULE) but "
                f"{', '.join(without_module[:4])}{' ...' if len(without_module) > 4 else ''} do(es) not: "
                "the job power waveform sums the GPUs' own power (GPU-visible) for all of them"
            )
        sums, scope, column = (
            (self.module_sums, MODULE_POWER_SCOPE, "power_module_w")
            if self.module_sums is not None
            else (gpu_sums, POWER_SCOPE, "power_instant_w")
        )
        job = sums.job
        covered = np.flatnonzero(job.count == job.members)
        if len(covered) < 2:
            self.problems.append(
                f"{self.path}: the ranks' samples never overlap in time; no job power waveform"
            )
            return None
        k0, n = job.k0 + int(covered[0]), int(covered[-1] - covered[0]) + 1
        x = job.series(k0, n)
        t0_ns = k0 * max(1, round(self.options.step_s * 1e9))
        iterations, period = _iterations(x, self.options, self.steps, t0_ns)
        error, base = _alignment(self.clocks)
        return JobWaveform(
            t0_ns, self.options.step_s, x, job.members,
            {h: (s.series(k0, n), s.members) for h, s in sorted(sums.nodes.items())},
            {g: (s.series(k0, n), s.members) for g, s in sorted(sums.groups.items())},
            iterations, period, error, base, scope, column,
        )  # fmt: skip


def job_waveform(run: Run, options: GridOptions, problems: list[str]) -> JobWaveform | None:
    """Read ``run`` one rank at a time and build its waveform (None when no rank has instant
    power; with a line in ``problems`` when the ranks' samples never overlap). A segment that
    cannot be read is skipped here without a line: the analysis's own read of it reports it.

    Where every device with instant power also reports its module's power (``power_module_w``,
    NVML power scope MODULE: a Grace module's GPU + CPU + memory), the module power is summed
    instead and the waveform says so (``power_scope``); where only some do, the GPUs' own power
    is summed, with a line in ``problems``. Both sums are built while the module power lasts."""
    seen: list[str] = []
    builder = WaveBuilder(run.path, options)
    for r in run.ranks:
        files = run.files.ranks[r]
        with warnings.catch_warnings():  # warned of once, by the analysis's own read
            warnings.simplefilter("ignore", CorruptSegmentWarning)
            t = read_segments(files.samples, "samples", SAMPLES_SCHEMA, seen, list(WAVE_SAMPLE_COLUMNS))
        if t is None or t.num_rows == 0:
            continue
        cols = {c: _ints(t, c) for c in ("t_mono_ns", "t_wall_ns", "device_index")}
        for c in ("power_instant_w", "power_module_w"):
            cols[c] = t.column(c).to_numpy(zero_copy_only=False).astype(np.float64)
        wave = rank_wave(run.manifests.get(r, {}), cols, None, options.step_s)
        if wave is not None and builder.steps is None and abs(wave.clock.wall_minus_mono_ns) < 2**62:
            wave.steps = _step_times(files.windows, wave.clock, seen)
        builder.add(r, wave)
    wf = builder.finish()
    problems.extend(builder.problems)
    return wf


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
    return _steps({"kind": kind, **{c: _ints(w, c) for c in cols[1:]}}, clock)


def _steps(w: Mapping[str, Array], clock: RankClock) -> tuple[Array, Array] | None:
    """(begins, ends) of the step windows of ``w`` (``kind``, ``t_begin_mono_ns``,
    ``t_end_mono_ns``; null times 0 or INT_NULL) in wall-clock ns (None: no step windows)."""
    kind, b, e = w["kind"], w["t_begin_mono_ns"], w["t_end_mono_ns"]
    if len(kind) == 0:
        return None
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
