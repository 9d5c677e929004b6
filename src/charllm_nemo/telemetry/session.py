"""One rank's telemetry session: backend + sampler + window marks + store, started and
stopped together. This is what training integrations (the Megatron-Core loop, later the NeMo
callback) hold.

    options = SessionOptions(backend="auto", hz=100)
    with TelemetrySession(out_dir, options, placement=Placement(rank=r, world_size=w)) as tel:
        wid = tel.windows.begin("step", step=0)
        ...
        tel.windows.end(wid)
        figures = tel.step_figures(wid)   # None until the sampler has passed the step's end

Where the work happens (``sampler``): in one engine (telemetry/engine.py), which the session
replaces when the telemetry process is lost mid-run:

* ``process`` (what ``auto`` gives for a backend named by a string): a **telemetry process**
  beside this one samples the device, writes the Parquet segments and computes live figures
  (telemetry/process/engine.py). This process only writes finished windows into shared memory
  (~3 µs a window, begin to end) and reads figures back: no thread here, no GIL shared with
  training.
* ``thread`` (a Backend object, synthetic options that cannot cross into another process, or a
  telemetry process that would not start or was lost): a sampler thread and a flusher thread in
  this process, and live figures computed on the caller's thread.

The session itself opens the device (telemetry/placement.py), writes the manifest, handles
SIGTERM and the close at exit, and closes in order.

Safe against a killed job: segments are flushed every ``flush_interval_s`` (at least every
second); SIGTERM (what SLURM sends before SIGKILL) and normal exit (atexit) flush everything and
mark the manifest complete / terminated. In process mode a training process killed outright
(SIGKILL, a segfault) loses nothing it had marked: its telemetry process flushes and marks the
manifest ``killed``.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Collection
from pathlib import Path
from types import FrameType
from typing import Any

from charllm_nemo.devices.base import Backend, activity_input
from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.engine import Engine, ThreadEngine
from charllm_nemo.telemetry.manifest import session_manifest
from charllm_nemo.telemetry.placement import (
    local_ranks_from_env,
    open_rank_backend,
    resolve_collector_sched,
    resolve_sampler_mode,
)
from charllm_nemo.telemetry.process.engine import ProcessEngine
from charllm_nemo.telemetry.process.parent import ProcessSampler
from charllm_nemo.telemetry.sample_loop import (
    AUTO_EVERY,
    COUNTER_READ_BUDGET,
    counter_every,
    effective_counter_every,
    figures_period_ns,
)
from charllm_nemo.telemetry.sampler import Row, SamplerHealth
from charllm_nemo.telemetry.session_options import MEGATRON_LABELS, Placement, SessionOptions
from charllm_nemo.telemetry.store import (
    DISK_FULL,
    RankStore,
    SegmentWriter,
    clear_rank_folder,
    out_dir_option,
    rank_dir,
    warm_up_parquet_writer,
)
from charllm_nemo.telemetry.windows import WindowRecorder

log = logging.getLogger("charllm_nemo.telemetry")


class TelemetrySession:
    """Telemetry for one rank. Construct, then :meth:`start` (or use as a context manager).

    ``options``: how it runs (:class:`~charllm_nemo.telemetry.session_options.SessionOptions`,
    checked when made; None: every default). ``placement``: who this rank is
    (:class:`~charllm_nemo.telemetry.session_options.Placement`: rank, local rank, world size,
    the node's ranks, its parallel ranks, which label every window; None: a single process,
    ``Placement()``, whose node's ranks come from ``LOCAL_WORLD_SIZE`` /
    ``SLURM_NTASKS_PER_NODE`` for ``collector_sched=auto``). ``config``: the run's
    configuration, written into the manifest. ``handle_signals``: install the SIGTERM handler
    (:meth:`_on_sigterm`; main thread only); False where the host owns SIGTERM. A session from a
    config: telemetry/config.py ``open_session``.

    In process mode the telemetry process opens the backend again by name; this process keeps
    its own handle for the device identities. The counters' rate: with ``counter_hz=None`` it is
    derived here from the measured cost of a counter read, once, and handed on as a rate so
    that the sampler (thread or process) applies the same n; live figures wait for the next
    counter read past a window's end.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        options: SessionOptions | None = None,
        *,
        placement: Placement | None = None,
        config: dict[str, Any] | None = None,
        handle_signals: bool = True,
    ) -> None:
        opts = SessionOptions() if options is None else options
        if not isinstance(opts, SessionOptions):
            raise TypeError(
                f"TelemetrySession(options={opts!r}): give a SessionOptions, e.g. "
                "TelemetrySession(out_dir, SessionOptions(backend='synthetic', hz=100))"
            )
        place = Placement() if placement is None else placement
        if not isinstance(place, Placement):
            raise TypeError(
                f"TelemetrySession(placement={place!r}): give a Placement, e.g. "
                "placement=Placement(rank=1, local_rank=1, world_size=2, local_world_size=2)"
            )
        self.options = opts
        self.placement = place
        self._handle_signals = handle_signals
        self.hz = opts.hz
        every = counter_every(self.hz, opts.counter_hz)
        mode = resolve_sampler_mode(opts.sampler, self.hz)
        self.rank, self.local_rank, self.world_size = place.rank, place.local_rank, place.world_size
        self.out_dir = Path(out_dir)
        # Before anything starts: an earlier run's files in this rank's folder (StoreError, or
        # removed with overwrite), so that its segments are never read as this run's.
        clear_rank_folder(rank_dir(self.out_dir, self.rank), overwrite=opts.store.overwrite)
        self.windows = WindowRecorder()
        known = {k: v for k, v in place.labels.items() if k in MEGATRON_LABELS or k == "vpp_chunk"}
        if known:
            self.windows.set_labels(**known)
        backend_options = dict(opts.backend_options)
        backend = opts.backend
        if mode == "process" and not isinstance(backend, str):
            if opts.sampler == "process":
                raise ConfigError(
                    "telemetry.sampler='process' needs a backend name (the telemetry process opens it "
                    "itself), not a Backend object; pass backend='nvml' / 'amdsmi' / 'synthetic' or "
                    "use sampler='thread'"
                )
            mode = "thread"
        if isinstance(backend, str):
            self.backend = open_rank_backend(
                backend, opts.devices, rank=self.rank, local_rank=self.local_rank, options=backend_options
            )
        else:
            self.backend = backend
        self.source = self.backend.name
        # Live figures wait for a slot whose counters were read (telemetry.sample_loop): every
        # n-th where a device reads them apart (NVML), every slot elsewhere.
        self.counter_every = effective_counter_every(self.backend.devices, every, self.hz)
        """Sampling slots per counter read (1: the counters come with every sample)."""
        self.counter_rate = {
            "every": self.counter_every,
            "hz": self.hz / self.counter_every,
            "how": "derived from the measured read cost" if every == AUTO_EVERY else "telemetry.counter_hz",
            "budget_core_share": COUNTER_READ_BUDGET if every == AUTO_EVERY else None,
        }
        counter_hz = self.hz / self.counter_every
        self.figures_period_ns = figures_period_ns(self.hz, self.counter_every)
        """How often samples that can answer a live figure arrive (ns): a figure of a window is
        ready about this long after the window's end, at the latest."""
        self.collector_sched: dict[str, str] | None = None  # process mode: what applies, and why
        self._counter_hz = counter_hz
        activity = activity_input(self.backend)  # a device model that follows the marks (devices/base.py)
        if activity is not None:
            self.windows.add_listener(activity)
        process: ProcessSampler | None = None
        if mode == "process":
            # the node's ranks: the placement's, or the launcher's word for a session given none
            local_ranks = local_ranks_from_env(os.environ) if placement is None else place.local_world_size
            process = self._process_sampler(backend, backend_options, config, local_ranks)
            mode = "process" if process is not None else "thread"
        self.sampler_mode = mode
        if opts.process.export and mode != "process":
            log.warning(
                "telemetry.export=%s runs in the telemetry process; this rank samples in a thread, so "
                "nothing is exported (use telemetry.sampler=auto or process)",
                opts.process.export.get("mode"),
            )
        manifest = session_manifest(
            placement=place,
            backend=self.backend,
            hz=self.hz,
            sampler_mode=mode,
            counter_rate=self.counter_rate,
            collector_sched=self.collector_sched,
            config=config,
        )
        self.store = RankStore(self.out_dir, self.rank, manifest, writes_segments=mode == "thread")
        self.store.segments.out_dir_option = out_dir_option(config)
        self.compact_at_close = True
        """At close, the rank folder's segments become a few large files (telemetry/compact.py)."""
        self.engine: Engine = (
            ProcessEngine(process, activity) if process is not None else self._thread_engine(counter_hz)
        )
        """Where sampling, storing and live figures run (telemetry/engine.py)."""
        self._closed = False
        self._started = False
        self._prev_sigterm: Any = None
        self._sigterm = False  # a SIGTERM arrived: whenever the session closes, it was terminated
        self._redeliver_sigterm = False  # a SIGTERM held back until the close is done
        self._closed_fully = False
        self._final_status = "running"  # close() sets it: what the manifest says at the end

    def _process_sampler(
        self,
        asked: str | Backend,
        backend_options: dict[str, Any],
        config: dict[str, Any] | None,
        local_ranks: int,
    ) -> ProcessSampler | None:
        """The telemetry process's sampler for this session (not started), with its collector
        policy resolved (``self.collector_sched`` says which and why); None where it cannot be
        had and ``sampler=auto`` (then this rank samples in a thread). ``asked``: the backend
        the options named; ``local_ranks``: the node's ranks (``collector_sched=auto``)."""
        opts = self.options
        setting = opts.process.collector_sched
        policy, why = resolve_collector_sched(setting, local_ranks, opts.process.rank_threads)
        self.collector_sched = {"setting": setting, "policy": policy, "why": why}
        # The backend this process ended up with (auto resolved, index fallback applied); the
        # options went to it only if it was named or is synthetic (auto gives nvml / amdsmi none).
        named = asked == self.source or self.source == "synthetic"
        export = None if opts.process.export is None else dict(opts.process.export)
        try:
            return ProcessSampler(
                self.source,
                [d.identity.index for d in self.backend.devices],
                backend_options if named else {},
                self.hz,
                store={
                    "rank_dir": rank_dir(self.out_dir, self.rank),
                    "flush_interval_s": opts.store.flush_interval_s,
                    "live_window_s": opts.store.live_window_s,
                    "driver_buffers": opts.store.driver_buffers,
                    "export": export,  # telemetry.export (telemetry/export/): the process's
                    "out_dir_option": out_dir_option(config),  # the disk-full line's words
                },
                process=dataclasses.replace(opts.process, collector_sched=policy),
                counter_hz=self._counter_hz,
            )
        except ConfigError as exc:
            if opts.sampler == "process":
                self.backend.close()
                raise
            log.info("telemetry: sampling in a thread: %s", exc)
            self.collector_sched = None  # no telemetry process, no collector thread
            return None

    def _thread_engine(self, counter_hz: float | None, earlier_windows: int = 0) -> ThreadEngine:
        return ThreadEngine(
            self.backend.devices,
            self.hz,
            source=self.source,
            store=self.store,
            storing=self.options.store,
            figures_period_ns=self.figures_period_ns,
            counter_hz=counter_hz,
            earlier_windows=earlier_windows,
        )

    @property
    def sampler(self) -> Any:
        """The engine's sampler (a thread's :class:`Sampler` or a ``ProcessSampler``)."""
        return self.engine.sampler

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> TelemetrySession:
        """Start sampling (and, in process mode, the telemetry process); the SIGTERM handler and
        the close at exit are installed here. Idempotent."""
        if self._started:
            return self
        self._started = True
        self._check_cpus()
        if self.engine.start(self.windows):
            if self.engine.pid is not None:
                self.store.manifest["sampler_process_pid"] = self.engine.pid
                self.store.write_manifest()
        else:
            self._fall_back_to_thread()
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
    def manifest(self) -> dict[str, Any]:
        """This rank's manifest as it stands (what ``manifest.json`` says, or will at close): who,
        what, where, the sampler mode, and at close the counts. The caller must not change it."""
        return self.store.manifest

    @property
    def health(self) -> SamplerHealth:
        """How the sampling has gone so far (samples, deadlines met, devices lost, nulls per
        metric), whichever engine samples."""
        return self.engine.health

    def health_counts(self) -> tuple[float, float, float]:
        """:attr:`health` as a rank sends it each step (deadlines missed, null readings, 1.0
        once sampling stopped): read without making a SamplerHealth in process mode."""
        return self.engine.health_counts()

    @property
    def disk_full(self) -> bool:
        """Whether telemetry hit a full disk (ENOSPC / EDQUOT) and stopped writing: its segments
        (here or in the telemetry process) or its manifest. Cheap (a read of the shared block in
        process mode): a trainer may ask every step. The close then says status ``disk_full``."""
        return self.store.disk_full or self.engine.disk_full

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
        ended = self.engine.close(self.windows, open_records)
        if self.disk_full and status != "terminated":
            status = self._final_status = DISK_FULL
        self.store.compact_at_close = self.compact_at_close
        self.store.close(
            status,
            {
                "sampler": self.engine.health.to_dict(),
                "sampler_mode": self.sampler_mode,
                **ended["extra"],
                "windows_recorded": ended["recorded"],
                "windows_open_at_close": len(open_records),
            },
            counts=ended["counts"],
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
        reason = self.engine.health.stop_reason
        self.engine.sampler.stop()
        log.warning(
            "telemetry: the telemetry process did not start (%s); sampling in a thread instead", reason
        )
        self.engine.detach()
        self.collector_sched = self.store.manifest["collector_sched"] = None
        self.store.manifest["sampler_process_error"] = reason
        self._sample_here(self._thread_engine(self._counter_hz))

    def _sample_here(self, engine: ThreadEngine) -> None:
        """From now on, ``engine`` samples in this process (thread mode); the manifest says so."""
        self.engine = engine
        self.sampler_mode = self.store.manifest["sampler_mode"] = "thread"
        self.store.write_manifest()
        warm_up_parquet_writer()
        engine.start(self.windows)

    def _take_over(self, failed: Engine) -> None:
        """The telemetry process stopped mid-run (killed, crashed): store what its rings still
        hold (the salvage at its stop), then sample, store and compute figures in this process,
        as thread mode does, so that the rest of the run is recorded too. On the training
        thread, between two steps (from :meth:`request_figures`): no mark is under way."""
        pid = failed.pid
        counts = failed.stop_for_takeover()
        reason = failed.health.stop_reason or "it exited"
        option = self.store.segments.out_dir_option
        self.store.segments = SegmentWriter.continuing(self.store.dir, counts)
        self.store.segments.out_dir_option = option
        self.store.manifest["telemetry_process_lost"] = {
            "pid": pid,
            "reason": reason,
            "at_mono_ns": time.monotonic_ns(),
            "store": {k: counts[k] for k in ("segments", "rows", "salvaged", "marks_dropped") if k in counts},
        }
        log.error(
            "telemetry: the telemetry process (pid %s) stopped mid-run (%s); stored what it left "
            "and sampling in a thread from now on (telemetry_process_lost in the manifest)",
            pid,
            reason,
        )
        # Windows it had stored count at close with those recorded here from now on.
        stored = counts.get("rows", {}).get("windows", 0)
        self._sample_here(self._thread_engine(self._counter_hz, earlier_windows=stored))

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

    # -- data ------------------------------------------------------------------------------
    def flush(self) -> None:
        """Write what was sampled and marked since the last flush (the thread engine's flusher
        calls this; in process mode the telemetry process flushes and this does nothing)."""
        self.engine.flush()

    def live_rows(self, since_mono_ns: int = 0, before: int = 0) -> list[Row]:
        """Sampler rows still in memory from ``since_mono_ns``, and the ``before`` rows before
        those (thread mode: the last ``live_window_s``; process mode: what the shared ring still
        holds, up to 16 s)."""
        return self.engine.live_rows(since_mono_ns, before)

    def publish_step_rates(self, tokens_per_step: float, flops_per_step: float, peak_flops: float) -> None:
        """Hand the live exporter (``telemetry.export``) its constants once: tokens per step, model
        FLOPs per step per device and the peak FLOP/s of a device (0 = unknown). Its throughput
        and MFU series come from these and each step's duration, in the telemetry process; in
        thread mode there is no exporter and this does nothing."""
        publish = getattr(self.engine.sampler, "publish_rates", None)
        if publish is not None:
            publish(tokens_per_step, flops_per_step, peak_flops)

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
        0.25 s) at the latest. Once a second it also checks the telemetry process is alive, and
        takes over in this process if it is not.
        Cheap, never blocks; asking again for a window already asked for, with no figure beyond
        those asked for then, does nothing."""
        engine = self.engine
        if engine.lost(t_end_mono_ns):
            self._take_over(engine)
            return
        engine.request_figures(t_begin_mono_ns, t_end_mono_ns, figures, batch)

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
        return self.engine.figures(t_begin_mono_ns, t_end_mono_ns, wait_s, figures)
