"""What rank 0 does with each step's report: observers.

An observer has ``on_step(report)`` (a :class:`~charllm_nemo.steps.report.StepReport`, once its
telemetry figures are due or given up) and ``close(status)`` (training ended: ``complete``,
``interrupted``, ``terminated``, ``failed``). They run on the training thread of rank 0, so
they must be cheap: the W&B observer only queues (sinks/base.py ``AsyncSink``), the steps file
hands a line to the kernel. :class:`~charllm_nemo.steps.telemetry.StepTelemetry` catches and
logs (once per observer) what an observer raises: a broken observer never stops training.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from charllm_nemo.steps.report import StepReport
from charllm_nemo.telemetry.figures import STEP_FIELDS

log = logging.getLogger("charllm_nemo.steps")

STEPS_FILE = "steps.jsonl"
"""Rank 0's per-step figures, one JSON object per line, written as each step is reported."""


@runtime_checkable
class Observer(Protocol):
    """Receives rank 0's step reports."""

    def on_step(self, report: StepReport) -> None: ...

    def close(self, status: str) -> None: ...


class FunctionObserver:
    """``fn(report)`` for every step; ``on_close(status)`` at the end when given."""

    def __init__(self, fn: Callable[[StepReport], Any], on_close: Callable[[str], Any] | None = None) -> None:
        self.fn = fn
        self.on_close = on_close

    def on_step(self, report: StepReport) -> None:
        self.fn(report)

    def close(self, status: str) -> None:
        if self.on_close is not None:
            self.on_close(status)


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""A write refused because the disk, the user's quota, or the file-size limit (ulimit -f) is full."""


class StepsFile:
    """Rank 0's per-step figures on disk as the run goes (``steps.jsonl``): one line per
    reported step, handed to the kernel at once (one ``write`` a line, no buffer), so a run
    that is killed keeps every step reported before (docs/store.md). The file is truncated when
    opened: a run directory holds one run. A write that fails (a full disk) never stops
    training: the part of the line that got out is cut off again (the file ends with a whole
    line, always), one error line says so, the file is given up, and :attr:`disk_full` is set
    when the disk (or quota) was the reason."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd: int | None = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )  # appended to line by line, so not through telemetry.write's rename; a link is refused
        self._size = 0  # bytes of whole lines written: where a failed line is cut back to
        self.lines = 0  # lines written
        self.disk_full = False

    def write(self, row: dict[str, Any]) -> None:
        if self._fd is None:
            return
        data = (json.dumps(row, default=str) + "\n").encode()
        done = 0
        try:
            while done < len(data):  # a short write (the last free blocks) is followed by ENOSPC
                done += os.write(self._fd, data[done:])
        except OSError as exc:
            self.disk_full = True  # any refused write (DISK_FULL_ERRNOS, EIO, ...): the run's status says so
            if done:
                with contextlib.suppress(OSError):  # not a regular file (/dev/full): nothing to cut
                    os.ftruncate(self._fd, self._size)
            log.error(
                "cannot write %s (%s): per-step lines stop here, the %d before are whole; summary.json "
                "gets the last 1,000 if it can be written",
                self.path,
                exc.strerror or exc,
                self.lines,
            )
            self.close()
            return
        self._size += len(data)
        self.lines += 1

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class StepsFileObserver:
    """Each report as one line of ``path`` (``StepReport.to_dict()``; docs/store.md)."""

    def __init__(self, path: str | Path) -> None:
        self.file = StepsFile(Path(path))

    def on_step(self, report: StepReport) -> None:
        self.file.write(report.to_dict())

    def close(self, status: str) -> None:
        self.file.close()


def format_report(r: StepReport, total_steps: int | None, world_size: int, *, synthetic: bool = False) -> str:
    """Rank 0's console line for one step: the step, then the part of every field of
    charllm_nemo.telemetry.figures ``STEP_FIELDS`` that has one, in that order (MFU says how it
    counts attention: ``full attn`` / ``causal attn``, telemetry.attention_flops);
    ``synthetic``: power is modelled, and the line says so.

    Steps are numbered from 0, as in steps.jsonl, windows, alerts and ``charllm inspect``; the
    ``(n/total)`` after the number counts the steps done, so the last of 5 reads ``step 4 (5/5)``."""
    row = r.to_dict()
    row["world_size"] = world_size
    row["synthetic"] = synthetic
    parts = [f"step {r.step}" + ("" if total_steps is None else f" ({r.step + 1}/{total_steps})")]
    parts.extend(p for f in STEP_FIELDS if f.console is not None and (p := f.console(row)) is not None)
    return " | ".join(parts)


class Progress:
    """A progress bar on stderr: tqdm when installed, else a plain line redrawn with ``\\r`` on
    a terminal; silent (the per-step lines suffice) when not a TTY."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self.t0 = time.monotonic()
        self.done = 0
        self._bar: Any = None
        self._tty = enabled and total is not None and sys.stderr.isatty()
        if enabled and total is not None:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc="train", unit="step", file=sys.stderr, leave=True)

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            if self._tty:
                sys.stderr.write("\r\033[K")
            print(line, flush=True)
            self._draw()

    def update(self, n: int = 1) -> None:
        if not self.enabled:
            return
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        else:
            self._draw()

    def _draw(self) -> None:
        if not self._tty or self.total is None:
            return
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        el = time.monotonic() - self.t0
        eta = el / self.done * (self.total - self.done) if self.done else float("nan")
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} eta {eta:.0f}s"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._tty:
            sys.stderr.write("\n")


