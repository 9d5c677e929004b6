"""Validation rules about where and how a run runs: telemetry, launcher, data, CPU limits.

Part of :func:`charllm_nemo.train.validate.validate`; each function returns problem messages
(field, value, a valid alternative) instead of raising, so that all problems are reported at once.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

from charllm_nemo.errors import ConfigError
from charllm_nemo.train.config import TrainConfig
from charllm_nemo.train.cpu_rules import cpu_unsupported
from charllm_nemo.train.layout import choices

LAUNCHERS = ("local", "slurm", "none")
DEVICES = ("auto", "cpu", "cuda")
SEED_LIMIT = 2**32
"""``data.seed`` stays below this: numpy's ``RandomState`` (megatron-core's dataset shuffle) takes no more."""


def _one_of(problems: list[str], fieldname: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        problems.append(f"{fieldname}={value!r} is not valid; use one of {choices(allowed)}")


def _positive(problems: list[str], fieldname: str, value: float) -> None:
    if isinstance(value, bool) or not math.isfinite(value) or value <= 0:  # nan and inf too
        problems.append(f"{fieldname}={value!r} must be a positive number; e.g. {fieldname}=1")


def _collect(problems: list[str], check: Callable[[Any], object], value: Any) -> None:
    """Run one of the validators the telemetry and sinks use themselves; its ConfigError is a
    problem."""
    try:
        check(value)
    except ConfigError as exc:
        problems.append(str(exc))


MAX_DATASET_SAMPLES = 2**23
"""Most sequences a train dataset's index is built for (mcore's index arrays take ~20 bytes a
sequence, measured here: 4 M took 3.4 s and ~60 MiB more than 1 M). ``batch.train_steps=10**9`` asked for
billions and died with bad_alloc after growing to 3.2 GB. Mock data is built at most this large
and read round and round (train/data.py ``MicrobatchIterator``; its sequences are random, so a repeat is
another draw); real data (``data.path``) past it is refused at validation, naming the limit."""


def run_problems(cfg: TrainConfig, device: str) -> list[str]:
    """Telemetry (telemetry/config.py ``telemetry_problems``), launcher / device / port, and
    data-path checks."""
    from charllm_nemo.sinks.config import validate_logger_config
    from charllm_nemo.telemetry.config import telemetry_problems

    problems: list[str] = []
    la, d = cfg.launch, cfg.data
    _collect(problems, validate_logger_config, cfg.logger)
    problems.extend(telemetry_problems(cfg.telemetry))
    from charllm_nemo.alerts.config import alerts_problems

    problems.extend(alerts_problems(cfg.alerts))

    _one_of(problems, "launch.launcher", la.launcher, LAUNCHERS)
    _one_of(problems, "launch.device", la.device, DEVICES)
    _positive(problems, "launch.nproc", la.nproc)
    if la.master_port is not None and not 1 <= la.master_port <= 65535:
        problems.append(
            f"launch.master_port={la.master_port} is not a TCP port; use one in [1, 65535], e.g. 29511"
        )

    if not 0 <= d.seed < SEED_LIMIT:
        problems.append(
            f"data.seed={d.seed} must lie in [0, 2**32): megatron-core's GPT dataset seeds numpy's "
            "RandomState with it; e.g. data.seed=1234"
        )
    steps, gbs = cfg.batch.train_steps, cfg.batch.global_batch_size
    if (
        d.path is not None
        and isinstance(steps, int)
        and isinstance(gbs, int)
        and steps * gbs > MAX_DATASET_SAMPLES
    ):
        problems.append(
            f"batch.train_steps={steps} x batch.global_batch_size={gbs} = {steps * gbs} sequences of "
            f"data.path, over the {MAX_DATASET_SAMPLES} a run's dataset index is built for (~20 bytes "
            "each); use fewer steps, or mock data (data.path=null), which is read round and round"
        )
    if d.path is not None:
        missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(d.path + ext)]
        if missing:
            problems.append(
                f"data.path={d.path!r}: {' and '.join(d.path + e for e in missing)} not found; give the "
                "prefix of a Megatron indexed dataset (.bin/.idx pair) or data.path=null for mock data"
            )
    return problems


def host_memory_bytes() -> int | None:
    """This host's memory (``MemTotal``), or None where /proc/meminfo cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_problems(cfg: TrainConfig) -> list[str]:
    """What ``cfg`` asks for that a CPU run cannot do (train/cpu_rules.py: no torch imported)."""
    return cpu_unsupported(cfg)
