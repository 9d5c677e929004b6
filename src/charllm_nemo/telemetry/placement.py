"""Where a rank's telemetry runs: which device it samples and which CPU policy its telemetry
process gets. Pure functions over the environment and the host's devices, called by
:class:`~charllm_nemo.telemetry.session.TelemetrySession` before anything starts (and by the
trainer's config validation, which checks the same settings early).

* **Device**: a rank samples the device it drives: its entry of ``CUDA_VISIBLE_DEVICES`` /
  ``ROCR_VISIBLE_DEVICES`` (an index, or a UUID matched as CUDA matches it), else its local rank,
  modulo the devices it sees when it sees fewer (``srun --gpus-per-task=1``).
* **Sampler mode**: ``auto`` / ``process`` / ``thread`` (:func:`resolve_sampler_mode`).
* **CPU policy** of the telemetry process: its nice value and its collector thread's scheduling
  policy (``auto`` decides from the CPUs this rank may use and the node's ranks).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from charllm_nemo.devices.base import Backend
from charllm_nemo.devices.factory import open_backend
from charllm_nemo.errors import ConfigError

log = logging.getLogger("charllm_nemo.telemetry")


def local_device_ordinal(local_rank: int, visible: int) -> int:
    """The ordinal, among the ``visible`` devices this process sees, of the device a rank
    drives: its local rank, or its local rank modulo ``visible`` when it sees fewer devices than
    that (``srun --gpus-per-task=1``: every task sees one GPU, its own, as device 0)."""
    return local_rank % visible if 0 < visible <= local_rank else local_rank


def visible_device_entry(local_rank: int, env: Mapping[str, str] | None = None) -> str | None:
    """This rank's entry of CUDA_VISIBLE_DEVICES (or ROCR_VISIBLE_DEVICES), the one at
    :func:`local_device_ordinal`: a physical index or a (possibly abbreviated) UUID; None when
    neither is set or it lists nothing."""
    env_map: Mapping[str, str] = os.environ if env is None else env
    visible = env_map.get("CUDA_VISIBLE_DEVICES") or env_map.get("ROCR_VISIBLE_DEVICES") or ""
    items = [v.strip() for v in visible.split(",") if v.strip()]
    return items[local_device_ordinal(local_rank, len(items))] if items else None


def default_device_indices(local_rank: int, env: Mapping[str, str] | None = None) -> list[int]:
    """The device a rank drives, as NVML and AMD SMI number it (physically): its
    :func:`visible_device_entry` when that is an index, else ``local_rank`` (a UUID entry is
    resolved against the devices' UUIDs when the session opens the backend:
    :func:`match_device_uuid`)."""
    entry = visible_device_entry(local_rank, env)
    return [int(entry)] if entry is not None and entry.isdigit() else [local_rank]


def _uuid_key(text: str) -> str:
    """A UUID as CUDA compares it: case and dashes ignored, a ``GPU-`` prefix optional."""
    t = text.strip().lower()
    return (t[4:] if t.startswith("gpu-") else t).replace("-", "")


def match_device_uuid(entry: str, uuids: Sequence[str | None]) -> int | None:
    """The position in ``uuids`` of the one device whose UUID ``entry`` names, as CUDA reads a
    CUDA_VISIBLE_DEVICES entry: the whole UUID or a unique prefix of it, with or without
    ``GPU-``, in any case. None when no device or more than one matches, and for MIG instances
    (``MIG-...``: NVML reports power and energy for the whole GPU, not the instance)."""
    if entry.strip().lower().startswith("mig-"):
        return None
    key = _uuid_key(entry)
    if not key:
        return None
    hits = [i for i, u in enumerate(uuids) if u and _uuid_key(u).startswith(key)]
    return hits[0] if len(hits) == 1 else None


def _only_device(every: Backend, pos: int, name: str, options: dict[str, Any]) -> Backend:
    """``every`` (a backend opened on all devices) narrowed to its device at ``pos``: itself when
    that is its only device, else closed and opened again on that one."""
    if len(every.devices) <= 1:
        return every
    own = every.devices[pos].identity.index
    every.close()
    return open_backend(name, [own], **options)


SAMPLER_MODES: tuple[str, ...] = ("auto", "thread", "process")
DEFAULT_SAMPLER = "auto"
"""``telemetry.sampler``'s default: a telemetry process where one can be had, else a thread."""


DEFAULT_NICE = 0
"""The telemetry process's nice value (``telemetry.nice``): 0, the rank's own priority. At 19 its
threads seldom preempt the training thread when the scheduler wakes them on its core; where a
core is free they run there at once and sample as well as at 0 (tiny_gpt CPU steps here: the
overhead ~0.4 % lower, 1.010 against 1.014 over eleven alternating runs), but with every core busy
they take about a third fewer samples (docs/telemetry.md)."""


