"""TrainConfig <-> OmegaConf / YAML / JSON, with type errors turned into ConfigError.

Needs only omegaconf (no Hydra, no torch), so the spawned workers load their config cheaply.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from charllm_nemo.errors import ConfigError
from charllm_nemo.redact import redact_secrets
from charllm_nemo.telemetry.layout import SIZE_CAPS, UnsafeFileError, read_bounded
from charllm_nemo.telemetry.write import write_text
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


def save_train_config(cfg: TrainConfig, path: str | os.PathLike[str], *, redact: bool = True) -> Path:
    """Write ``cfg`` to ``path`` (``.json`` as JSON, else YAML); parents are created. With
    ``redact`` (the default: a file in a run directory is kept, shared and uploaded) secrets are
    replaced (:func:`charllm_nemo.redact.redact_secrets`): such a file records the run, and is not
    what ranks should run (see :func:`config_for_ranks`)."""
    p = Path(path)
    data = redact_secrets(to_dict(cfg)) if redact else to_dict(cfg)
    text = (
        json.dumps(data, indent=2) + "\n"
        if p.suffix == ".json"
        else OmegaConf.to_yaml(OmegaConf.create(data))
    )
    return write_text(p, text)  # atomic, no link followed (telemetry/write.py)


@contextlib.contextmanager
def config_for_ranks(cfg: TrainConfig, record: Path) -> Iterator[Path]:
    """Write the run's record ``record`` (``config.yaml``, secrets redacted) and yield the file
    the local launcher's ranks load. When ``cfg`` holds no secret that is ``record`` itself;
    otherwise the full config goes to a file only this user can read (mode 0600, in a private
    temporary folder outside the run directory, so neither the artifact nor another user sees
    it), removed when the block ends (a launcher killed with SIGKILL leaves it: still 0600)."""
    save_train_config(cfg, record)
    if redact_secrets(to_dict(cfg)) == to_dict(cfg):
        yield record
        return
    folder = Path(tempfile.mkdtemp(prefix="charllm-config-"))  # mode 0700
    try:
        full = folder / record.name
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(to_yaml(cfg))
        yield full
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def load_train_config(path: str | os.PathLike[str]) -> TrainConfig:
    """Read a config written by :func:`save_train_config` (YAML or JSON) back, type-checked."""
    p = Path(path)
    if not p.exists() and not p.is_symlink():
        raise ConfigError(f"config file {str(p)!r} not found")
    try:  # through the hardened reader: a link, a FIFO or a file over the cap is refused
        text = read_bounded(p, SIZE_CAPS["config"]).decode("utf-8")
        data = json.loads(text) if p.suffix == ".json" else OmegaConf.create(text)
    except UnsafeFileError as exc:
        raise ConfigError(f"config file: {exc}") from None
    except (OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML/JSON: {exc}") from None
    if isinstance(data, DictConfig):
        return train_config_from(data)
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} does not hold a mapping")
    return train_config_from(data)


CONF_ENV = "CHARLLM_CONF_DIR"
CONFIG_NAME = "train"


def find_conf_dir() -> Path:
    """Where conf/ lives: ``$CHARLLM_CONF_DIR``, the checkout's ``conf/``, or the packaged copy."""
    env = os.environ.get(CONF_ENV)
    if env:
        p = Path(env).expanduser().resolve()
        if not (p / f"{CONFIG_NAME}.yaml").is_file():
            raise ConfigError(f"{CONF_ENV}={env!r} has no {CONFIG_NAME}.yaml; point it at a conf/ directory")
        return p
    here = Path(__file__).resolve()
    checkout = here.parents[3]  # src/charllm_nemo/train/config_io.py -> repository root
    if (checkout / "pyproject.toml").is_file() and (checkout / "conf" / f"{CONFIG_NAME}.yaml").is_file():
        return checkout / "conf"
    packaged = here.parents[1] / "conf"
    if (packaged / f"{CONFIG_NAME}.yaml").is_file():
        return packaged
    raise ConfigError(
        f"cannot find the conf/ directory (looked in {checkout / 'conf'} and {packaged}); set {CONF_ENV}"
    )


def compose(
    overrides: Sequence[str] = (), *, config_name: str = CONFIG_NAME, conf_dir: Path | None = None
) -> DictConfig:
    """Compose the config as ``charllm train <overrides>`` would (no run, no Hydra job):
    for tests, notebooks and tools. The ``hydra`` node is dropped."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_resolvers()
    with initialize_config_dir(config_dir=str(conf_dir or find_conf_dir()), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    return cfg
