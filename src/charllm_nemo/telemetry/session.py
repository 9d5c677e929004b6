"""One rank's telemetry session: backend + sampler + window marks + store, started and
stopped together. This is what training integrations (the Megatron-Core loop, later the NeMo
callback) hold.

    with TelemetrySession(out_dir, backend="auto", hz=100, rank=r, world_size=w) as tel:
        wid = tel.windows.begin("step", step=0)
        ...
        tel.windows.end(wid)
        figures = tel.step_figures(wid)   # None until the sampler has passed the step's end

Where the work happens (``sampler``):

* ``process`` (what ``auto`` gives for a backend named by a string): a **telemetry process**
  beside this one samples the device, writes the Parquet segments and computes live figures
  (telemetry/telemetry_process.py). This process only writes finished windows into shared
  memory (~3 µs a window, begin to end) and reads figures back: no thread here, no GIL shared with training.
* ``thread`` (a Backend object, synthetic options that cannot cross into another process, or a
  telemetry process that would not start): a sampler thread and a flusher thread in this
  process, and live figures computed on the caller's thread.

Safe against a killed job: segments are flushed every ``flush_interval_s`` (at least every
second); SIGTERM (what SLURM sends before SIGKILL) and normal exit (atexit) flush everything and
mark the manifest complete / terminated. In process mode a training process killed outright
(SIGKILL, a segfault) loses nothing it had marked: its telemetry process flushes and marks the
manifest ``killed``.
"""

from __future__ import annotations

import atexit
import bisect
import itertools
import logging
import os
import platform
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pyarrow as pa

import charllm_nemo
from charllm_nemo.devices.base import Backend
from charllm_nemo.devices.factory import open_backend
from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.collector import decode_figures
from charllm_nemo.telemetry.sample_loop import (
    DEFAULT_COUNTER_HZ,
    counter_every,
    effective_counter_every,
    figures_period_ns,
)
from charllm_nemo.telemetry.sampler import Row, Sampler, rows_to_arrays, rows_to_table, validate_hz
from charllm_nemo.telemetry.sampler_process import (
    DEFAULT_COLLECTOR_SCHED,
    DEFAULT_NICE,
    FIGURE_SLOTS,
    ProcessSampler,
    local_ranks_from_env,
    resolve_collector_sched,
    resolve_sampler_mode,
    validate_collector_sched,
    validate_nice,
)
from charllm_nemo.telemetry.shm import figure_columns, figure_mask
from charllm_nemo.telemetry.store import (
    DISK_FULL,
    Flusher,
    RankStore,
    SegmentWriter,
    clear_rank_folder,
    rank_dir,
    records_to_table,
    warm_up_parquet_writer,
)
from charllm_nemo.telemetry.windows import WindowRecorder

log = logging.getLogger("charllm_nemo.telemetry")

LIVENESS_CHECK_NS = 1_000_000_000
"""How often (in the windows' time) :meth:`TelemetrySession.request_figures` checks that the
telemetry process is alive: a ``waitpid`` and a read of the shared block, ~2 µs."""

_ENV_KEYS = (
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_JOB_NODELIST",
    "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
)


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


def package_versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {
        "python": platform.python_version(),
        "charllm-nemo": charllm_nemo.__version__,
    }
    for dist in (
        "numpy",
        "pyarrow",
        "nvidia-ml-py",
        "amdsmi",
        "torch",
        "megatron-core",
        "nemo-toolkit",
        "wandb",
    ):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _covers(asked: tuple[int, frozenset[str] | None], wanted: frozenset[str] | None) -> bool:
    """Whether a request made (its slot, the figures it asked for; None = all) holds ``wanted``."""
    return asked[1] is None or (wanted is not None and wanted <= asked[1])


