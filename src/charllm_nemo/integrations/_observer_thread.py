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
(docs/integrations.md, "Overhead").
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Any

from charllm_nemo.integrations._common import LoggersObserver

log = logging.getLogger(__name__)

MAX_QUEUED = 4096
"""Reports waiting for the logging thread beyond which a report is dropped (and counted): a
logger stuck for that many steps must not grow the training process's memory without bound."""

_STOP = object()


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

    def __init__(self, loggers: list[Any], prefix: str = "charllm/") -> None:
        super().__init__(self._deliver, prefix)
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
        self._log_alerts()  # raised since the last report
        self.flush()

    def _deliver(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.direct:
            logger.log_metrics(metrics, step=step)
        if self.handed_over:
            self._ready.append((metrics, step))


class ObserverThread:
    """Observers run on a thread of their own, in order; ``on_step`` is one queue put.
    ``close(status)`` waits for the queued reports (up to 30 s), then closes each observer on
    the calling thread. Beyond ``max_queued`` waiting reports (an observer stuck), a report is
    dropped and counted; an observer that raises is logged once and counted, the others go on."""

    def __init__(self, observers: list[Any], max_queued: int = MAX_QUEUED) -> None:
        self.observers = list(observers)
        self.max_queued = max_queued
        self.dropped = 0
        self.failed = 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="charllm-observers", daemon=True)
        self._thread.start()

    def on_step(self, report: Any) -> None:
        if self._queue.qsize() >= self.max_queued:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("charllm: step observers fell %d steps behind; reports dropped", self.max_queued)
            return
        self._queue.put(report)

    def close(self, status: str) -> None:
        self._queue.put(_STOP)
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
            report = self._queue.get()
            if report is _STOP:
                return
            for obs in self.observers:
                try:
                    obs.on_step(report)
                except Exception:
                    self.failed += 1
                    if self.failed == 1:
                        log.exception("charllm: observer %s failed on a step report", type(obs).__name__)
