"""Rank 0's slow step observers off the training thread: the training thread puts the report on a
queue (:class:`ObserverThread`), a thread of its own hands it to ``steps.jsonl`` and the
trainer's loggers.

What they cost the training thread otherwise (NeMo's llama3 recipe shrunk,
``bench/bench_nemo_callback.py --profile``, 2026-12-05): the ``steps.jsonl`` line's ``write``
~0.6 ms on this VM's disk, and
``dataclasses.asdict`` of the report once for the file and once for the loggers; making
``<prefix><field>`` scalars for TensorBoard, a protobuf ``Summary`` and ``Event`` per scalar.
:class:`ThreadedLoggersObserver`, run on that thread, makes the scalars and logs them:

* to loggers known to be safe to call from a second thread while the training thread logs to
  them too: Lightning's ``TensorBoardLogger`` over torch's ``SummaryWriter`` (every event goes
  through tensorboard's ``EventFileWriter``, whose ``_AsyncWriter`` takes a lock around its
  queue; the writer is created on the training thread before the thread starts), directly;
* to every other logger (W&B's ``run.log`` is not thread-safe: wandb/wandb#1824; the CSV
  logger's rows list is rewritten by its ``save()`` on the training thread), the ready scalars
  wait until the training thread hands them over where Lightning logs itself (every
  ``log_every_n_steps`` steps: :meth:`flush`) and at close.

The thread still takes the training process's GIL while it works; on a GPU the training thread
spends most of a step outside the GIL (waiting for CUDA), on a CPU-bound tiny model it does not
(docs/integrations.md, "Overhead"). So it wakes seldom: the training thread appends the report
to a deque and signals the thread only once :data:`BATCH` reports wait or :data:`MAX_DELAY_S`
passed since the last signal (checked at the append: no timer runs), and the thread then takes
them all. Every wake of a thread costs the training thread a GIL hand-over and a context
switch; the alert checks (charllm_nemo.alerts) run on this same thread (:meth:`AlertObserver.
run_inline`) rather than on a second one that woke every step too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from charllm_nemo.integrations._common import LoggersObserver
from charllm_nemo.steps.report import apply_rank_figures

log = logging.getLogger(__name__)

MAX_QUEUED = 4096
"""Reports waiting for the logging thread beyond which a report is dropped (and counted): a
logger stuck for that many steps must not grow the training process's memory without bound."""

BATCH = 8
"""Reports that wait before the training thread wakes the observer thread."""
MAX_DELAY_S = 0.5
"""... or seconds since it last woke it, whichever comes first: with slow steps a report still
reaches steps.jsonl and the loggers within about a step plus this (a rank killed outright,
SIGKILL, loses from steps.jsonl the reports still waiting: at most BATCH steps or this long;
their windows and samples are in the store)."""

_STOP = object()
_ROWS = object()  # (_ROWS, report, rows): a report whose rank figures are put in on the thread
_RANK_INFO = "rank_info"


def thread_safe_logger(logger: Any) -> bool:
    """Whether ``logger.log_metrics`` may be called from a second thread while the training
    thread uses the logger (module doc): Lightning's TensorBoardLogger writing through torch's
    SummaryWriter."""
    try:
        from lightning.fabric.loggers.tensorboard import TensorBoardLogger as FabricTB
        from lightning.pytorch.loggers import TensorBoardLogger
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return False
    if not isinstance(logger, (TensorBoardLogger, FabricTB)):
        return False
    try:
        return isinstance(logger.experiment, SummaryWriter)  # made here, on the training thread
    except Exception:
        return False