def nice_problem(nice: Any) -> str | None:
    """Why ``nice`` is not a nice value (an int in 0..19), naming ``telemetry.nice``; None when it
    is. The one check: the config's checks and :func:`validate_nice` ask it."""
    if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
        return (
            f"telemetry.nice={nice!r}: give the telemetry process's nice value, an integer from 0 "
            f"(the rank's own priority) to 19 (the lowest; default {DEFAULT_NICE})"
        )
    return None


def validate_nice(nice: Any) -> int:
    """``nice`` as an int in 0..19, else a ConfigError naming ``telemetry.nice``."""
    problem = nice_problem(nice)
    if problem is not None:
        raise ConfigError(problem)
    return int(nice)


COLLECTOR_SCHEDS: tuple[str, ...] = ("auto", "idle", "normal")
DEFAULT_COLLECTOR_SCHED = "normal"
"""``telemetry.collector_sched``: the scheduling policy of the telemetry process's collector
thread (Parquet segments, live figures; the sampling thread keeps the rank's policy). ``idle``:
Linux's SCHED_IDLE, so that any other thread that wakes (the training process's own: gloo's or
NCCL's, data loaders) takes its CPU at once and the scheduler places such threads on a CPU that
runs only the collector as on an idle one. ``auto``: idle where the rank seems to have a CPU to
spare (:func:`resolve_collector_sched`), else ``normal``. The default is ``normal``: once every
CPU is busy, a SCHED_IDLE collector preempted while it holds the telemetry process's GIL stalls
the sampling thread too (here: up to 1.4 s without a sample; docs/telemetry.md)."""


def collector_sched_problem(value: Any) -> str | None:
    """Why ``value`` is not one of :data:`COLLECTOR_SCHEDS`, naming the field; None when it is."""
    if value not in COLLECTOR_SCHEDS:
        return (
            f"telemetry.collector_sched={value!r} is not valid; use one of [{', '.join(COLLECTOR_SCHEDS)}] "
            "(auto = idle where the rank has a CPU to spare, normal = the rank's own policy; default "
            f"{DEFAULT_COLLECTOR_SCHED})"
        )
    return None


def validate_collector_sched(value: Any) -> str:
    """``value`` if it is one of :data:`COLLECTOR_SCHEDS`, else a ConfigError naming the field."""
    problem = collector_sched_problem(value)
    if problem is not None:
        raise ConfigError(problem)
    return str(value)


def cpu_budget() -> tuple[int, float | None] | None:
    """(the CPUs in this process's affinity mask, its cgroup's CPU quota in CPUs, None: no limit;
    a container's CPU limit: cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``); None where the
    mask cannot be read."""
    try:
        return len(os.sched_getaffinity(0)), _cgroup_cpu_quota()
    except (AttributeError, OSError):
        return None


