"""Progress lines for the long commands (a SLURM sweep's wait, ``charllm report``, ``charllm
analyze``, Spark): what is being done, how far, and how long so far, on stderr.

A command that ends within ``every_s`` seconds prints nothing (no noise on short runs); after
that, a line when the stage changes and, while one stage lasts, one every ``every_s`` seconds
with its latest count, from a daemon thread (a single long Spark job or SLURM wait gives no
other chance to speak). ``CHARLLM_PROGRESS_EVERY_S`` sets ``every_s`` (default 5; 0: every stage
and count at once; ``off``: nothing)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

DEFAULT_EVERY_S = 5.0


def every_s_from_env() -> float | None:
    """``CHARLLM_PROGRESS_EVERY_S`` as seconds (None: ``off``); the default when unset or bad."""
    raw = os.environ.get("CHARLLM_PROGRESS_EVERY_S", "").strip().lower()
    if raw in ("off", "none", "no"):
        return None
    try:
        value = float(raw) if raw else DEFAULT_EVERY_S
    except ValueError:
        return DEFAULT_EVERY_S
    return value if value >= 0 else DEFAULT_EVERY_S


def elapsed_text(seconds: float) -> str:
    """``12 s``, ``3 min 05 s``, ``1 h 02 min``."""
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Progress:
    """``with Progress("charllm report") as p: p.stage("reading runs", total=12); p.update(3)``.

    ``every_s``: None = from the environment; ``stream``: default stderr; ``clock``: seconds."""

    def __init__(
        self,
        command: str,
        *,
        every_s: float | None = -1.0,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.command = command
        self.every_s = every_s_from_env() if every_s is not None and every_s < 0 else every_s
        self.stream = stream
        self.clock = clock
        self.t0 = clock()
        self._what = ""
        self._done: int | None = None
        self._total: int | None = None
        self._detail = ""
        self._unit = ""
        self._last_line = -1e18
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the command says ---------------------------------------------------------------

    def stage(self, what: str, total: int | None = None, unit: str = "") -> None:
        """A new stage: ``what`` (``total`` items of ``unit`` to go through, when known)."""
        with self._lock:
            self._what, self._done, self._total, self._detail = what, (0 if total else None), total, ""
            self._unit = unit
            self._emit(force=True)

    def update(self, done: int, detail: str = "") -> None:
        """``done`` items of the stage so far (``detail``: e.g. job states)."""
        with self._lock:
            self._done, self._detail = done, detail
            self._emit(force=False)

    # -- lines -----------------------------------------------------------------------------------

    def line(self) -> str:
        """The current line (without printing it)."""
        how_far = ""
        if self._done is not None and self._total:
            unit = f" {self._unit}" if self._unit else ""
            how_far = f": {self._done}/{self._total}{unit}"
        detail = f" ({self._detail})" if self._detail else ""
        return f"{self.command}: {self._what}{how_far}{detail}; {elapsed_text(self.clock() - self.t0)} so far"

    def _emit(self, force: bool) -> None:
        if self.every_s is None or not self._what:
            return
        now = self.clock()
        if now - self.t0 < self.every_s:
            return  # a short command stays quiet
        if not force and now - self._last_line < self.every_s:
            return
        stream = self.stream if self.stream is not None else sys.stderr
        try:
            print(self.line(), file=stream, flush=True)
        except (OSError, ValueError):
            return  # a closed or full stderr must not end the command
        self._last_line = now

    def _beat(self) -> None:
        assert self.every_s is not None
        period = max(self.every_s, 0.5)
        while not self._stop.wait(period):
            with self._lock:
                self._emit(force=False)

    # -- context -----------------------------------------------------------------------------------

    def __enter__(self) -> Progress:
        if self.every_s is not None and self.every_s > 0:
            self._thread = threading.Thread(target=self._beat, name="charllm-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
