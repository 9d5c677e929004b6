"""The sink protocol, and :class:`AsyncSink`: any sink's calls off the training thread.

A sink receives, on rank 0, one dict of metrics per training step (keys from sinks/keys.py),
optionally a table of per-window rows, and the run directory at the end. Sinks know nothing
of training; the training loop knows nothing of W&B.

The training loop never calls a backend directly: :class:`AsyncSink` puts each call on a
bounded queue that one daemon thread drains. A full queue drops the new item and counts it
(the caller never waits), a call that raises is counted and logged once (never propagated),
and :meth:`AsyncSink.finish` waits at most its timeout, whatever the backend does; then
:func:`exit_now_if_abandoned` keeps a hung backend's exit hooks from holding the process.
Everything a sink loses is still on disk in the run directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from charllm_nemo.sinks.keys import StepKeys

log = logging.getLogger("charllm_nemo.sinks")

Metrics = Mapping[str, float | int | None]
"""One step's metrics: key -> number; None (or NaN) = not known, which sinks omit."""

StepKeysBuilder = Callable[
    [int, Mapping[str, Any] | None, Sequence[Sequence[float]] | None], Mapping[str, float | int]
]
"""(step, summary, gathered) -> metrics: what :meth:`AsyncSink.log_figures` runs off-thread."""


@runtime_checkable
class Sink(Protocol):
    """Where per-step metrics go. Called from one thread at a time, in this order:
    ``start`` once, ``log_step`` per step (and ``log_windows_table`` any time), ``finish`` once."""

    def start(self, config: dict[str, Any], manifest: dict[str, Any]) -> None:
        """Open the sink. ``config``: the resolved training config; ``manifest``: the run's
        manifest (devices, backend, versions, world size; see docs/store.md)."""
        ...

    def log_step(self, step: int, metrics: Metrics) -> None:
        """One training step's metrics (keys from charllm_nemo.sinks.keys)."""
        ...

    def log_windows_table(self, rows: list[dict[str, Any]]) -> None:
        """Per-window rows (one dict per window, the same keys in every row)."""
        ...

    def finish(self, run_dir: Path | None) -> None:
        """Close the sink; ``run_dir`` is the telemetry run directory (None = unknown)."""
        ...


@dataclass(frozen=True)
class SinkReport:
    """What an :class:`AsyncSink` did. Counts of calls: ``logged`` reached the backend and
    returned, ``dropped`` were refused because the queue was full, ``errors`` raised in the
    backend, ``skipped`` were not sent because the backend's ``start`` had failed,
    ``abandoned`` were still queued when ``finish`` gave up. ``finished``: the backend's
    ``finish`` returned within the deadline; ``finish_s``: seconds ``finish`` took."""

    name: str
    logged: int
    dropped: int
    errors: int
    skipped: int
    abandoned: int
    finished: bool
    timed_out: bool
    finish_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        state = "finished" if self.finished else ("timed out" if self.timed_out else "not finished")
        return (
            f"sink {self.name}: {state} in {self.finish_s:.2f} s; {self.logged} calls logged, "
            f"{self.dropped} dropped (queue full), {self.errors} errors, {self.skipped} skipped, "
            f"{self.abandoned} abandoned"
        )


_FINISH = object()  # queue sentinel: drain everything before it, then call backend.finish

ABANDONED: list[str] = []
"""Names of the sinks whose backend did not finish within its timeout in this process (their
threads are left behind): :func:`exit_now_if_abandoned` ends the process without waiting."""


def exit_now_if_abandoned(code: int) -> None:
    """End this process at once with ``code`` when a sink's backend was abandoned (its finish
    timed out); else return. A hung backend's library may hold the exit in its own hooks
    (wandb's atexit teardown waits for its service, which waits for the hung request: 60 s
    and more, then a traceback); everything of the run is on disk by now, so exit hooks are
    skipped (``os._exit``) after the standard streams and the log handlers are flushed."""
    if not ABANDONED:
        return
    log.warning(
        "exiting without waiting for sink %s (its backend did not finish in time; the run directory "
        "has everything)",
        ", ".join(ABANDONED),
    )
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


