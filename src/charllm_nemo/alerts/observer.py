"""Rank 0's alert observer: detects (charllm_nemo.alerts.detect) and delivers each alert to the
console, ``alerts.jsonl``, W&B (through the run's AsyncSink: a queue put on this thread) and
user functions. Install it with :func:`alert_observer`, which returns None for ``enabled:
false`` (off costs nothing: no observer, no phase sums, no exchange)."""

from __future__ import annotations

import importlib
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from charllm_nemo.alerts.config import AlertsConfig, alerts_problems
from charllm_nemo.alerts.detect import AlertDetector
from charllm_nemo.errors import ConfigError
from charllm_nemo.steps.observers import StepsFile

log = logging.getLogger("charllm_nemo.alerts")

ALERTS_FILE = "alerts.jsonl"
"""Rank 0's alerts, one JSON object per line, in the run directory (docs/store.md, docs/alerts.md)."""

AlertHook = Callable[[dict[str, Any]], object]


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
    stderr). :attr:`alerts` keeps every alert raised."""

    def __init__(
        self,
        cfg: AlertsConfig,
        *,
        run_dir: str | Path | None = None,
        sink: Any = None,
        hooks: Sequence[AlertHook] = (),
        stream: TextIO | None = None,
    ) -> None:
        self.cfg = cfg
        self.detector = AlertDetector(cfg)
        self.path = None if run_dir is None or not cfg.file else Path(run_dir) / ALERTS_FILE
        self._file: StepsFile | None = None
        self.sink = sink if cfg.wandb else None
        self.hooks: list[AlertHook] = ([load_hook(cfg.hook)] if cfg.hook else []) + list(hooks)
        self.stream = stream
        self.alerts: list[dict[str, Any]] = []

    def on_rank_info(self, infos: list[dict[str, Any]]) -> None:
        self.detector.set_rank_info(infos)

    def on_step(self, report: Any) -> None:
        for alert in self.detector.check(report):
            self._deliver(alert)

    def _deliver(self, alert: dict[str, Any]) -> None:
        alert["wall_ns"] = time.time_ns()
        self.alerts.append(alert)
        if self.cfg.console:
            print(
                f"charllm ALERT [{alert['kind']}] {alert['message']}",
                file=self.stream or sys.stderr,
                flush=True,
            )
        if self.path is not None:
            if self._file is None:
                self._file = StepsFile(self.path)
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
        if self._file is not None:
            self._file.close()
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
) -> AlertObserver | None:
    """The alert observer for rank 0, or None when ``cfg`` is None or disabled (then pass
    ``phase_times=False, rank_info=False`` to StepTelemetry: alerts off cost nothing). Raises
    ConfigError listing every problem of ``cfg``."""
    if cfg is None or not cfg.enabled:
        return None
    problems = alerts_problems(cfg)
    if problems:
        raise ConfigError("; ".join(problems))
    return AlertObserver(cfg, run_dir=run_dir, sink=sink, hooks=hooks, stream=stream)
