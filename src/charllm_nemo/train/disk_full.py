"""A full disk under a training run: noticed once, said once, and the run's end says so.

Telemetry's store (``TelemetrySession.disk_full``: its segments or manifest hit ENOSPC /
EDQUOT / EFBIG: a ``ulimit -f`` file-size limit is a full disk for that file) and rank 0's
``steps.jsonl`` (:class:`~charllm_nemo.train.report.StepsFile`) each stop writing on their own
when the disk fills. :class:`DiskWatch` asks them after every
reported step: the first time either says so, one line names the run directory and what
happens next. With ``telemetry.required=false`` (the default) training goes on and the run
ends with status ``disk_full``; with ``telemetry.required=true`` the rank stops at once
(:class:`TelemetryDiskFull`, status ``disk_full``, exit code 2). ``summary.json`` is written
with :func:`write_summary`, which never leaves a temporary behind and, when the whole
summary does not fit, writes one without its per-step rows (``steps.jsonl`` has those).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

from charllm_nemo.errors import CharllmError
from charllm_nemo.telemetry.write import make_dir, write_bytes

log = logging.getLogger("charllm_nemo.train")

DISK_FULL = "disk_full"
"""The status word (manifest, summary.json) of a run whose disk filled up under it."""


RESERVE_NAME = ".summary.json.reserve"
RESERVE_BYTES = 64 * 1024
"""Room rank 0 keeps in the run directory from its start (a file of zeros, removed just before
``summary.json`` is written), so that a disk that filled up mid-run still takes the summary
(without per-step rows: a few KiB). Left behind only when rank 0 is killed outright."""


class TelemetryDiskFull(CharllmError):
    """The disk under the run directory is full and ``telemetry.required=true``: the rank stops."""


class DiskWatch:
    """Asks telemetry (``session.disk_full``, where the session has it) and ``steps.jsonl``
    whether the disk filled up; :meth:`check` after each reported step (a bool read each).
    ``full`` once either did."""

    def __init__(self, out_dir: str | os.PathLike[str], *, required: bool, rank: int) -> None:
        self.out_dir = Path(out_dir)
        self.required = required
        self.rank = rank
        self.full = False
        self._reserve: Path | None = None
        if rank == 0:  # the rank that writes summary.json keeps room for it
            self._reserve = self.out_dir / RESERVE_NAME
            try:
                make_dir(self.out_dir)
                write_bytes(self._reserve, bytes(RESERVE_BYTES))  # zeros: allocated, not sparse
            except OSError:
                self.release()

    def release(self) -> None:
        """Give back the room kept for summary.json (just before writing it). Idempotent."""
        reserve, self._reserve = self._reserve, None
        if reserve is not None:
            with contextlib.suppress(OSError):
                reserve.unlink()

    def check(self, session: Any, steps_file: Any, step: int) -> None:
        """Raise :class:`TelemetryDiskFull` (``required``) or say once that telemetry stopped."""
        if self.full:
            return
        where = []
        if session is not None and getattr(session, "disk_full", False):
            where.append("telemetry store")
        if steps_file is not None and getattr(steps_file, "disk_full", False):
            where.append("steps.jsonl")
        if not where:
            return
        self.full = True
        what = " and ".join(where)
        if self.required:
            raise TelemetryDiskFull(
                f"the disk under {self.out_dir} is full ({what}, at step {step}); telemetry.required=true, "
                "so training stops here (status disk_full). Free space or give telemetry.out_dir on "
                "another disk; telemetry.required=false trains on without telemetry"
            )
        print(
            f"charllm: rank {self.rank}: the disk under {self.out_dir} is full ({what}, at step {step}): "
            "telemetry writing stopped, what was written stays readable; training goes on "
            "(telemetry.required=false) and the run will end with status disk_full",
            file=sys.stderr,
            flush=True,
        )
