"""Rank 0's alert observer: detects (charllm_nemo.alerts.detect) and delivers each alert to the
console, ``alerts.jsonl``, W&B (through the run's AsyncSink) and user functions, all on a
thread of its own: the training thread only puts the step's report in a queue. Install it with
:func:`alert_observer`, which returns None for ``enabled: false`` (off costs nothing: no
observer, no phase sums, no exchange)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from charllm_nemo.alerts.config import AlertsConfig, alerts_problems
from charllm_nemo.alerts.detect import AlertDetector
from charllm_nemo.alerts.stages import StageLayout
from charllm_nemo.errors import ConfigError
from charllm_nemo.steps.observers import StepsFile

log = logging.getLogger("charllm_nemo.alerts")

ALERTS_FILE = "alerts.jsonl"
"""Rank 0's alerts, one JSON object per line, in the run directory (docs/store.md, docs/alerts.md)."""

AlertHook = Callable[[dict[str, Any]], object]

ALERTS_KEPT = 1000
"""Alerts an observer keeps in memory (the last ones): its memory does not grow with the run."""

QUEUE_STEPS = 256
"""Reports the alert thread may fall behind by before new ones are dropped (and counted)."""
CLOSE_TIMEOUT_S = 10.0
"""How long :meth:`AlertObserver.close` waits for the alert thread to finish the queued steps."""


def load_hook(spec: str) -> AlertHook:
    """``"package.module:function"`` imported; ConfigError naming ``alerts.hook`` otherwise."""
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"alerts.hook={spec!r} cannot be loaded ({exc}); give 'package.module:function'"
        ) from None
    if not callable(fn):
        raise ConfigError(f"alerts.hook={spec!r} is not callable")
    hook: AlertHook = fn
    return hook


