"""Sinks: where rank 0's per-step reports go (console, Weights & Biases), off the training thread.

The public API (what a user or an integration may import from here; docs/wandb.md, docs/integrations.md):

* :class:`Sink` (the protocol), :class:`SinkReport`, :class:`AsyncSink` (base.py): a sink's
  calls run on a thread of their own, so W&B never runs on the training thread.
* :class:`LoggerConfig`, :func:`validate_logger_config`, :func:`build_sink` (config.py): the
  ``logger.*`` settings and the sink they make.
* :class:`WandbSink` (wandb.py): one W&B run per job, written by rank 0.
* :class:`StepKeys`, :data:`STEP_KEY` (keys.py): the metric keys logged per step. The vector
  that carries a rank's figures across ranks (``STEP_FIGURE_KEYS``, ``pack_step_figures``) is
  the figure table's: :mod:`charllm_nemo.telemetry` (rank_vector.py).
* :func:`windows_table_rows`, :data:`WINDOW_TABLE_COLUMNS` (windows_table.py): the end-of-run
  per-window table.

Imported lazily: ``import charllm_nemo.sinks`` imports neither wandb nor torch (wandb.py imports
wandb only when a run starts).
"""

from __future__ import annotations

from typing import Any

from charllm_nemo._exports import lazy_attribute

_WHERE = {
    "Sink": "base",
    "SinkReport": "base",
    "AsyncSink": "base",
    "LoggerConfig": "config",
    "validate_logger_config": "config",
    "build_sink": "config",
    "WandbSink": "wandb",
    "StepKeys": "keys",
    "STEP_KEY": "keys",
    "windows_table_rows": "windows_table",
    "WINDOW_TABLE_COLUMNS": "windows_table",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _WHERE, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
