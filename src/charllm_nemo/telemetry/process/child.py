"""The telemetry process: one per rank, beside the training process (the child's side).

Started by :class:`~charllm_nemo.telemetry.process.parent.ProcessSampler` as a fresh
interpreter (``sys.executable -c``), it gets its configuration on stdin, attaches the shared
block (telemetry/process/ring.py), opens the backend by name and runs the sampling loop
(:func:`~charllm_nemo.telemetry.sample_loop.run_sample_loop`) on its main thread, writing rows
into the sample ring. A second thread runs a
:class:`~charllm_nemo.telemetry.process.collector.Collector`: it takes the samples and the
training process's window records, answers figure requests, and writes the Parquet segments.
The collector sleeps until it has work: the sampling loop wakes it after a slot when the
training process wrote records or the samples reached the time its figure requests can be
answered (``Collector.has_work``), and its own timeout wakes it when a flush is due. An idle
training process costs the collector one wake-up per flush, not one per tick. The sampling
loop's own imports are light (no torch, numpy or pyarrow; ~50-75 ms from start to a first
sample without the collector); numpy, pyarrow and the Parquet writer's warm-up for the collector
come first (a few hundred ms, before the first sample, so that they never stall the sampling
loop).

The two threads share this process's GIL, not the training process's. The switch interval is
set to :data:`SWITCH_INTERVAL_S` so that a collector busy in Python hands the GIL back to the
sampling loop within a fraction of a 1 kHz period.

Lifetime: it stops when told (stop request + its stdin closed, which also wakes it from its
sleep), when the training process dies (EOF on stdin, or ``os.getppid()`` changing: checked
every slot); when no device is left it stops sampling but keeps storing the training
process's windows, without samples, until one of the other two. Whichever it is, the
collector takes everything left, answers every request and flushes. When the training process
died, it also marks that rank's manifest ``killed`` (what was marked before the death is on
disk: nothing is lost but the windows still open) and unlinks the block itself.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import select
import signal
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

from charllm_nemo.telemetry.process.ring import (
    D_ACTIVITY,
    FAILED,
    H_HEALTH,
    H_NULLS0,
    H_PID,
    H_SLOT_T,
    H_STATE,
    H_STOP,
    H_STOP_CODE,
    H_SVC_STATE,
    H_T_IMPORTED,
    H_T_MAIN,
    H_T_OPENED,
    HEALTH_FIELDS,
    RUNNING,
    STOPPED,
    SVC_DONE,
    SVC_FAILED,
    SVC_RUNNING,
    SVC_STARTING,
    Block,
    Layout,
    RingWriter,
    attach,
    unlink,
)
from charllm_nemo.telemetry.sample_loop import (
    SamplerHealth,
    effective_counter_every,
    figures_period_ns,
    run_sample_loop,
)

log = logging.getLogger("charllm_nemo.sampler")

MAX_SLEEP_S = 0.1
"""The longest the collector sleeps without being woken (its flush timer is usually shorter)."""
SWITCH_INTERVAL_S = 0.0002
"""This process's GIL switch interval (CPython's default is 5 ms: five periods at 1 kHz)."""
STOP_CODES = {"stopped": 1, "no devices left": 2, "crashed": 3, "parent exited": 4, "backend open failed": 5}

CHILD_CODE = (
    "import time; t = time.monotonic_ns()\n"
    "from charllm_nemo.telemetry.process.child import child_main; child_main(t)"
)


def arrow_pool_env(env: dict[str, str]) -> dict[str, str]:
    """What the telemetry process's environment adds so that its pyarrow allocates from jemalloc,
    which pyarrow sets to give freed pages back to the kernel at once, instead of its default
    mimalloc, whose reservation kept the pages of past compactions' merges (its resident part
    grew by 0.5 to 14.7 MB in half an hour of a soak; with jemalloc the telemetry process ran
    ~5-10 MB lower, at the same CPU: docs/soak.md, issue 48). An environment
    variable, read when pyarrow is imported (it makes its default pool then, so it cannot be
    switched later for everything). Nothing when the user chose a pool
    (``ARROW_DEFAULT_MEMORY_POOL``) or this pyarrow was built without jemalloc. Called in the
    training process (which has pyarrow imported already, for its store) for the child it
    starts: the training process's own pool is left as it is."""
    if env.get("ARROW_DEFAULT_MEMORY_POOL"):
        return {}
    import pyarrow as pa

    return {"ARROW_DEFAULT_MEMORY_POOL": "jemalloc"} if "jemalloc" in pa.supported_memory_backends() else {}