class ConsoleObserver:
    """One line per step on stdout (:func:`format_report`) and, on a terminal, a progress bar
    over ``total_steps`` (None: no bar). ``world_size``: the ranks a complete step's energy
    covers (fewer are shown as ``(n/world ranks)``)."""

    def __init__(
        self,
        total_steps: int | None = None,
        world_size: int = 1,
        *,
        progress: bool = True,
        synthetic: bool = False,
    ) -> None:
        self.total_steps = total_steps
        self.world_size = world_size
        self.synthetic = synthetic  # a modelled device: its power is marked "(synthetic)"
        self.progress = Progress(total_steps if progress else None, enabled=True)

    def on_step(self, report: StepReport) -> None:
        self.progress.write(
            format_report(report, self.total_steps, self.world_size, synthetic=self.synthetic)
        )
        self.progress.update()

    def write(self, line: str) -> None:
        """Another line for the console, between the step lines (the bar stays below)."""
        self.progress.write(line)

    def close(self, status: str) -> None:
        self.progress.close()


class FigureSink(Protocol):
    """What :class:`WandbObserver` needs of its sink (sinks/base.py ``AsyncSink``)."""

    def log_figures(
        self, step: int, summary: dict[str, Any] | None, gathered: list[list[float]] | None
    ) -> None: ...

    def finish(self, run_dir: Path | None = None) -> None: ...


class WandbObserver:
    """Each report to a W&B sink (charllm_nemo.sinks: ``build_sink`` gives an ``AsyncSink`` over
    ``WandbSink``; the keys are built on the sink's thread): ``log_figures(step, report row,
    every rank's figures)``. ``finish``: whether :meth:`close` finishes the sink (uploading
    ``run_dir`` as an artifact, bounded by its finish timeout); a caller that must finish it
    later (after the telemetry session closed its files) passes False and finishes it itself."""

    def __init__(self, sink: FigureSink, *, run_dir: str | Path | None = None, finish: bool = True) -> None:
        self.sink = sink
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.finish = finish

    def on_step(self, report: StepReport) -> None:
        self.sink.log_figures(report.step, report.to_dict(), report.figure_rows())

    def close(self, status: str) -> None:
        if self.finish:
            self.sink.finish(self.run_dir)