BATCH_S = 0.1
"""The sink thread takes its queue at most about this often (s): a W&B key a tenth of a second
later costs nothing; a thread woken every step costs the training thread a GIL hand-over each."""


class AsyncSink:
    """Runs a sink's calls on a daemon thread through a bounded queue of ``queue_size`` items.

    The caller's ``start`` / ``log_step`` / ``log_figures`` / ``log_windows_table`` return at
    once (a queue put, a few µs; :meth:`log_figures` also leaves building the keys to the sink
    thread). The thread takes the queue in batches, at most about every ``batch_s`` seconds
    (0: at every put). When the queue is full the new item is dropped and counted; the first drop
    is logged, and the total at finish. A backend call that raises is counted and its first
    exception (per method) is logged with the traceback; the sink goes on with the next item.
    If the backend's ``start`` raised, later items are skipped (counted), not sent.

    ``finish(run_dir, timeout_s=...)`` waits for the queue to drain and the backend's finish
    to return, at most ``timeout_s`` seconds (default ``finish_timeout_s``), then logs a
    :class:`SinkReport` line; :attr:`report` holds it. A backend call that hangs cannot hold
    up the process: the worker is a daemon thread and is left behind.
    """

    def __init__(
        self,
        sink: Sink,
        *,
        queue_size: int = 1024,
        finish_timeout_s: float = 60.0,
        name: str | None = None,
        step_keys: StepKeysBuilder | None = None,
        batch_s: float = BATCH_S,
    ) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size={queue_size} must be >= 1")
        self.sink = sink
        self.step_keys: StepKeysBuilder = step_keys if step_keys is not None else StepKeys()
        self.name = name or type(sink).__name__
        self.finish_timeout_s = float(finish_timeout_s)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self.logged = 0
        self._in_flight = False  # a call (other than finish) under way on the sink's thread
        self.dropped = 0
        self.errors = 0
        self.skipped = 0
        self._broken = False
        self._errors_logged: set[str] = set()
        self._drop_logged = False
        self._finish_called = False
        self._finished = threading.Event()
        self.batch_s = float(batch_s)
        self.wakes = 0  # times the thread woke to a queued item (the rest of a batch waits for none)
        self._hurry = threading.Event()  # set by finish: no more resting between batches
        self._backend_finished = False
        self._report: SinkReport | None = None
        self._thread = threading.Thread(target=self._run, name=f"charllm-sink-{self.name}", daemon=True)
        self._thread.start()

    # -- caller side (the training thread) ---------------------------------------------------
    def _put(self, item: tuple[str, tuple[Any, ...]]) -> bool:
        if self._finish_called:
            self.dropped += 1
            return False
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            self.dropped += 1
            if not self._drop_logged:
                self._drop_logged = True
                log.warning(
                    "sink %s: queue full (%d items): dropping new items; the run directory keeps "
                    "everything (the total is reported at finish)",
                    self.name,
                    self._queue.maxsize,
                )
            return False

    def start(self, config: dict[str, Any], manifest: dict[str, Any]) -> None:
        self._put(("start", (config, manifest)))

    def log_step(self, step: int, metrics: Metrics) -> None:
        self._put(("log_step", (step, dict(metrics))))

    def log_figures(
        self,
        step: int,
        summary: Mapping[str, Any] | None = None,
        gathered: Sequence[Sequence[float]] | None = None,
    ) -> None:
        """Queue one step's raw numbers; the sink thread turns them into keys (``step_keys``:
        :class:`~charllm_nemo.sinks.keys.StepKeys`) and calls the backend's ``log_step``.
        ``summary``: a ``StepReport.to_dict()`` (charllm_nemo.steps; loss, step time, throughput, MFU);
        ``gathered``: every rank's figure vector, index = rank (``StepReport.rank_figures``).
        The cheapest call for the training thread: a queue put, no key is built here."""
        self._put(("log_figures", (step, summary, gathered)))

    def log_windows_table(self, rows: list[dict[str, Any]]) -> None:
        self._put(("log_windows_table", (rows,)))

    def log_alert(self, step: int, alert: dict[str, Any]) -> None:
        """Queue one alert (charllm_nemo.alerts; a dict with ``kind``, ``message``, ...): the
        sink thread calls the backend's ``log_alert(step, alert)``; a backend without one
        skips it."""
        if hasattr(self.sink, "log_alert"):
            self._put(("log_alert", (step, dict(alert))))

    def finish(self, run_dir: Path | None = None, *, timeout_s: float | None = None) -> None:
        """Drain and close within ``timeout_s`` seconds; logs and stores :attr:`report`.
        Idempotent: a second call returns at once."""
        if self._finish_called:
            return
        self._finish_called = True
        self._hurry.set()
        timeout = self.finish_timeout_s if timeout_s is None else float(timeout_s)
        t0 = time.monotonic()
        deadline = t0 + max(timeout, 0.0)
        queued = True
        try:
            self._queue.put((_FINISH, (run_dir,)), timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Full:
            queued = False
        timed_out = not (queued and self._finished.wait(max(deadline - time.monotonic(), 0.0)))
        # Items still queued behind a hung call (the sentinel itself not counted), and the hung
        # call itself when it is one of the run's (not the backend's own finish).
        abandoned = max(self._queue.qsize() - (1 if queued else 0), 0) + self._in_flight if timed_out else 0
        self._report = SinkReport(
            name=self.name,
            logged=self.logged,
            dropped=self.dropped,
            errors=self.errors,
            skipped=self.skipped,
            abandoned=abandoned,
            finished=self._finished.is_set() and self._backend_finished,
            timed_out=timed_out,
            finish_s=time.monotonic() - t0,
        )
        line = self._report.line()
        if timed_out:
            ABANDONED.append(self.name)
            log.warning("%s (the backend is slow or hung; its thread is left behind)", line)
        elif self._report.dropped or self._report.errors:
            log.warning(line)
        else:
            log.info(line)

    @property
    def report(self) -> SinkReport:
        """The final report after :meth:`finish`; before it, the counts so far."""
        if self._report is not None:
            return self._report
        return SinkReport(
            self.name, self.logged, self.dropped, self.errors, self.skipped, 0, False, False, 0.0
        )

    @property
    def pending(self) -> int:
        """Items queued and not yet handled."""
        return self._queue.qsize()

    # -- worker side -------------------------------------------------------------------------
    def _run(self) -> None:
        """Take what is queued, all of it, then rest ``batch_s`` (puts meanwhile wake nobody: a
        queue put with no thread waiting is a notify of no one), so the thread wakes at most
        about once a ``batch_s``, not once a step; :meth:`finish` cuts the rest short."""
        while True:
            item = self._queue.get()  # blocks until the first item
            self.wakes += 1
            while True:
                if not self._handle(*item):
                    return
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if self.batch_s > 0:
                self._hurry.wait(self.batch_s)

    def _handle(self, method: Any, args: tuple[Any, ...]) -> bool:
        """One queued call; False after the finish (the thread ends)."""
        if method is _FINISH:
            self._backend_finished = not self._broken and self._call("finish", args)
            self._finished.set()
            return False
        if self._broken:
            self.skipped += 1
            return True
        self._in_flight = True
        ok = self._call(method, args)
        self._in_flight = False
        if not ok and method == "start":
            self._broken = True
            log.warning("sink %s: start failed; its later calls are skipped", self.name)
        return True

    def _call(self, method: str, args: tuple[Any, ...]) -> bool:
        """Call the backend; True when it returned, False when it raised (counted, logged once)."""
        try:
            if method == "log_figures":
                step = args[0]
                self.sink.log_step(step, self.step_keys(*args))
            else:
                getattr(self.sink, method)(*args)
        except Exception as exc:
            self.errors += 1
            if method not in self._errors_logged:
                self._errors_logged.add(method)
                # One line (a backend's network error is not this program's bug); the
                # traceback at DEBUG (`charllm -v` shows INFO, CHARLLM_LOG_LEVEL=DEBUG this).
                log.warning(
                    "sink %s: %s raised %s: %s (counted; later errors of %s are counted silently)",
                    self.name,
                    method,
                    type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "",
                    method,
                )
                log.debug("sink %s: %s's traceback", self.name, method, exc_info=True)
            return False
        self.logged += 1
        return True
