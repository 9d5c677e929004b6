"""One rank of a locally launched run: ``python -m charllm_nemo.train.worker <config.yaml|json>``.

The launcher (train/launch.py) has set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT. This reads the resolved config and calls ``charllm_nemo.train.loop.run_rank``.

SIGTERM becomes ``SystemExit(143)`` in the main thread, so ``finally`` blocks and context
managers (the telemetry session's flush) run before the process exits.

``CHARLLM_WORKER_TARGET=module:function`` replaces ``run_rank`` with another callable taking
the TrainConfig: the launcher's tests use it to run without torch.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

from charllm_nemo.errors import CharllmError, ConfigError
from charllm_nemo.train.config import TrainConfig
from charllm_nemo.train.config_io import load_train_config

TARGET_ENV = "CHARLLM_WORKER_TARGET"
LOG_LEVEL_ENV = "CHARLLM_LOG_LEVEL"
"""A logging level name (``INFO``, ``DEBUG``) for every rank; ``charllm -v train`` sets INFO."""


def configure_logging() -> None:
    """The package's loggers at ``$CHARLLM_LOG_LEVEL`` (others, megatron-core's among them, at
    WARNING), to stderr, when it names a level; else logging stays as it is (warnings and errors
    still reach stderr)."""
    level = getattr(logging, os.environ.get(LOG_LEVEL_ENV, "").upper(), None)
    if isinstance(level, int):
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("charllm_nemo").setLevel(level)


def _target() -> Callable[[TrainConfig], Any]:
    spec = os.environ.get(TARGET_ENV)
    if not spec:
        from charllm_nemo.train.loop import run_rank

        return run_rank
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"{TARGET_ENV}={spec!r} must be 'module:function'")
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise ConfigError(f"{TARGET_ENV}={spec!r} is not callable")
    return fn  # type: ignore[no-any-return]


class _Terminate:
    """The SIGTERM handler of a rank: the first SIGTERM unwinds the main thread (its ``finally``
    blocks run: the telemetry close, ``summary.json``); later ones are ignored, because the rank is
    already ending. A repeat is common: PR_SET_PDEATHSIG sends one SIGTERM per launcher thread
    that exits, so ``kill -9`` of the local launcher delivers it twice, and a repeat that killed
    the rank at once would land in the middle of its close (a manifest left ``running``, no
    summary). What ends a rank that does not finish its close is the sender's SIGKILL: the local
    launcher's after its grace period, SLURM's after KillWait."""

    def __init__(self) -> None:
        self.received = 0

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        self.received += 1
        if self.received == 1:
            raise SystemExit(128 + signum)  # unwind, instead of dying where we stand


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Within it, SIGTERM (SLURM's at the time limit, the local launcher's to a failed run's
    other ranks, the parent-death signal when the launcher itself is killed) becomes
    ``SystemExit(143)`` in the main thread: the rank's ``finally`` blocks run (its telemetry
    flush, ``summary.json``); later SIGTERMs are ignored (:class:`_Terminate`). The handler before
    it comes back after. Outside the main thread it does nothing (Python allows signal handlers
    only there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _Terminate())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(config_path: str) -> int:
    """Load the config and run this rank; the callable's int result (if any) is the exit code."""
    cfg = load_train_config(config_path)
    fn = _target()
    result = fn(cfg)
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of a spawned rank; returns its exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m charllm_nemo.train.worker <config.yaml|config.json>", file=sys.stderr)
        return 2
    configure_logging()
    try:
        with sigterm_unwinds():
            code = run(args[0])
        from charllm_nemo.sinks.base import exit_now_if_abandoned

        exit_now_if_abandoned(code)  # a hung W&B: its exit hooks do not hold the rank
        return code
    except CharllmError as exc:  # a config value, or this machine (no driver, a run directory)
        rank = os.environ.get("RANK", "?")
        print(f"rank {rank}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
