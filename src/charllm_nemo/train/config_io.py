"""TrainConfig <-> OmegaConf / YAML / JSON, with type errors turned into ConfigError.

Needs only omegaconf (no Hydra, no torch), so the spawned workers load their config cheaply.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from charllm_nemo.errors import ConfigError
from charllm_nemo.train.config import TrainConfig

# Top-level shorthands in conf/train.yaml that are not TrainConfig fields.
SHORTHAND_KEYS: tuple[str, ...] = ("nproc", "dry_run")
# A sweep recipe's own settings (+sweep=<name>: conf/sweep/, docs/sweeps.md): the sweeper's.
DROPPED_KEYS: tuple[str, ...] = (*SHORTHAND_KEYS, "sweep", "hydra")


def run_id(launcher: str = "local") -> str:
    """The run directory's name, decided once per run: ``CHARLLM_RUN_ID`` if set; under
    ``launcher=slurm`` ``slurm-<job>.<step>`` (every srun task computes the same; a requeued
    job, ``SLURM_RESTART_COUNT`` > 0, gets ``-restart<N>`` after it, so that it neither meets
    the killed attempt's run directory nor replaces it); under ``launcher=none`` torchrun's
    ``TORCHELASTIC_RUN_ID`` when it is a real id; else a local timestamp ``YYYYmmdd-HHMMSS``."""
    env = os.environ
    if env.get("CHARLLM_RUN_ID"):
        return env["CHARLLM_RUN_ID"]
    if launcher == "slurm" and env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
        restart = env.get("SLURM_RESTART_COUNT", "0")
        return (
            f"slurm-{env['SLURM_JOB_ID']}"
            + (f".{step}" if step else "")
            + (f"-restart{restart}" if restart not in ("", "0") else "")
        )
    if launcher == "none" and env.get("TORCHELASTIC_RUN_ID", "none") not in ("", "none"):
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}"
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def register_resolvers() -> None:
    """Register ``${charllm_run_id:<launcher>}`` and, when Hydra has not, ``${now:<fmt>}``.
    Both are cached per config object, so one config resolves each to a single value."""
    if not OmegaConf.has_resolver("charllm_run_id"):
        OmegaConf.register_new_resolver("charllm_run_id", run_id, use_cache=True)
    if not OmegaConf.has_resolver("now"):
        OmegaConf.register_new_resolver(
            "now", lambda pattern: datetime.now().strftime(pattern), use_cache=True
        )


def _config_error(exc: OmegaConfBaseException) -> ConfigError:
    key = getattr(exc, "full_key", None) or "config"
    msg = getattr(exc, "msg", None) or str(exc)
    return ConfigError(f"{key}: {msg.splitlines()[0] if msg else exc}")


def train_config_from(cfg: DictConfig | Mapping[str, Any]) -> TrainConfig:
    """Resolve interpolations, drop shorthands and the ``hydra`` node, and type-check the result
    against TrainConfig (unknown keys and wrong types raise ConfigError naming the key)."""
    register_resolvers()
    try:
        if isinstance(cfg, DictConfig):
            container = OmegaConf.to_container(cfg, resolve=True)
        else:
            container = OmegaConf.to_container(OmegaConf.create(dict(cfg)), resolve=True)
        assert isinstance(container, dict)
        for key in DROPPED_KEYS:
            container.pop(key, None)
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), container)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _config_error(exc) from None
    assert isinstance(obj, TrainConfig)
    return obj


def resolved(cfg: TrainConfig) -> TrainConfig:
    """A copy of ``cfg`` with any ``${...}`` left in its strings resolved (e.g. the default
    ``telemetry.out_dir`` of a TrainConfig built in Python)."""
    return train_config_from(OmegaConf.structured(cfg))


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Plain dict of a TrainConfig (JSON/YAML-ready)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: TrainConfig) -> str:
    """The config as YAML, keys in TrainConfig's field order."""
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)))


def save_train_config(cfg: TrainConfig, path: str | os.PathLike[str]) -> Path:
    """Write ``cfg`` to ``path`` (``.json`` as JSON, else YAML); parents are created."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(to_dict(cfg), indent=2) + "\n" if p.suffix == ".json" else to_yaml(cfg)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(p)  # atomic: a reader never sees half a file
    return p


def load_train_config(path: str | os.PathLike[str]) -> TrainConfig:
    """Read a config written by :func:`save_train_config` (YAML or JSON) back, type-checked."""
    p = Path(path)
    try:
        data = json.loads(p.read_text()) if p.suffix == ".json" else OmegaConf.load(p)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} not found") from None
    except (OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML/JSON: {exc}") from None
    if isinstance(data, DictConfig):
        return train_config_from(data)
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} does not hold a mapping")
    return train_config_from(data)