def _cgroup_cpu_quota(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of time per period that this process's cgroup may use; None: no limit, or not
    found (only the process's own cgroup is read, not its parents)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _id, controllers, path = line.split(":", 2)
        try:
            if not controllers:  # v2
                with open(f"{root}{path}/cpu.max") as f:
                    quota, period = f.read().split()[:2]
                return None if quota == "max" else int(quota) / int(period)
            if "cpu" in controllers.split(","):  # v1
                for d in (f"{root}/{controllers}{path}", f"{root}/cpu{path}"):
                    with contextlib.suppress(OSError):
                        with open(f"{d}/cpu.cfs_quota_us") as f, open(f"{d}/cpu.cfs_period_us") as g:
                            v1_quota, v1_period = int(f.read()), int(g.read())
                        return None if v1_quota < 0 else v1_quota / v1_period
        except (OSError, ValueError):
            continue
    return None


def local_ranks_from_env(env: Mapping[str, str], world_size: int = 1) -> int:
    """This node's ranks: ``LOCAL_WORLD_SIZE`` (torchrun), else ``SLURM_NTASKS_PER_NODE`` (srun;
    ``8(x4)`` reads 8), else ``world_size``."""
    value = env.get("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", "0")).split("(")[0]
    return int(value or 0) or world_size


def resolve_collector_sched(
    value: str, local_ranks: int, rank_threads: int = 1, cpus: tuple[int, float | None] | None = None
) -> tuple[str, str]:
    """``(idle | normal, why)`` for ``telemetry.collector_sched`` = ``value``. ``auto`` is idle
    where this rank has a CPU to spare: the CPUs it can use (``cpus``: its mask and cgroup quota,
    default :func:`cpu_budget`; the mask capped by the quota) outnumber those kept busy in its
    mask: ``rank_threads`` (the CPU threads a rank keeps busy: 1 on a GPU, its intra-op threads on
    a CPU) where the mask is smaller than ``local_ranks`` (the node's ranks cannot all share it: it
    is this rank's own, e.g. ``srun --cpu-bind``), else ``local_ranks x rank_threads``. Otherwise
    normal, since a SCHED_IDLE thread beside a busy one gets ~0.3 % of its CPU and would fall
    behind; and normal where Linux's SCHED_IDLE is missing."""
    value = validate_collector_sched(value)
    if value != "auto":
        return value, f"telemetry.collector_sched={value}"
    if not hasattr(os, "SCHED_IDLE"):
        return "normal", "auto: this platform has no SCHED_IDLE"
    budget = cpu_budget() if cpus is None else cpus
    if budget is None:
        return "normal", "auto: the CPUs this rank may use are unknown"
    mask, quota = budget
    usable = mask if quota is None else min(mask, max(1, math.floor(quota)))
    if mask < local_ranks:
        busy, whose = rank_threads, f"this rank, bound to its own {mask} CPU(s)"
    else:
        busy, whose = local_ranks * rank_threads, f"{local_ranks} local rank(s) sharing them"
    why = f"auto: {usable} usable CPU(s), {busy} kept busy by {whose}"
    return ("idle", why) if usable > busy else ("normal", why + ": none to spare")


def sampler_problem(mode: Any) -> str | None:
    """Why ``mode`` is not one of :data:`SAMPLER_MODES`, naming ``telemetry.sampler``; None when
    it is."""
    if mode not in SAMPLER_MODES:
        return (
            f"telemetry.sampler={mode!r} is not valid; use one of [{', '.join(SAMPLER_MODES)}] "
            f"(auto = a separate telemetry process, falling back to a thread where one cannot start; "
            f"default {DEFAULT_SAMPLER})"
        )
    return None


def resolve_sampler_mode(mode: str, hz: float) -> str:
    """``thread`` or ``process`` for ``telemetry.sampler`` = ``mode``; ConfigError if unknown.
    ``auto`` is a process at every rate (a session falls back to a thread where a process cannot
    be had: a Backend object, options that cannot cross, a process that does not start)."""
    problem = sampler_problem(mode)
    if problem is not None:
        raise ConfigError(problem)
    return "process" if mode == "auto" else mode


def open_rank_backend(
    name: str,
    devices: Sequence[int] | None,
    *,
    rank: int,
    local_rank: int,
    options: dict[str, Any],
) -> Backend:
    """Open backend ``name`` on the devices a rank samples: ``devices`` (host indices) when given
    or for the synthetic backend; else the rank's own (:func:`visible_device_entry`: a UUID is
    matched against the devices' UUIDs; an index is used as is; else the local rank)."""
    if devices is not None or name == "synthetic":
        return _open_indices(name, devices, rank, local_rank, options)
    entry = visible_device_entry(local_rank)
    if entry is not None and not entry.isdigit():  # a UUID
        return _open_by_uuid(name, entry, [local_rank], rank, local_rank, options)
    return _open_indices(name, default_device_indices(local_rank), rank, local_rank, options)


def _open_indices(
    name: str, indices: Sequence[int] | None, rank: int, local_rank: int, options: dict[str, Any]
) -> Backend:
    """Open ``name`` on ``indices``; for ``auto``, a rank whose index is not a device here gets
    the one its local rank maps to."""
    try:
        return open_backend(name, indices, **options)
    except Exception:
        if name != "auto" or indices is None:
            raise
    # auto, and this rank's index is not a device here (more ranks than GPUs visible): the
    # device torch drives then, local_rank modulo the count (train/dist.py), never all of
    # them (each rank would count every GPU's energy as its own).
    every = open_backend(name, None, **options)
    if len(every.devices) <= 1:
        return every
    pos = local_device_ordinal(local_rank, len(every.devices))
    log.warning(
        "telemetry: rank %d's device %s is not on this host; sampling device %d, the one its "
        "local rank maps to (local_rank %% %d)",
        rank,
        list(indices),
        every.devices[pos].identity.index,
        len(every.devices),
    )
    return _only_device(every, pos, name, options)


def _open_by_uuid(
    name: str, entry: str, indices: Sequence[int], rank: int, local_rank: int, options: dict[str, Any]
) -> Backend:
    """The backend on the device whose UUID this rank's CUDA_VISIBLE_DEVICES entry names
    (``entry``); where none matches (a MIG instance, a UUID from another host, several
    devices sharing the prefix), ``indices`` (its local rank) as before, with a warning."""
    try:
        every = open_backend(name, None, **options)
    except Exception:  # the open below, by local rank, raises (or falls back) as it always has
        every = None
    if every is not None:
        pos = match_device_uuid(entry, [d.identity.uuid for d in every.devices])
        if pos is not None:
            return _only_device(every, pos, name, options)
        every.close()
    log.warning(
        "telemetry: rank %d's visible device %r matches no single device UUID on this host "
        "(MIG instances are not mapped to their GPU); sampling device %s by local rank. Set "
        "CUDA_VISIBLE_DEVICES to indices, or a full GPU UUID, to choose it",
        rank,
        entry,
        list(indices),
    )
    return _open_indices(name, indices, rank, local_rank, options)