class AlertObserver:
    """An :class:`~charllm_nemo.steps.observers.Observer` that raises alerts (docs/alerts.md).

    ``run_dir``: where ``alerts.jsonl`` goes (None or ``cfg.file`` false: no file; it is
    created at the first alert). ``sink``: the run's W&B ``AsyncSink`` (its ``log_alert`` is a
    queue put; None: no W&B). ``hooks``: functions called with each alert's dict (after
    ``cfg.hook``); one that raises is logged once and dropped. ``stream``: the console (default
    stderr). ``stages``: the run's pipeline layout (which ranks do the same work; None: no
    pipeline, or not known); ``collectives_in_phases``: as :func:`alert_observer`.
    :attr:`alerts` keeps the last :data:`ALERTS_KEPT` alerts raised (``alerts.jsonl`` has them
    all; the detector counts them: ``detector.raised``).

    Detection and delivery run on the thread ``charllm-alerts``, started at the first call: the
    detector's cost grows with the ranks (measured ~17 us a rank a step on a loaded 2-core VM:
    ~9 ms at 512 ranks, over the training thread's 0.5 ms budget), so the training thread only
    queues the report (a few us). Hooks are called on that thread. A queue
    :data:`QUEUE_STEPS` reports behind drops new ones (counted in :attr:`dropped`, logged once);
    :meth:`close` waits up to :data:`CLOSE_TIMEOUT_S` for the rest."""

    def __init__(
        self,
        cfg: AlertsConfig,
        *,
        run_dir: str | Path | None = None,
        sink: Any = None,
        hooks: Sequence[AlertHook] = (),
        stream: TextIO | None = None,
        stages: StageLayout | None = None,
        collectives_in_phases: bool = False,
    ) -> None:
        self.cfg = cfg
        self.detector = AlertDetector(cfg, stages, collectives_in_phases=collectives_in_phases)
        self.path = None if run_dir is None or not cfg.file else Path(run_dir) / ALERTS_FILE
        self._file: StepsFile | None = None
        self.sink = sink if cfg.wandb else None
        self.hooks: list[AlertHook] = ([load_hook(cfg.hook)] if cfg.hook else []) + list(hooks)
        self.stream = stream
        self.alerts: deque[dict[str, Any]] = deque(maxlen=ALERTS_KEPT)  # a run of weeks: bounded
        self.dropped = 0
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue(maxsize=QUEUE_STEPS)
        self._thread: threading.Thread | None = None

    def on_rank_info(self, infos: list[dict[str, Any]]) -> None:
        self._put(("rank_info", infos))

    def on_step(self, report: Any) -> None:
        self._put(("step", report))

    def run_inline(self) -> None:
        """Check and deliver on the calling thread from now on, with no thread of its own: for
        a caller that already calls it off the training thread (the integrations' observer
        thread, integrations/_observer_thread.py), so that one thread wakes, not two."""
        self._inline = True

    _inline = False

    def _put(self, item: tuple[str, Any]) -> None:
        """The training thread's whole part: queue the item (the report is final once given)."""
        if self._inline:
            self._handle(item)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="charllm-alerts", daemon=True)
            self._thread.start()
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning(
                    "charllm: the alert thread is %d steps behind; later steps are not checked until "
                    "it catches up (counted)",
                    QUEUE_STEPS,
                )

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            self._handle(item)

    def _handle(self, item: tuple[str, Any]) -> None:
        kind, payload = item
        try:
            if kind == "rank_info":
                self.detector.set_rank_info(payload)
            else:
                for alert in self.detector.check(payload):
                    self._deliver(alert)
        except Exception:  # alerts never stop training; the next step is checked as usual
            log.exception("charllm: alert check of a %s failed", kind)

    def _deliver(self, alert: dict[str, Any]) -> None:
        alert["wall_ns"] = time.time_ns()
        self.alerts.append(alert)
        if self.cfg.console:
            print(
                f"charllm ALERT [{alert['kind']}] {alert['message']}",
                file=self.stream or sys.stderr,
                flush=True,
            )
        if self.path is not None and self._file is None:
            try:
                self._file = StepsFile(self.path)
            except OSError as exc:  # a link planted at the name (ELOOP), a folder made read-only
                log.warning(
                    "charllm: cannot write %s (%s); alerts go on to the console, W&B and hooks, not "
                    "to that file",
                    self.path,
                    exc.strerror or exc,
                )
                self.path = None  # said once: the next alerts do not try again
        if self._file is not None:
            self._file.write(alert)
        if self.sink is not None:
            self.sink.log_alert(alert["step"], alert)
        for i, fn in enumerate(self.hooks):
            if fn is None:
                continue
            try:
                fn(dict(alert))
            except Exception:
                log.exception("charllm: alert hook %r failed; it gets no more alerts", fn)
                self.hooks[i] = None  # type: ignore[call-overload]

    def close(self, status: str) -> None:
        if self._thread is not None:
            with contextlib.suppress(queue.Full):  # behind by a whole queue: join's timeout decides
                self._queue.put(None, timeout=CLOSE_TIMEOUT_S)
            self._thread.join(CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning(
                    "charllm: the alert thread did not finish in %.0f s; its last steps are not checked",
                    CLOSE_TIMEOUT_S,
                )
        if self.dropped:
            log.warning(
                "charllm: %d step(s) were not checked for alerts (the alert thread fell behind)", self.dropped
            )
        if self._file is not None:
            self._file.close()
        if self.detector.held and self.cfg.console:
            print(
                f"charllm: {self.detector.held} straggler verdict(s) held, the evidence could not say "
                f"why a rank held its peers (last: {self.detector.held_last})",
                file=self.stream or sys.stderr,
                flush=True,
            )
        if self.detector.suppressed and self.cfg.console:
            print(
                f"charllm: {self.detector.raised} alert(s) raised, {self.detector.suppressed} held back "
                f"by the rate limit (alerts.repeat_after_steps={self.cfg.repeat_after_steps}, "
                f"max_per_step={self.cfg.max_per_step})",
                file=self.stream or sys.stderr,
                flush=True,
            )


def alert_observer(
    cfg: AlertsConfig | None,
    *,
    run_dir: str | Path | None = None,
    sink: Any = None,
    hooks: Sequence[AlertHook] = (),
    stream: TextIO | None = None,
    stages: StageLayout | None = None,
    collectives_in_phases: bool = False,
) -> AlertObserver | None:
    """The alert observer for rank 0, or None when ``cfg`` is None or disabled (then pass
    ``phase_times=False, rank_info=False`` to StepTelemetry: alerts off cost nothing).
    ``stages``: the run's :class:`StageLayout` where it has a pipeline;
    ``collectives_in_phases``: its layout has tensor, expert or context parallel collectives
    inside the forward and backward phases (docs/alerts.md, "Culprit or victim"). Raises
    ConfigError listing every problem of ``cfg``."""
    if cfg is None or not cfg.enabled:
        return None
    problems = alerts_problems(cfg)
    if problems:
        raise ConfigError("; ".join(problems))
    return AlertObserver(
        cfg,
        run_dir=run_dir,
        sink=sink,
        hooks=hooks,
        stream=stream,
        stages=stages,
        collectives_in_phases=collectives_in_phases,
    )
