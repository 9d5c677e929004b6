"""The ``logger`` config (:class:`LoggerConfig`): where per-step metrics go, and how. Its own
module, below the sinks that take it whole (sinks/wandb.py ``WandbSink``) and sinks/config.py,
which checks it and builds the sink from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LOGGER_NAMES: tuple[str, ...] = ("console", "wandb", "none")
LOGGER_MODES: tuple[str, ...] = ("auto", "online", "offline", "disabled")


@dataclass
class LoggerConfig:
    """Where per-step metrics go, and how.

    ``name``: ``console`` | ``wandb`` | ``none``. W&B: ``project``, ``entity`` (None = the
    key's default entity), ``run_name`` (None = ``<model>-<layout>-<optim>``), ``group`` (None
    = the sweep, from the run directory), ``tags`` (added to the recipe's: layout, model,
    optim, precision, backend), ``mode`` (None / ``auto`` = online with an API key, else
    offline; ``online`` | ``offline`` | ``disabled``), ``dir`` (where wandb/ goes; None =
    ``$WANDB_DIR``, else the run directory), ``run_id`` (None = W&B's own; shared mode derives
    one from the run directory). Keys: ``rank_figures`` the per-rank figures logged as
    ``rank/<r>/<figure>`` (None = all of charllm_nemo.sinks.keys.STEP_FIGURE_KEYS; a list keeps
    the key count down on large jobs), ``rank_every`` per-rank keys every N steps (aggregates
    every step). Queue: ``queue_size`` items (a full queue drops new ones and
    counts them), ``finish_timeout_s`` (the most the end of training waits for the other ranks
    to close their telemetry, and then for the sink).
    End of run: ``log_windows_table`` (at most ``table_max_rows`` rows), ``upload_artifact``
    (skipped when the run directory is over ``artifact_max_mb`` MiB). ``shared``: W&B shared
    mode, one writer per node (online only; see docs/wandb.md). ``settings``: extra
    ``wandb.Settings`` fields, e.g. ``{console: "off", x_disable_stats: true}``.
    """

    name: str = "none"
    project: str = "charllm-nemo"
    entity: str | None = None
    run_name: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    mode: str | None = None
    dir: str | None = None
    run_id: str | None = None
    rank_figures: list[str] | None = None
    rank_every: int = 1
    queue_size: int = 1024
    finish_timeout_s: float = 60.0
    upload_artifact: bool = True
    artifact_max_mb: float = 256.0
    log_windows_table: bool = True
    table_max_rows: int = 10_000
    shared: bool = False
    settings: dict[str, Any] = field(default_factory=dict)
