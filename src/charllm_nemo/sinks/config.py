"""``logger.*``: which sink a training run streams its per-step metrics to (conf/logger/*.yaml).

    charllm train model=tiny_gpt logger=wandb            # W&B (offline without an API key)
    charllm train model=tiny_gpt logger=console          # rank 0's per-step line (the default)
    charllm train model=tiny_gpt logger=none             # no per-step line: the run directory only

:func:`build_sink` gives rank 0 its sink (every other rank None), wrapped in an
:class:`~charllm_nemo.sinks.base.AsyncSink` so that nothing it does runs on the training
thread; :func:`validate_logger_config` checks the values before any process starts.
"""

from __future__ import annotations

import importlib.util
import math
import os
import socket
from collections.abc import Mapping

from charllm_nemo.errors import ConfigError
from charllm_nemo.sinks.base import AsyncSink
from charllm_nemo.sinks.keys import StepKeys
from charllm_nemo.sinks.logger_config import LOGGER_MODES, LOGGER_NAMES, LoggerConfig

__all__ = ["LOGGER_MODES", "LOGGER_NAMES", "LoggerConfig", "build_sink", "validate_logger_config"]


def validate_logger_config(cfg: LoggerConfig) -> None:
    """Raise ConfigError naming the first ``logger.*`` field that is out of range."""
    if cfg.name not in LOGGER_NAMES:
        raise ConfigError(f"logger.name={cfg.name!r} is not a logger; use one of {', '.join(LOGGER_NAMES)}")
    if cfg.mode is not None and cfg.mode not in LOGGER_MODES:
        raise ConfigError(
            f"logger.mode={cfg.mode!r} is not a W&B mode; use null (auto) or one of {', '.join(LOGGER_MODES)}"
        )
    if cfg.rank_figures is not None:
        from charllm_nemo.sinks.keys import STEP_FIGURE_KEYS

        unknown = [f for f in cfg.rank_figures if f not in STEP_FIGURE_KEYS]
        if unknown:
            raise ConfigError(
                f"logger.rank_figures has unknown figure(s) {unknown}; use null (all) or names from "
                f"{', '.join(STEP_FIGURE_KEYS)}"
            )
    if isinstance(cfg.rank_every, bool) or not isinstance(cfg.rank_every, int) or cfg.rank_every < 1:
        raise ConfigError(f"logger.rank_every={cfg.rank_every!r} must be an integer >= 1")
    if isinstance(cfg.queue_size, bool) or not isinstance(cfg.queue_size, int) or cfg.queue_size < 1:
        raise ConfigError(f"logger.queue_size={cfg.queue_size!r} must be an integer >= 1 (e.g. 1024)")
    # nan fails every comparison and inf passes "> 0": both are refused, each by name (an
    # infinite finish timeout is a run that never ends when W&B is unreachable).
    if not (math.isfinite(cfg.finish_timeout_s) and cfg.finish_timeout_s > 0):
        raise ConfigError(
            f"logger.finish_timeout_s={cfg.finish_timeout_s!r} must be finite seconds > 0, e.g. 60"
        )
    if not (math.isfinite(cfg.artifact_max_mb) and cfg.artifact_max_mb >= 0):
        raise ConfigError(
            f"logger.artifact_max_mb={cfg.artifact_max_mb!r} must be finite and >= 0 (0 = never upload), "
            "e.g. 256"
        )
    if (
        isinstance(cfg.table_max_rows, bool)
        or not isinstance(cfg.table_max_rows, int)
        or cfg.table_max_rows < 0
    ):
        raise ConfigError(f"logger.table_max_rows={cfg.table_max_rows!r} must be an integer >= 0")
    if not isinstance(cfg.settings, Mapping):
        raise ConfigError(f"logger.settings must be a mapping of wandb.Settings fields, got {cfg.settings!r}")
    if cfg.name == "wandb" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "logger.name='wandb' needs the wandb package, which is not installed: "
            "pip install 'charllm-nemo[wandb]' (or use logger=console / logger=none)"
        )


def _node_label(node_rank: int | None) -> str:
    host = socket.gethostname().split(".")[0]
    return f"node{node_rank}-{host}" if node_rank is not None else host


def build_sink(
    cfg: LoggerConfig,
    rank: int,
    *,
    run_dir: str | os.PathLike[str] | None = None,
    local_rank: int | None = None,
    node_rank: int | None = None,
    env: Mapping[str, str] | None = None,
) -> AsyncSink | None:
    """This rank's sink, already wrapped in an :class:`AsyncSink`; None for ``logger=none``
    and for every rank but 0. ``run_dir``: the telemetry run directory (W&B writes its
    ``wandb/`` folder there unless ``logger.dir`` / ``$WANDB_DIR`` say otherwise).

    With ``logger.shared`` and an online W&B run, the first rank of each other node
    (``local_rank`` 0, ``node_rank`` > 0) also gets a (secondary) W&B writer, labelled
    ``node<k>-<host>``, which sends W&B's own system metrics and console logs of that node;
    metrics still go through rank 0 only. Raises ConfigError for a bad ``logger.*`` value.
    """
    validate_logger_config(cfg)
    if cfg.name == "none":
        return None
    primary = rank == 0
    keys = StepKeys(cfg.rank_figures, cfg.rank_every)
    if cfg.name == "console":
        # The console line is the training loop's own (train/report.py format_summary).
        return None

    from charllm_nemo.sinks.wandb import WandbSink, resolve_mode

    secondary = (
        not primary
        and cfg.shared
        and local_rank == 0
        and bool(node_rank)
        and resolve_mode(cfg.mode, env)[0] == "online"
    )
    if not (primary or secondary):
        return None
    sink = WandbSink(
        cfg,
        run_dir=run_dir,
        primary=primary,
        label=_node_label(node_rank if node_rank is not None else (0 if primary else None))
        if cfg.shared
        else None,
        env=env,
    )
    return AsyncSink(
        sink,
        queue_size=cfg.queue_size,
        finish_timeout_s=cfg.finish_timeout_s,
        name="wandb" if primary else "wandb-secondary",
        step_keys=keys,
    )
