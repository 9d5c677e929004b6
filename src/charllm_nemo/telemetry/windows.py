"""Window marks: the training loop says when steps, microbatches and phases begin and end.

A window is ``(kind, name, step, microbatch, t_begin_mono_ns, t_end_mono_ns, labels)``.
``kind`` is ``step``, ``microbatch`` or ``phase``; a phase's ``name`` is ``forward``,
``backward``, ``optimizer`` or any free-form name (``pp-send``, ``grad-sync``, ...).

Marks are cheap: ``begin`` and ``end`` take a clock reading and append to Python lists; the
recorder never does I/O. The session drains finished windows to the store (``drain``).
Timestamps are CLOCK_MONOTONIC ns, the same clock the sampler stamps samples with, so the two
join on one machine whichever thread or process made them. A loop that times with CUDA events
resolves them at step end and hands explicit timestamps to :meth:`WindowRecorder.record`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.schema import WINDOW_KINDS, WINDOW_LABELS

WINDOW_COLUMNS: tuple[str, ...] = (
    "window_id",
    "parent_id",
    "kind",
    "name",
    "step",
    "microbatch",
    "t_begin_mono_ns",
    "t_end_mono_ns",
    "t_begin_wall_ns",
    "timing",
    *WINDOW_LABELS,
)


class WindowRecorder:
    """Collects window marks for one rank. Thread-safe; cheap enough to call per microbatch.

    ``labels`` (pp_stage, tp_rank, dp_rank, ep_rank, cp_rank, vpp_chunk) are set once with
    :meth:`set_labels` and copied into every window; a window may override them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next_id = 0
        self._open: dict[int, dict[str, Any]] = {}
        self._stack: list[int] = []
        self._done: list[dict[str, Any]] = []
        self._labels: dict[str, int | None] = dict.fromkeys(WINDOW_LABELS)
        self._listeners: list[Any] = []
        self.total_recorded = 0

    def set_labels(self, **labels: int | None) -> None:
        unknown = set(labels) - set(WINDOW_LABELS)
        if unknown:
            raise ConfigError(f"unknown window label(s) {sorted(unknown)}; use {', '.join(WINDOW_LABELS)}")
        self._labels.update(labels)

    def add_listener(self, fn: Any) -> None:
        """``fn(kind, name, is_begin)`` is called on every begin/end (the synthetic device uses
        this to follow the training phases). It must be cheap and must not raise."""
        self._listeners.append(fn)

    def begin(
        self,
        kind: str,
        name: str | None = None,
        *,
        step: int | None = None,
        microbatch: int | None = None,
        t_mono_ns: int | None = None,
        **labels: int | None,
    ) -> int:
        """Open a window; returns its id for :meth:`end`."""
        if kind not in WINDOW_KINDS:
            raise ConfigError(f"window kind {kind!r} is not one of {', '.join(WINDOW_KINDS)}")
        t = time.monotonic_ns() if t_mono_ns is None else t_mono_ns
        wall = time.time_ns()
        with self._lock:
            wid = self._next_id
            self._next_id += 1
            row = {
                "window_id": wid,
                "parent_id": self._stack[-1] if self._stack else None,
                "kind": kind,
                "name": name or kind,
                "step": step,
                "microbatch": microbatch,
                "t_begin_mono_ns": t,
                "t_end_mono_ns": None,
                "t_begin_wall_ns": wall,
                "timing": "host",
                **self._labels,
                **labels,
            }
            self._open[wid] = row
            self._stack.append(wid)
        for fn in self._listeners:
            fn(kind, row["name"], True)
        return wid

    def end(self, window_id: int, *, t_mono_ns: int | None = None) -> None:
        """Close a window opened by :meth:`begin`. Ending an unknown id is ignored."""
        t = time.monotonic_ns() if t_mono_ns is None else t_mono_ns
        with self._lock:
            row = self._open.pop(window_id, None)
            if row is None:
                return
            if window_id in self._stack:
                self._stack.remove(window_id)
            row["t_end_mono_ns"] = t
            self._done.append(row)
            self.total_recorded += 1
        for fn in self._listeners:
            fn(row["kind"], row["name"], False)

    @contextmanager
    def window(self, kind: str, name: str | None = None, **kw: Any) -> Iterator[int]:
        wid = self.begin(kind, name, **kw)
        try:
            yield wid
        finally:
            self.end(wid)

    def record(
        self,
        kind: str,
        name: str | None,
        t_begin_mono_ns: int,
        t_end_mono_ns: int,
        *,
        step: int | None = None,
        microbatch: int | None = None,
        timing: str = "cuda_event",
        parent_id: int | None = None,
        **labels: int | None,
    ) -> int:
        """Add a finished window with explicit timestamps (e.g. resolved from CUDA events)."""
        if kind not in WINDOW_KINDS:
            raise ConfigError(f"window kind {kind!r} is not one of {', '.join(WINDOW_KINDS)}")
        wall = time.time_ns() - (time.monotonic_ns() - t_begin_mono_ns)
        with self._lock:
            wid = self._next_id
            self._next_id += 1
            self._done.append(
                {
                    "window_id": wid,
                    "parent_id": parent_id,
                    "kind": kind,
                    "name": name or kind,
                    "step": step,
                    "microbatch": microbatch,
                    "t_begin_mono_ns": int(t_begin_mono_ns),
                    "t_end_mono_ns": int(t_end_mono_ns),
                    "t_begin_wall_ns": wall,
                    "timing": timing,
                    **self._labels,
                    **labels,
                }
            )
            self.total_recorded += 1
        return wid

    def drain(self) -> list[dict[str, Any]]:
        """Take the finished windows recorded since the last drain (rows keyed by WINDOW_COLUMNS)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def open_windows(self) -> list[dict[str, Any]]:
        """Windows begun and not yet ended (e.g. at SIGTERM): the store writes them with a null end."""
        with self._lock:
            return [dict(r) for r in self._open.values()]
