"""Step reports to a Lightning trainer's loggers at the cost of a queue put on the training thread.

Making ``<prefix><field>`` scalars of a report and giving them to TensorBoard costs ~0.3-0.5 ms a
step (``dataclasses.asdict``, then a protobuf ``Summary`` and ``Event`` per scalar): as much as
everything else the callback does per step. :class:`ThreadedLoggersObserver` puts the report on
a queue; a thread of its own makes the scalars and logs them:

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
    """A :class:`LoggersObserver` whose ``on_step`` is one queue put (module doc). ``loggers``:
    the trainer's loggers (rank 0's); ``prefix``: as LoggersObserver's. Alerts (``log_alert``)
    are logged by the thread with the next report, and at close."""

    def __init__(self, loggers: list[Any], prefix: str = "charllm/", max_queued: int = MAX_QUEUED) -> None:
        super().__init__(self._deliver, prefix)
        safe = [thread_safe_logger(lg) for lg in loggers]
        self.direct = [lg for lg, ok in zip(loggers, safe, strict=True) if ok]
        """Loggers the thread logs to itself."""
        self.handed_over = [lg for lg, ok in zip(loggers, safe, strict=True) if not ok]
        """Loggers the training thread logs the ready scalars to at :meth:`flush`."""
        self.max_queued = max_queued
        self.dropped = 0
        self.failed = 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ready: deque[tuple[dict[str, float], int]] = deque()
        self._thread = threading.Thread(target=self._run, name="charllm-loggers", daemon=True)
        self._thread.start()

    def on_step(self, report: Any) -> None:
        if self._queue.qsize() >= self.max_queued:
            self.dropped += 1
            if self.dropped == 1:
                log.warning(
                    "charllm: the trainer's loggers fell %d steps behind; reports dropped", self.max_queued
                )
            return
        self._queue.put(report)

    def flush(self) -> None:
        """On the training thread: the ready scalars to the loggers that are not thread-safe."""
        while self._ready:
            metrics, step = self._ready.popleft()
            for logger in self.handed_over:
                logger.log_metrics(metrics, step=step)

    def close(self, status: str) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=30.0)
        if self._thread.is_alive():
            log.warning("charllm: the trainer's loggers did not take the last reports within 30 s")
            return
        self._log_alerts()  # raised since the last report
        self.flush()
        if self.dropped or self.failed:
            log.warning(
                "charllm: %d report(s) dropped, %d failed to log, for the trainer's loggers",
                self.dropped,
                self.failed,
            )

    def _run(self) -> None:
        while True:
            report = self._queue.get()
            if report is _STOP:
                return
            try:
                LoggersObserver.on_step(self, report)  # scalars made here; -> _deliver
            except Exception:
                self.failed += 1
                if self.failed == 1:
                    log.exception("charllm: logging a step report to the trainer's loggers failed")

    def _deliver(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.direct:
            logger.log_metrics(metrics, step=step)
        if self.handed_over:
            self._ready.append((metrics, step))