def _read_config(fd: int) -> dict[str, Any]:
    def exactly(n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            chunk = os.read(fd, n - got)
            if not chunk:
                raise EOFError("the training process closed the pipe before sending the configuration")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    (size,) = struct.unpack("<Q", exactly(8))
    config: dict[str, Any] = pickle.loads(exactly(size))
    return config


def child_main(t_main: int = 0) -> None:
    """Entry point of the telemetry process (``sys.executable -c``); the config arrives on stdin.
    ``t_main``: CLOCK_MONOTONIC when the interpreter began running our code (before imports)."""
    t_main = t_main or time.monotonic_ns()
    # The job's Ctrl-C / SIGTERM goes to every process of the group: the parent decides when this
    # one stops (it flushes first), and this one stops on its own if the parent dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    logging.basicConfig(
        level=logging.WARNING, format="charllm-nemo telemetry process %(process)d: %(levelname)s %(message)s"
    )
    # The parent opened the same backend and has already said everything about it at open; what
    # fails while sampling is logged by the sampling loop (charllm_nemo.sampler), not silenced.
    logging.getLogger("charllm_nemo.devices").setLevel(logging.ERROR)
    config = _read_config(0)
    # telemetry.nice, before any thread starts (threads inherit it from the one that makes them;
    # on Linux a nice value is per thread). Never raised above what the rank runs at.
    nice = int(config.get("nice", 0))
    if nice > os.getpriority(os.PRIO_PROCESS, 0):
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    block = attach(config["shm_name"], Layout(**config["layout"]))
    q = block.q
    q[H_PID] = os.getpid()
    q[H_T_MAIN] = t_main
    parent_gone = [False]
    state, reason = FAILED, "crashed"
    try:
        state, reason = _run(config, block, parent_gone)
    except BaseException as exc:  # report it in the block, whatever it was
        reason = f"crashed: {exc!r}"
        log.exception("telemetry process crashed")
    finally:
        block.set_message(reason)
        q[H_STOP_CODE] = STOP_CODES.get(reason.split(":", 1)[0].split(" (", 1)[0], 3)
        q[H_STATE] = state
        if parent_gone[0] or os.getppid() != config["parent_pid"]:
            unlink(config["shm_name"])
        block.close()


def _open(config: dict[str, Any], block: Block) -> Any:
    from charllm_nemo.devices.factory import ProcessPlan, open_in_process

    block.q[H_T_IMPORTED] = time.monotonic_ns()
    plan = ProcessPlan(config["options"], config["shared_activity"], config["observe_parent"])
    d = block.d
    return open_in_process(
        config["backend"],
        config["devices"],
        plan,
        parent_pid=int(config["parent_pid"]),
        published_level=lambda: float(d[D_ACTIVITY]),  # one aligned 8-byte word: NaN until a mark
    )


def _run(config: dict[str, Any], block: Block, parent_gone: list[bool]) -> tuple[int, str]:
    q = block.q
    parent = int(config["parent_pid"])
    try:
        backend = _open(config, block)
    except Exception as exc:
        log.error("cannot open backend %r: %s", config["backend"], exc)
        return FAILED, f"backend open failed: {exc}"
    q[H_T_OPENED] = time.monotonic_ns()
    health = SamplerHealth(hz=float(config["hz"]))
    writer = RingWriter(block)
    stdin_readable = [False]

    def publish() -> None:
        for i, field in enumerate(HEALTH_FIELDS):
            q[H_HEALTH + i] = getattr(health, field)
        for i, n in enumerate(health.nulls):
            q[H_NULLS0 + i] = n

    def should_stop() -> bool:
        publish()
        service.nudge()
        if q[H_STOP] or stdin_readable[0]:
            if not q[H_STOP]:
                parent_gone[0] = True  # EOF without a stop request: the parent died
            return True
        if os.getppid() != parent:
            parent_gone[0] = True
            return True
        return False

    def sleep(seconds: float) -> None:
        # Sleep on stdin: a stop (the parent closes it) or the parent's death (EOF) wakes us at once.
        readable, _, _ = select.select([0], [], [], seconds)
        if readable:
            stdin_readable[0] = True

    # Counter slots (sample_loop): every n-th where a device reads its counters apart (NVML).
    every = effective_counter_every(backend.devices, int(config.get("counter_every", 1)), health.hz)
    config["figures_period_ns"] = figures_period_ns(health.hz, every)
    service = _Service(block, config, backend.devices)
    service.start()
    q[H_STATE] = RUNNING
    try:
        run_sample_loop(
            backend.devices,
            round(1e9 / health.hz),
            health,
            writer.emit,
            should_stop,
            sleep,
            on_slot=functools.partial(q.__setitem__, H_SLOT_T),
            counter_every=every,
        )
        # No device left (lost; a backend that failed): the training goes on marking windows,
        # and they are the user's. The collector keeps storing them (with no samples, which
        # the attribution flags) until the stop, as thread mode's flusher does; ending here
        # would leave every later window in the mark ring, never stored.
        while not should_stop():
            sleep(MAX_SLEEP_S)
    finally:
        publish()
        service.drain_buffers()  # the driver's samples up to now, while the devices are open
        try:
            backend.close()
        except Exception:
            log.exception("backend close failed")
        service.finish(parent_gone[0], health)
    if writer.bad_values:
        log.error("%d metric value(s) did not fit their column and were recorded as null", writer.bad_values)
    store_error = f" ({service.error})" if service.error else ""
    if parent_gone[0]:
        log.warning("the training process is gone: sampling stopped, everything taken was flushed")
        return STOPPED, "parent exited" + store_error
    return STOPPED, (health.stop_reason or "stopped") + store_error