class TelemetrySession:
    """Telemetry for one rank. Construct, then :meth:`start` (or use as a context manager).

    ``devices``: host device indices to sample; None = this rank's own device
    (see :func:`default_device_indices`) for a real backend, device 0 for synthetic.
    ``backend_options`` go to the backend (synthetic: ``activity``, ``params``, ``count``).
    ``live_window_s``: how many seconds of samples stay in memory for :meth:`step_figures`.
    ``sampler``: ``auto`` (a telemetry process where one can be had, else a thread), ``process``
    or ``thread`` (see the module doc). In process mode the telemetry process opens the backend
    again by name; this process keeps its own handle for the device identities. ``nice``: the
    telemetry process's nice value (0-19; default 0, the rank's own; 19 where a CPU is free for
    it: it then seldom preempts training; threads in the training process keep its priority).
    ``collector_sched``: the telemetry process's collector thread's policy, ``auto`` / ``idle`` /
    ``normal`` (:data:`~charllm_nemo.telemetry.sampler_process.DEFAULT_COLLECTOR_SCHED`); for
    ``auto``, ``local_ranks`` (this node's ranks; None:
    :func:`~charllm_nemo.telemetry.sampler_process.local_ranks_from_env`) and
    ``rank_threads`` (the CPU threads each keeps busy: 1 on a GPU, its intra-op threads on a CPU)
    (:func:`~charllm_nemo.telemetry.sampler_process.resolve_collector_sched`).
    ``overwrite``: this rank's folder may hold an earlier run, whose files are removed first
    (default: StoreError, before anything starts). ``counter_hz``: how often the cumulative
    counters (energy, violation times, PCIe/NVLink bytes) are read where a backend reads them
    apart (NVML: :data:`~charllm_nemo.telemetry.sample_loop.DEFAULT_COUNTER_HZ`; None = with
    every sample); the rows between hold null for them, and live figures wait for the next
    counter read past a window's end.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        backend: str | Backend = "auto",
        hz: float = 100.0,
        rank: int = 0,
        local_rank: int = 0,
        world_size: int = 1,
        config: dict[str, Any] | None = None,
        devices: Sequence[int] | None = None,
        flush_interval_s: float = 0.5,
        live_window_s: float = 120.0,
        backend_options: dict[str, Any] | None = None,
        handle_signals: bool = True,
        sampler: str = "auto",
        nice: int = DEFAULT_NICE,
        collector_sched: str = DEFAULT_COLLECTOR_SCHED,
        local_ranks: int | None = None,
        rank_threads: int = 1,
        overwrite: bool = False,
        counter_hz: float | None = DEFAULT_COUNTER_HZ,
    ) -> None:
        self.hz = validate_hz(hz)
        every = counter_every(self.hz, counter_hz)  # a bad rate fails here, before anything opens
        nice = validate_nice(nice)
        validate_collector_sched(collector_sched)
        mode = resolve_sampler_mode(sampler, self.hz)
        self.rank, self.local_rank, self.world_size = rank, local_rank, world_size
        self.out_dir = Path(out_dir)
        # Before anything starts: an earlier run's files in this rank's folder (StoreError, or
        # removed with overwrite), so that its segments are never read as this run's.
        clear_rank_folder(rank_dir(self.out_dir, rank), overwrite=overwrite)
        self.windows = WindowRecorder()
        self._handle_signals = handle_signals
        self._flush_interval_s = flush_interval_s
        self._live_window_s = live_window_s
        options = dict(backend_options or {})
        if mode == "process" and not isinstance(backend, str):
            if sampler == "process":
                raise ConfigError(
                    "telemetry.sampler='process' needs a backend name (the telemetry process opens it "
                    "itself), not a Backend object; pass backend='nvml' / 'amdsmi' / 'synthetic' or "
                    "use sampler='thread'"
                )
            mode = "thread"
        if isinstance(backend, str):
            if devices is not None or backend == "synthetic":
                self.backend = self._open_backend(backend, devices, options)
            else:
                entry = visible_device_entry(local_rank)
                if entry is not None and not entry.isdigit():  # a UUID
                    self.backend = self._open_by_uuid(backend, entry, [local_rank], options)
                else:
                    self.backend = self._open_backend(backend, default_device_indices(local_rank), options)
        else:
            self.backend = backend
        self.source = self.backend.name
        # Live figures wait for a slot whose counters were read (telemetry.sample_loop): every
        # n-th where a device reads them apart (NVML), every slot elsewhere.
        self.counter_every = effective_counter_every(self.backend.devices, every)
        """Sampling slots per counter read (1: the counters come with every sample)."""
        self.figures_period_ns = figures_period_ns(self.hz, self.counter_every)
        """How often samples that can answer a live figure arrive (ns): a figure of a window is
        ready about this long after the window's end, at the latest."""
        self.sampler: Sampler | ProcessSampler
        self.collector_sched: dict[str, str] | None = None  # process mode: what applies, and why
        if mode == "process":
            ranks = local_ranks_from_env(os.environ, world_size) if local_ranks is None else local_ranks
            policy, why = resolve_collector_sched(collector_sched, ranks, rank_threads)
            self.collector_sched = {"setting": collector_sched, "policy": policy, "why": why}
            # The backend the parent ended up with (auto resolved, index fallback applied); the
            # options went to it only if it was named or is synthetic (auto gives nvml / amdsmi none).
            named = backend == self.source or self.source == "synthetic"
            try:
                self.sampler = ProcessSampler(
                    self.source,
                    [d.identity.index for d in self.backend.devices],
                    options if named else {},
                    self.hz,
                    source=self.source,
                    store={
                        "rank_dir": rank_dir(self.out_dir, rank),
                        "flush_interval_s": flush_interval_s,
                        "live_window_s": live_window_s,
                    },
                    nice=nice,
                    collector_sched=policy,
                    counter_hz=counter_hz,
                )
            except ConfigError as exc:
                if sampler == "process":
                    self.backend.close()
                    raise
                log.info("telemetry: sampling in a thread: %s", exc)
                mode = "thread"
        if mode == "thread":
            self.sampler = Sampler(self.backend.devices, self.hz, source=self.source, counter_hz=counter_hz)
            self.collector_sched = None  # no telemetry process, no collector thread
        self.sampler_mode = mode
        marks = getattr(self.backend, "mark_activity", None)
        if marks is not None:  # in process mode it publishes to the telemetry process from start()
            self.windows.add_listener(marks)
        self.store = RankStore(self.out_dir, rank, self._manifest(config), writes_segments=mode == "thread")
        self._flusher = Flusher(self.flush, flush_interval_s)
        # Thread mode: raw rows of the last live_window_s seconds, for step_figures, kept as the
        # sampler's tuples, so a live figure costs no Arrow round trip.
        n_dev = max(1, len(self.backend.devices))
        self._recent: deque[Row] = deque(maxlen=max(1024, int(live_window_s * self.hz * n_dev)))
        self._recent_lock = threading.Lock()
        self._pending: list[tuple[str, pa.Table]] = []
        # Process mode: figure requests sent, (t_begin, t_end) -> request number.
        self._request_seq = itertools.count()
        # (t_begin, t_end) -> (slot seq, the figures asked for; None = all)
        self._requests: dict[tuple[int, int], tuple[int, frozenset[str] | None]] = {}
        self._masks: dict[tuple[str, ...] | None, tuple[int, frozenset[str] | None]] = {}
        self._figure_columns: tuple[str, ...] = ()
        self._closed = False
        self._started = False
        self._prev_sigterm: Any = None
        self._sigterm = False  # a SIGTERM arrived: whenever the session closes, it was terminated
        self._redeliver_sigterm = False  # a SIGTERM held back until the close is done
        self._closed_fully = False
        self._final_status = "running"  # close() sets it: what the manifest says at the end
        self._liveness_due = 0  # process mode: when request_figures next checks the telemetry process

    def _open_backend(self, name: str, indices: Sequence[int] | None, options: dict[str, Any]) -> Backend:
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
        pos = local_device_ordinal(self.local_rank, len(every.devices))
        log.warning(
            "telemetry: rank %d's device %s is not on this host; sampling device %d, the one its "
            "local rank maps to (local_rank %% %d)",
            self.rank,
            list(indices),
            every.devices[pos].identity.index,
            len(every.devices),
        )
        return _only_device(every, pos, name, options)

    def _open_by_uuid(
        self, name: str, entry: str, indices: Sequence[int], options: dict[str, Any]
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
            self.rank,
            entry,
            list(indices),
        )
        return self._open_backend(name, indices, options)

    def _manifest(self, config: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "kind": "charllm-nemo telemetry",
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "argv": list(sys.argv),
            "backend": self.source,
            "synthetic": self.source == "synthetic",
            "sampling_hz": self.hz,
            "sampler_mode": self.sampler_mode,
            "collector_sched": self.collector_sched,
            "devices": [d.identity.to_dict() for d in self.backend.devices],
            "supported_metrics": {str(d.identity.index): d.supported_metrics() for d in self.backend.devices},
            "started_wall_ns": time.time_ns(),
            "started_mono_ns": time.monotonic_ns(),
            "versions": package_versions(),
            "env": {k: os.environ[k] for k in _ENV_KEYS if k in os.environ},
            "config": config or {},
        }

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> TelemetrySession:
        if self._started:
            return self
        self._started = True
        self._check_cpus()
        self.sampler.start()
        if isinstance(self.sampler, ProcessSampler):
            if self.sampler.running and self.sampler.marks is not None:
                marks = self.sampler.marks
                self.sampler.names = self.windows.names.names
                self.windows.names.set_on_new(marks.publish_name)
                self.windows.set_sink(marks.emit_many)
                self.windows.log_sink = marks.emit_step_log  # steps' windows are made there
                activity = getattr(self.backend, "mark_activity", None)
                if activity is not None:  # the synthetic device there follows the marks made here
                    activity.on_change = self.sampler.activity_publisher()
                self.store.manifest["sampler_process_pid"] = self.sampler.pid
                self.store.write_manifest()
                self._figure_columns = figure_columns()
            else:
                self._fall_back_to_thread()
        if self.sampler_mode == "thread":
            self._flusher.start()
        atexit.register(self._atexit)
        if self._handle_signals and threading.current_thread() is threading.main_thread():
            self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def _check_cpus(self) -> None:
        """Record the CPUs this rank may run on (manifest ``cpu_affinity``) and warn when it is
        one: the telemetry process (which inherits the mask) then takes its time from training."""
        if not hasattr(os, "sched_getaffinity"):
            return
        cpus = sorted(os.sched_getaffinity(0))
        self.store.manifest["cpu_affinity"] = cpus
        if len(cpus) == 1:
            log.warning(
                "rank %d may run on CPU %d only: telemetry's sampling and storing share that CPU with "
                "training (on a tiny CPU model here, steps ~12-14%% slower than with a CPU left free, "
                "~2%%); give each rank at least 2 CPUs (e.g. srun --cpus-per-task=2, or a wider "
                "taskset / numactl mask)",
                self.rank,
                cpus[0],
            )

    def __enter__(self) -> TelemetrySession:
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close("complete" if exc_type is None else "failed")

    @property
    def disk_full(self) -> bool:
        """Whether telemetry hit a full disk (ENOSPC / EDQUOT) and stopped writing: its segments
        (here or in the telemetry process) or its manifest. Cheap (a read of the shared block in
        process mode): a trainer may ask every step. The close then says status ``disk_full``."""
        if self.store.disk_full:
            return True
        return isinstance(self.sampler, ProcessSampler) and self.sampler.disk_full

    def close(self, status: str = "complete") -> str:
        """Stop sampling, flush everything (open windows too, with a null end) and finalize
        the manifest. Returns the status the manifest got: ``status``, or ``terminated`` after a
        SIGTERM, or ``disk_full`` when telemetry hit a full disk (:attr:`disk_full`; a SIGTERM's
        ``terminated`` still wins: it says how the run ended). Idempotent: a second call returns
        the first one's status."""
        if self._closed:
            return self._final_status
        self._closed = True
        if self._sigterm:
            status = "terminated"
        self._final_status = status
        try:  # a step in progress (SIGTERM, an exception): its marks so far, before the open windows
            self.windows.flush_pending()
        except Exception:
            log.exception("could not record the marks of the step in progress")
        open_records = self.windows.open_records()
        if isinstance(self.sampler, ProcessSampler):
            marks = self.sampler.marks
            if marks is not None and open_records:
                marks.emit_many(open_records)
            # Marks after close are kept in the recorder, not sent to a block that is gone.
            self.windows.reset_sink()
            self.windows.log_sink = None
            self.sampler.stop()
            counts = self.sampler.store_counts()
            extra = {
                "flusher": {
                    "flushes": counts.get("flushes", 0),
                    "errors": counts.get("flush_errors", 0),
                    "flush_ms_max": counts.get("flush_ms_max", 0.0),
                    "interval_s": self._flush_interval_s,
                    "where": "telemetry process",
                },
                "store_process": {
                    k: counts.get(k)
                    for k in ("done", "salvaged", "figures_served", "rows_lost", "marks_dropped")
                    if k in counts
                },
            }
            store_counts: dict[str, Any] | None = {
                k: counts[k]
                for k in ("segments", "rows", "bytes_written", "rows_unwritten", "disk_full")
                if k in counts
            }
            # Steps' windows are made in the telemetry process: count what it stored.
            stored = counts.get("rows", {}).get("windows")
            recorded = self.windows.total_recorded if stored is None else stored - len(open_records)
        else:
            self.sampler.stop()
            self._flusher.stop()
            self._flusher.flush_once()
            if open_records:
                try:  # a full disk: the manifest below must still be written, the backend closed
                    self.store.write_segment(
                        "windows", records_to_table(open_records, self.windows.names.names)
                    )
                except Exception:
                    self._flusher.errors += 1
                    log.exception("could not store the %d window(s) open at close", len(open_records))
            extra = {
                "flusher": {
                    "flushes": self._flusher.flushes,
                    "errors": self._flusher.errors,
                    "flush_ms_max": self._flusher.flush_ns_max / 1e6,
                    "interval_s": self._flusher.interval_s,
                    "where": "training process",
                },
            }
            store_counts = None
            # Windows the telemetry process had stored, if it was lost mid-run, and those since.
            lost = self.store.manifest.get("telemetry_process_lost", {})
            recorded = self.windows.total_recorded + lost.get("store", {}).get("rows", {}).get("windows", 0)
        if self.disk_full and status != "terminated":
            status = self._final_status = DISK_FULL
        self.store.close(
            status,
            {
                "sampler": self.sampler.health.to_dict(),
                "sampler_mode": self.sampler_mode,
                **extra,
                "windows_recorded": recorded,
                "windows_open_at_close": len(open_records),
            },
            counts=store_counts or None,
        )
        try:
            self.backend.close()
        except Exception:
            log.exception("backend close failed")
        if self._prev_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._prev_sigterm)
            self._prev_sigterm = None
        atexit.unregister(self._atexit)
        self._closed_fully = True
        if self._redeliver_sigterm:
            # Closed: now the SIGTERM held back, to the handler before us (restored above; or,
            # where it could not be, through ours, which hands it on now that we are closed).
            os.kill(os.getpid(), signal.SIGTERM)
        return self._final_status

    def _fall_back_to_thread(self) -> None:
        """The telemetry process did not start: sample, store and compute figures here."""
        failed = self.sampler
        reason = failed.health.stop_reason
        failed.stop()
        log.warning(
            "telemetry: the telemetry process did not start (%s); sampling in a thread instead", reason
        )
        self.collector_sched = self.store.manifest["collector_sched"] = None
        self.store.manifest["sampler_process_error"] = reason
        self._sample_here()

    def _sample_here(self) -> None:
        """From now on, a sampling thread in this process (thread mode); the manifest says so."""
        self.sampler = Sampler(self.backend.devices, self.hz, source=self.source)
        self.sampler_mode = self.store.manifest["sampler_mode"] = "thread"
        self.store.write_manifest()
        warm_up_parquet_writer()
        self.sampler.start()

    def _take_over(self) -> None:
        """The telemetry process stopped mid-run (killed, crashed): store what its rings still
        hold (the salvage at its stop), then sample, store and compute figures in this process,
        as thread mode does, so that the rest of the run is recorded too. On the training
        thread, between two steps (from :meth:`request_figures`): no mark is under way."""
        failed = self.sampler
        assert isinstance(failed, ProcessSampler)
        pid = failed.pid
        self.windows.reset_sink()  # marks from here on: kept in this process
        self.windows.log_sink = None
        activity = getattr(self.backend, "mark_activity", None)
        if activity is not None:  # the synthetic device here follows the marks again
            activity.on_change = None
        failed.stop(1.0)
        counts = failed.store_counts()
        reason = failed.health.stop_reason or "it exited"
        self.store.segments = SegmentWriter.continuing(self.store.dir, counts)
        self.store.manifest["telemetry_process_lost"] = {
            "pid": pid,
            "reason": reason,
            "at_mono_ns": time.monotonic_ns(),
            "store": {k: counts[k] for k in ("segments", "rows", "salvaged", "marks_dropped") if k in counts},
        }
        self._requests.clear()
        log.error(
            "telemetry: the telemetry process (pid %s) stopped mid-run (%s); stored what it left "
            "and sampling in a thread from now on (telemetry_process_lost in the manifest)",
            pid,
            reason,
        )
        self._sample_here()
        self._flusher.start()

    def _atexit(self) -> None:
        self.close("complete")

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM (SLURM's before SIGKILL). Closing here could deadlock: the handler runs on the
        main thread between two of its bytecodes, maybe inside a mark holding a lock that
        ``close`` takes. So the session only notes it (its close, whenever, says ``terminated``)
        and leaves the decision to what was there before: an earlier handler is called (it may
        set a flag and let training finish a checkpoint with telemetry still on, or unwind);
        SIG_IGN is honoured; the default action becomes ``SystemExit`` in the main thread,
        which releases every lock on its way out, and the close that follows (a ``with`` block,
        a ``finally``, or at exit) ends by re-raising SIGTERM, so the process still dies by the
        signal. A SIGTERM during a close is held back until the close is done (unwinding out of
        it would leave the manifest unfinished), then re-raised to the handler before us."""
        prev = self._prev_sigterm
        self._sigterm = True
        if self._closed and not self._closed_fully:
            self._redeliver_sigterm = True
        elif callable(prev):
            try:
                prev(signum, frame)
            finally:
                self._keep_sigterm_handler()
        elif prev != signal.SIG_IGN:
            if self._closed_fully:  # closed on another thread, this handler left behind
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            self._redeliver_sigterm = True
            raise SystemExit(128 + signum)

    def _keep_sigterm_handler(self) -> None:
        """Put this session's SIGTERM handler back if the handler it called replaced it (one that
        sets SIG_DFL so that "a second SIGTERM kills at once"): a second SIGTERM during the close
        must still be held back until the close is done, then go to that replacement."""
        if self._closed_fully or threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGTERM)
        if current != self._on_sigterm:
            self._prev_sigterm = current
            signal.signal(signal.SIGTERM, self._on_sigterm)

    # -- flushing (thread mode) ------------------------------------------------------------
    def flush(self) -> None:
        """Write what was sampled and marked since the last flush (the flusher calls this; in
        process mode the telemetry process flushes and this does nothing)."""
        if isinstance(self.sampler, ProcessSampler):
            return
        # Taken and remembered under one lock: live_rows() never sees a row in neither place.
        with self._recent_lock:
            rows = self.sampler.take_rows()
            self._recent.extend(rows)
        if rows:
            self._pending.append(("samples", rows_to_table(rows, self.source)))
        done = self.windows.drain_records()
        if done:
            self._pending.append(("windows", records_to_table(done, self.windows.names.names)))
        while self._pending:
            kind, table = self._pending[0]
            # An error (not a full disk: the writer drops from then on) keeps it for the next try.
            self.store.write_segment(kind, table)
            self._pending.pop(0)

    # -- live figures ----------------------------------------------------------------------
    def live_rows(self, since_mono_ns: int = 0, before: int = 0) -> list[Row]:
        """Sampler rows still in memory from ``since_mono_ns``, and the ``before`` rows before
        those (thread mode: the last ``live_window_s``; process mode: what the shared ring still
        holds, up to 16 s)."""
        with self._recent_lock:
            rows = list(self._recent) + self.sampler.peek_rows()
        first = bisect.bisect_left(rows, since_mono_ns, key=lambda r: r[0])
        return rows[max(0, first - before) :]

    def request_figures(
        self,
        t_begin_mono_ns: int,
        t_end_mono_ns: int,
        figures: Collection[str] | None = None,
        batch: int = 1,
    ) -> None:
        """Ask for a window's figures ahead of :meth:`step_figures` (call it when the window
        ends, with the ``figures`` that step_figures will want; None = all). In process mode the
        telemetry process computes them as soon as it has a sample past the end, so the later
        :meth:`step_figures` only reads them (~10 µs); in thread mode this does nothing.
        ``batch`` > 1: the caller reads them only after the next ``batch - 1`` windows have ended
        too, so the telemetry process may wait for those and compute all in one go (cheaper by
        about that factor); it answers alone after ``batch + 1`` window lengths (at most
        0.25 s) at the latest.
        Cheap, never blocks; asking again for a window already asked for, with no figure beyond
        those asked for then, does nothing."""
        if not isinstance(self.sampler, ProcessSampler):
            return
        if t_end_mono_ns >= self._liveness_due:  # once a second: is the telemetry process alive?
            self._liveness_due = t_end_mono_ns + LIVENESS_CHECK_NS
            if not self.sampler.running:
                self._take_over()
                return
        if self.sampler.marks is None:
            return
        mask, wanted = self._mask_of(figures)
        key = (t_begin_mono_ns, t_end_mono_ns)
        asked = self._requests.get(key)
        if asked is not None:
            if _covers(asked, wanted):
                return
            # More figures than asked for (so asked[1] is a set): ask again for the union (a new slot).
            union = None if wanted is None else wanted | (asked[1] or frozenset())
            mask, wanted = self._mask_of(None if union is None else tuple(sorted(union)))
        seq = next(self._request_seq)
        self._requests[key] = (seq, wanted)
        if len(self._requests) > 2 * FIGURE_SLOTS:  # answers that old are overwritten anyway
            del self._requests[next(iter(self._requests))]
        self.sampler.marks.request_figures(seq, t_begin_mono_ns, t_end_mono_ns, mask, batch)

    def _mask_of(self, figures: Collection[str] | None) -> tuple[int, frozenset[str] | None]:
        """A request's mask and figure set (``duration_s`` always included), cached per set."""
        key = None if figures is None else tuple(figures)
        hit = self._masks.get(key)
        if hit is None:
            wanted = None if figures is None else frozenset({"duration_s", *figures})
            hit = self._masks[key] = (figure_mask(wanted), wanted)
        return hit

    def step_figures(
        self,
        t_begin_mono_ns: int,
        t_end_mono_ns: int,
        wait_s: float = 0.0,
        figures: Collection[str] | None = None,
    ) -> list[dict[str, Any]] | None:
        """Attribution of one window for each device on this rank, or None while the sampler has
        not yet taken a sample at or after ``t_end_mono_ns`` (ask again next step, or pass
        ``wait_s`` to wait up to that long). Never blocks when ``wait_s`` is 0. ``figures``: the
        attribution columns wanted (None = all). In process mode the telemetry process computes
        every figure (:meth:`request_figures`); in thread mode only those wanted are computed,
        on this thread."""
        if isinstance(self.sampler, ProcessSampler):
            return self._process_figures(t_begin_mono_ns, t_end_mono_ns, wait_s, figures)
        from charllm_nemo.telemetry.attribution import attribute_windows

        deadline = time.monotonic() + wait_s
        while self.sampler.last_t_mono_ns < t_end_mono_ns:
            if not self.sampler.running or time.monotonic() >= deadline:
                if self.sampler.running:
                    return None
                break
            time.sleep(min(0.002, 1.0 / self.hz))
        # Two periods of whole samples (counters read) before the window, and one slot (a row per
        # device) more: every sample inside has its predecessor in the slice, so counter ticks
        # inside are found as in the stored run (the first sample of a slice is never a tick), a
        # window that begins after a sampling stall is still bracketed, and live figures equal
        # those computed later.
        since = t_begin_mono_ns - 2 * self.figures_period_ns
        arrays = rows_to_arrays(self.live_rows(since, before=len(self.backend.devices)))
        out = []
        win = {
            "t_begin_mono_ns": np.array([t_begin_mono_ns], np.int64),
            "t_end_mono_ns": np.array([t_end_mono_ns], np.int64),
        }
        for dev in self.backend.devices:
            idx = dev.identity.index
            mask = arrays["device_index"] == idx
            per_dev = {k: v[mask] for k, v in arrays.items()}
            result = attribute_windows(per_dev, win, figures=figures)
            row = {k: (v[0].item() if hasattr(v[0], "item") else v[0]) for k, v in result.items()}
            row["device_index"] = idx
            out.append(row)
        return out

    def _process_figures(
        self, t_begin: int, t_end: int, wait_s: float, figures: Collection[str] | None
    ) -> list[dict[str, Any]] | None:
        assert isinstance(self.sampler, ProcessSampler)
        keep = self._mask_of(figures)[1]  # the figures wanted and duration_s, or None: all
        asked = self._requests.get((t_begin, t_end))
        if asked is None or not _covers(asked, keep):
            self.request_figures(t_begin, t_end, figures)  # not asked for (all of) them yet
            asked = self._requests.get((t_begin, t_end))
            if asked is None:
                return None
        seq = asked[0]
        answer = self.sampler.read_figures(seq)
        if answer is None and wait_s > 0:
            deadline = time.monotonic() + wait_s
            while answer is None and self.sampler.running and time.monotonic() < deadline:
                time.sleep(0.002)
                answer = self.sampler.read_figures(seq)
        if answer is None:
            return None
        out = []
        for idx, values in answer[2]:
            row = decode_figures(values, self._figure_columns, keep)
            row["device_index"] = idx
            out.append(row)
        return out
