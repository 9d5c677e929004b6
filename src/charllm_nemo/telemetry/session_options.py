"""What a rank's telemetry session is told: who it is (:class:`Placement`) and how to run
(:class:`SessionOptions`, with :class:`StoreOptions` and :class:`ProcessOptions`), all typed,
frozen and checked when made.

:class:`~charllm_nemo.telemetry.session.TelemetrySession` takes them as two objects, not as
their fields one by one::

    options = SessionOptions(backend="synthetic", hz=200, store=StoreOptions(flush_interval_s=0.2))
    TelemetrySession(out_dir, options, placement=Placement(1, 1, 2, 2), handle_signals=False)

Each option's default and check is declared once: the defaults are the constants of the module
that uses them (``DEFAULT_HZ`` in telemetry/sample_loop.py, ``DEFAULT_NICE`` in
telemetry/placement.py, ...), the checks are their ``*_problem`` functions, which the config's
checks (telemetry/config.py ``telemetry_problems``) ask too. A config becomes SessionOptions in
one place: telemetry/config.py ``session_options``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from charllm_nemo.devices.base import Backend
from charllm_nemo.devices.factory import BACKEND_NAMES
from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.placement import (
    DEFAULT_COLLECTOR_SCHED,
    DEFAULT_NICE,
    DEFAULT_SAMPLER,
    collector_sched_problem,
    nice_problem,
    sampler_problem,
)
from charllm_nemo.telemetry.sample_loop import DEFAULT_COUNTER_HZ, DEFAULT_HZ, counter_hz_problem, hz_problem

DEFAULT_OVERWRITE = False
"""``telemetry.overwrite``: a rank folder holding an earlier run is refused, not replaced."""
DEFAULT_DRIVER_BUFFERS = True
"""``telemetry.driver_buffers``: the driver's own sample buffers are stored where a device keeps
them (no cost where none does)."""

MEGATRON_LABELS: tuple[str, ...] = ("pp_stage", "tp_rank", "dp_rank", "ep_rank", "cp_rank")
"""The placement labels :meth:`Placement.from_megatron` fills (window label names,
``charllm_nemo.telemetry.schema.WINDOW_LABELS``)."""


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw.split("(")[0])  # SLURM_NTASKS_PER_NODE may read "8(x4)"
    except ValueError:
        raise ConfigError(
            f"environment variable {name}={raw!r} is not an integer; unset it or fix it"
        ) from None


@dataclass(frozen=True)
class Placement:
    """Where a rank sits: its global ``rank`` of ``world_size``, its ``local_rank`` of
    ``local_world_size`` on its node, and ``labels``: its parallel ranks (``tp_rank``,
    ``pp_stage``, ``dp_rank``, ``ep_rank``, ``cp_rank``), written on every window."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    labels: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("rank", "local_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"placement.{name}={v!r} must be an integer >= 0")
        for name in ("world_size", "local_world_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"placement.{name}={v!r} must be an integer >= 1")
        if self.rank >= self.world_size:
            raise ConfigError(
                f"placement.rank={self.rank} is not below placement.world_size={self.world_size}; "
                "check RANK / WORLD_SIZE"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **labels: int) -> Placement:
        """From the launcher's environment: RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE
        (torchrun), else SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS / SLURM_NTASKS_PER_NODE
        (srun), else a single process."""
        e = os.environ if env is None else env
        if "RANK" in e:
            rank, world = _env_int(e, "RANK", 0), _env_int(e, "WORLD_SIZE", 1)
            local = _env_int(e, "LOCAL_RANK", rank)
        elif "SLURM_PROCID" in e:
            rank, world = _env_int(e, "SLURM_PROCID", 0), _env_int(e, "SLURM_NTASKS", 1)
            local = _env_int(e, "SLURM_LOCALID", 0)
        else:
            rank, world, local = 0, 1, 0
        local_world = _env_int(e, "LOCAL_WORLD_SIZE", _env_int(e, "SLURM_NTASKS_PER_NODE", 0)) or world
        return cls(rank, local, world, local_world, dict(labels))

    @classmethod
    def from_megatron(cls, env: Mapping[str, str] | None = None) -> Placement:
        """:meth:`from_env`, with the parallel ranks from ``megatron.core.parallel_state`` when
        its model-parallel groups are initialised (none otherwise). The global rank and world
        size come from torch.distributed when it is initialised."""
        base = cls.from_env(env)
        labels: dict[str, int] = {}
        rank, world = base.rank, base.world_size
        try:
            import torch.distributed as tdist

            if tdist.is_available() and tdist.is_initialized():
                rank, world = tdist.get_rank(), tdist.get_world_size()
        except ImportError:
            pass
        try:
            from megatron.core import parallel_state as ps
        except ImportError:
            ps = None
        if ps is not None and ps.model_parallel_is_initialized():
            labels = {
                "pp_stage": ps.get_pipeline_model_parallel_rank(),
                "tp_rank": ps.get_tensor_model_parallel_rank(),
                "dp_rank": ps.get_data_parallel_rank(),
                "ep_rank": ps.get_expert_model_parallel_rank(),
                "cp_rank": ps.get_context_parallel_rank(),
            }
        local_world = min(world, base.local_world_size)
        return cls(rank, base.local_rank, world, local_world, labels)


def _raise(problems: list[str | None]) -> None:
    found = [p for p in problems if p is not None]
    if found:
        raise ConfigError("; ".join(found))


def _positive_seconds_problem(name: str, value: object, example: str) -> str | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return None
    return f"{name}={value!r} must be a positive finite number of seconds, e.g. {example}"


def _bool_problem(name: str, value: object) -> str | None:
    return None if isinstance(value, bool) else f"{name}={value!r} must be True or False"


@dataclass(frozen=True)
class StoreOptions:
    """How a session stores what it samples (telemetry/store.py, docs/store.md).

    ``flush_interval_s``: how often segments are written (at least every second is what keeps a
    killed job's data). ``live_window_s``: how many seconds of samples stay in memory for live
    figures (thread mode). ``overwrite``: this rank's folder may hold an earlier run, whose files
    are removed first (default: StoreError, before anything starts). ``driver_buffers``: also
    store the driver's own sample buffers where a device keeps them (NVML: power, SM clock,
    utilization; ``buffered-NNNNNN.parquet``, telemetry/buffered.py); no cost where none does.
    """

    flush_interval_s: float = 0.5
    live_window_s: float = 120.0
    overwrite: bool = DEFAULT_OVERWRITE
    driver_buffers: bool = DEFAULT_DRIVER_BUFFERS

    def __post_init__(self) -> None:
        _raise(
            [
                _positive_seconds_problem("StoreOptions.flush_interval_s", self.flush_interval_s, "0.5"),
                _positive_seconds_problem("StoreOptions.live_window_s", self.live_window_s, "120"),
                _bool_problem("telemetry.overwrite", self.overwrite),
                _bool_problem("telemetry.driver_buffers", self.driver_buffers),
            ]
        )


@dataclass(frozen=True)
class ProcessOptions:
    """The telemetry process's settings (process mode; telemetry/process/, docs/telemetry.md).

    ``nice``: its nice value (0-19; default 0, the rank's own; 19 where a CPU is free for it: it
    then seldom preempts training). ``collector_sched``: its collector thread's policy, ``auto``
    / ``idle`` / ``normal``; for ``auto``, ``rank_threads`` (the CPU threads each rank keeps busy:
    1 on a GPU, its intra-op threads on a CPU) and the node's ranks (the session's placement)
    decide (:func:`~charllm_nemo.telemetry.placement.resolve_collector_sched`). ``export``: the
    live exporter's settings (telemetry/export/; None: off), as telemetry/config.py
    ``export_options`` makes them.
    """

    nice: int = DEFAULT_NICE
    collector_sched: str = DEFAULT_COLLECTOR_SCHED
    rank_threads: int = 1
    export: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.export is not None and not isinstance(self.export, Mapping):
            raise TypeError(
                f"ProcessOptions.export={self.export!r} must be a mapping (telemetry/config.py "
                "export_options makes it) or None"
            )
        t = self.rank_threads
        _raise(
            [
                nice_problem(self.nice),
                collector_sched_problem(self.collector_sched),
                None
                if isinstance(t, int) and not isinstance(t, bool) and t >= 0
                else f"ProcessOptions.rank_threads={t!r} must be an integer >= 0 (1 on a GPU: its training "
                "thread; on a CPU its intra-op threads)",
            ]
        )


@dataclass(frozen=True)
class SessionOptions:
    """How a rank's telemetry session runs (everything but who the rank is: :class:`Placement`).
    Checked when made: a bad value raises :class:`~charllm_nemo.errors.ConfigError` (a
    ValueError) naming the field, its value and a valid one; an object of the wrong kind
    (``backend_options`` not a mapping, ``store`` not a StoreOptions) raises TypeError.

    ``backend``: ``auto`` / ``nvml`` / ``amdsmi`` / ``synthetic``, or a Backend object (which
    samples in a thread: it cannot cross into a telemetry process). ``hz``: the sampling rate
    (:data:`~charllm_nemo.telemetry.sample_loop.DEFAULT_HZ`). ``counter_hz``: how often the
    cumulative counters (energy, violation times, PCIe/NVLink bytes) are read where a backend
    reads them apart (None: derived from the measured cost of a read,
    :data:`~charllm_nemo.telemetry.sample_loop.COUNTER_READ_BUDGET`); the rows between hold null
    for them. ``sampler``: ``auto`` (a telemetry process where one can be had, else a thread),
    ``process`` or ``thread`` (telemetry/session.py's module doc). ``devices``: host device
    indices to sample; None = this rank's own (a real backend) or device 0 (synthetic).
    ``backend_options`` go to the backend (synthetic: ``activity``, ``params``, ``count``).
    ``store``: :class:`StoreOptions`; ``process``: :class:`ProcessOptions`.
    """

    backend: str | Backend = "auto"
    hz: float = DEFAULT_HZ
    counter_hz: float | None = DEFAULT_COUNTER_HZ
    sampler: str = DEFAULT_SAMPLER
    devices: Sequence[int] | None = None
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    store: StoreOptions = field(default_factory=StoreOptions)
    process: ProcessOptions = field(default_factory=ProcessOptions)

    def __post_init__(self) -> None:
        for name, kind in (("store", StoreOptions), ("process", ProcessOptions)):
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise TypeError(
                    f"SessionOptions.{name}={value!r} must be a {kind.__name__}, e.g. "
                    f"SessionOptions({name}={kind.__name__}())"
                )
        if not isinstance(self.backend_options, Mapping):
            raise TypeError(
                f"SessionOptions.backend_options={self.backend_options!r} must be a mapping of the "
                "backend's options, e.g. backend_options={'activity': 'marks'}"
            )
        b, d = self.backend, self.devices
        _raise(
            [
                None
                if isinstance(b, Backend) or b in BACKEND_NAMES
                else f"telemetry.backend={b!r} is not valid; use one of [{', '.join(BACKEND_NAMES)}] or "
                "a Backend object",
                hz_problem(self.hz),
                counter_hz_problem(self.counter_hz),
                sampler_problem(self.sampler),
                None
                if d is None
                or (
                    not isinstance(d, (str, bytes))
                    and isinstance(d, Sequence)
                    and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in d)
                )
                else f"SessionOptions.devices={d!r} must be a list of device indices >= 0, e.g. [0], or "
                "None for the rank's own",
            ]
        )
        object.__setattr__(self, "hz", float(self.hz))
        object.__setattr__(self, "backend_options", dict(self.backend_options))
        if d is not None:
            object.__setattr__(self, "devices", tuple(d))