class _Service(threading.Thread):
    """The collector's thread. Built before sampling starts: importing numpy and pyarrow and
    warming up the Parquet writer hold the GIL for long stretches (C module init does not
    switch), which would make the sampling loop miss its first ~0.3 s of deadlines."""

    def __init__(self, block: Block, config: dict[str, Any], devices: Any = ()) -> None:
        super().__init__(name="charllm-collector", daemon=True)
        self.block = block
        self.store: dict[str, Any] = config["store"]
        self.sched = str(config.get("collector_sched", "normal"))
        self._stop_event = threading.Event()
        self._wake = threading.Event()
        self._nudge_failed = False
        self.collector: Any = None
        self.error: str | None = None
        block.q[H_SVC_STATE] = SVC_STARTING
        try:
            from charllm_nemo.telemetry.buffered import BufferedStore
            from charllm_nemo.telemetry.process.collector import Collector
            from charllm_nemo.telemetry.store import warm_up_parquet_writer

            warm_up_parquet_writer()
            buffered = None
            if self.store.get("driver_buffers"):
                buffered = BufferedStore(Path(self.store["rank_dir"]), devices)
                buffered = buffered if buffered.devices else None
            self.collector = Collector(
                block,
                Path(self.store["rank_dir"]),
                source=self.store["source"],
                period_ns=int(config["figures_period_ns"]),
                flush_interval_s=float(self.store["flush_interval_s"]),
                live_window_s=float(self.store["live_window_s"]),
                buffered=buffered,
            )
            if self.store.get("out_dir_option"):  # the disk-full line names it as the user did
                self.collector.writer.out_dir_option = str(self.store["out_dir_option"])
            if self.store.get("export"):  # telemetry.export (telemetry/export/); never stops the store
                self.collector.exporter = _exporter(
                    self.store["export"], devices, config["figures_period_ns"]
                )
        except Exception as exc:
            log.exception("telemetry store could not start; the training process will write what it can")
            self.error = f"store failed: {exc!r}"
            block.q[H_SVC_STATE] = SVC_FAILED

    def drain_buffers(self) -> None:
        """Take the driver buffers' samples now (before the backend closes); never raises."""
        c = self.collector
        if c is not None and c.buffered is not None:
            c.buffered.poll()

    def nudge(self) -> None:
        """Wake the collector if it has work (the sampling loop calls this after every slot, once
        that slot's samples are in the ring). Never raises into the sampling loop: should the
        check fail, it is logged once and the collector is woken every slot from then on."""
        c = self.collector
        if c is None:
            return
        try:
            if self._nudge_failed or c.has_work():
                self._wake.set()
        except Exception:
            log.exception("collector wake-up check failed; waking it every slot instead")
            self._nudge_failed = True
            self._wake.set()

    def run(self) -> None:
        c = self.collector
        if c is None:
            return
        if self.sched == "idle":
            _become_sched_idle()
        self.block.q[H_SVC_STATE] = SVC_RUNNING
        while True:
            self._wake.wait(min(c.until_flush_s(), MAX_SLEEP_S))
            self._wake.clear()
            if self._stop_event.is_set():
                return
            c.tick()

    def finish(self, parent_gone: bool, health: SamplerHealth) -> None:
        """Stop ticking, take and flush everything; if the parent died, mark its manifest."""
        self._stop_event.set()
        self._wake.set()
        self.join(60.0)
        c = self.collector
        if c is None or self.is_alive():
            return
        try:
            c.finish()
            if parent_gone:
                from charllm_nemo.telemetry.process.collector import mark_manifest_killed

                mark_manifest_killed(
                    Path(self.store["rank_dir"]),
                    c.writer.counts(),
                    {"sampler": health.to_dict(), "killed_note": KILLED_NOTE},
                )
            self.block.q[H_SVC_STATE] = SVC_DONE
        except Exception as exc:
            log.exception("telemetry store's final flush failed")
            self.error = f"store failed: {exc!r}"
            self.block.q[H_SVC_STATE] = SVC_FAILED
        finally:
            if c.exporter is not None:
                c.exporter.close()
            c.close()


def _exporter(options: dict[str, Any], devices: Any, period_ns: int) -> Any:
    """The live exporter, or None (said once) when it cannot start: a port in use, a bad folder."""
    try:
        from charllm_nemo.telemetry.export.exporter import Exporter

        return Exporter(options, devices, period_ns)
    except Exception as exc:
        log.error(
            "telemetry.export=%s could not start (%s); training and the store go on", options.get("mode"), exc
        )
        return None


def _become_sched_idle() -> None:
    """Put the calling thread under SCHED_IDLE (telemetry.collector_sched=idle; Linux applies a
    policy per thread, and pid 0 is the caller); where that fails it keeps its policy, and says so."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as exc:
        log.warning(
            "telemetry.collector_sched=idle could not be applied (%s): the collector keeps its policy", exc
        )


KILLED_NOTE = (
    "the training process died without closing its telemetry; its telemetry process stored every "
    "sample and every window finished before the death (windows still open then are missing)"
)