class ThreadedLoggersObserver(LoggersObserver):
    """A :class:`LoggersObserver` for an :class:`ObserverThread` (module doc): its ``on_step``
    runs on that thread and logs to the thread-safe loggers; the others get the scalars from the
    training thread at :meth:`flush` and at close. ``loggers``: the trainer's loggers (rank 0's);
    ``prefix``: as LoggersObserver's. Alerts (``log_alert``) are logged with the next report,
    and at close."""

    def __init__(self, loggers: list[Any], prefix: str = "charllm/", every: int = 1) -> None:
        super().__init__(self._deliver, prefix, every)
        safe = [thread_safe_logger(lg) for lg in loggers]
        self.direct = [lg for lg, ok in zip(loggers, safe, strict=True) if ok]
        """Loggers the thread logs to itself."""
        self.handed_over = [lg for lg, ok in zip(loggers, safe, strict=True) if not ok]
        """Loggers the training thread logs the ready scalars to at :meth:`flush`."""
        self._ready: deque[tuple[dict[str, float], int]] = deque()

    def flush(self) -> None:
        """On the training thread: the ready scalars to the loggers that are not thread-safe."""
        while self._ready:
            metrics, step = self._ready.popleft()
            for logger in self.handed_over:
                logger.log_metrics(metrics, step=step)

    def close(self, status: str) -> None:
        """On the training thread, after the observer thread ended."""
        self._log_last()
        self._log_alerts()  # raised since the last report
        self.flush()

    def _deliver(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.direct:
            logger.log_metrics(metrics, step=step)
        if self.handed_over:
            self._ready.append((metrics, step))


class ObserverThread:
    """Observers run on a thread of their own, in order; ``on_step`` is a deque append (and, once
    every :data:`BATCH` reports or :data:`MAX_DELAY_S`, an event set: module doc).
    ``on_rank_info`` is passed on, in order, to the observers that take it. ``close(status)``
    wakes the thread, waits for the queued reports (up to 30 s), then closes each observer on
    the calling thread. Beyond ``max_queued`` waiting reports (an observer stuck), a report is
    dropped and counted; an observer that raises is logged once and counted, the others go on.
    ``batch`` / ``max_delay_s``: None takes the module's values (read when made)."""

    def __init__(
        self,
        observers: list[Any],
        max_queued: int = MAX_QUEUED,
        batch: int | None = None,
        max_delay_s: float | None = None,
    ) -> None:
        self.observers = list(observers)
        self.max_queued = max_queued
        self.batch = max(1, int(BATCH if batch is None else batch))
        self.max_delay_s = float(MAX_DELAY_S if max_delay_s is None else max_delay_s)
        self.dropped = 0
        self.failed = 0
        self.wakes = 0  # times the training thread woke the thread (for the benchmark)
        self._pending: deque[Any] = deque()  # append / popleft: safe across two threads
        self._wake = threading.Event()
        self._last_wake = time.monotonic()
        self._since = 0
        self._thread = threading.Thread(target=self._run, name="charllm-observers", daemon=True)
        self._thread.start()

    def on_step(self, report: Any) -> None:
        self.on_step_rows(report, None)

    def on_step_rows(self, report: Any, rows: list[list[float]] | None) -> None:
        """``report`` with every rank's vector (``rows``) still to be put in: done on the
        thread (``apply_rank_figures``), before the observers get it (StepTelemetry hands
        them over so when this is its only observer); None: the report is complete."""
        if len(self._pending) >= self.max_queued:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("charllm: step observers fell %d steps behind; reports dropped", self.max_queued)
            return
        self._pending.append(report if rows is None else (_ROWS, report, rows))
        self._since += 1  # reports since the last signal (not the deque's length: the thread may lag)
        if self._since >= self.batch or time.monotonic() - self._last_wake >= self.max_delay_s:
            self._signal()

    def on_rank_info(self, infos: list[dict[str, Any]]) -> None:
        self._pending.append((_RANK_INFO, infos))
        self._signal()

    def _signal(self) -> None:
        self._since = 0
        self._last_wake = time.monotonic()
        self.wakes += 1
        self._wake.set()

    def close(self, status: str) -> None:
        self._pending.append(_STOP)
        self._wake.set()
        self._thread.join(timeout=30.0)
        if self._thread.is_alive():
            log.warning("charllm: step observers did not take the last reports within 30 s; left open")
            return
        for obs in self.observers:
            try:
                obs.close(status)
            except Exception:
                log.exception("charllm: observer %s failed to close", type(obs).__name__)
        if self.dropped or self.failed:
            log.warning(
                "charllm: %d step report(s) dropped, %d failed in an observer", self.dropped, self.failed
            )

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()  # before draining: a report appended from now on wakes it again
            while self._pending:
                item = self._pending.popleft()
                if item is _STOP:
                    return
                self._dispatch(item)

    def _dispatch(self, item: Any) -> None:
        if isinstance(item, tuple) and len(item) == 3 and item[0] is _ROWS:
            _, item, rows = item
            try:
                apply_rank_figures(item, rows)
            except Exception:
                self.failed += 1
                log.exception("charllm: a step report's figures could not be put in; it is dropped")
                return
        rank_info = isinstance(item, tuple) and len(item) == 2 and item[0] == _RANK_INFO
        for obs in self.observers:
            try:
                if rank_info:
                    fn = getattr(obs, "on_rank_info", None)
                    if fn is not None:
                        fn(item[1])
                else:
                    obs.on_step(item)
            except Exception:
                self.failed += 1
                if self.failed == 1:
                    log.exception("charllm: observer %s failed on a step report", type(obs).__name__)
