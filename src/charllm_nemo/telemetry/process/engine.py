"""The process engine: a telemetry process beside the rank samples, stores and computes live
figures (telemetry/process/child.py, started by
:class:`~charllm_nemo.telemetry.process.parent.ProcessSampler`). This process only writes finished
windows and figure requests into the shared block (~3 µs a window, begin to end) and reads the
answers back: no thread here, no GIL shared with training. The interface is
:class:`~charllm_nemo.telemetry.engine.Engine`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection, Sequence
from typing import Any

from charllm_nemo.devices.base import ActivityInput
from charllm_nemo.telemetry.engine import EngineClosed
from charllm_nemo.telemetry.process.collector import decode_figures
from charllm_nemo.telemetry.process.mark_ring import figure_columns, figure_mask
from charllm_nemo.telemetry.process.parent import FIGURE_SLOTS, ProcessSampler
from charllm_nemo.telemetry.sample_loop import Row, SamplerHealth
from charllm_nemo.telemetry.windows import Record, WindowRecorder

LIVENESS_CHECK_NS = 1_000_000_000
"""How often (in the windows' time) :meth:`ProcessEngine.lost` checks that the telemetry process
is alive: a ``waitpid`` and a read of the shared block, ~2 µs."""


def _covers(asked: tuple[int, frozenset[str] | None], wanted: frozenset[str] | None) -> bool:
    """Whether a request made (its slot, the figures it asked for; None = all) holds ``wanted``."""
    return asked[1] is None or (wanted is not None and wanted <= asked[1])


class ProcessEngine:
    """A session's telemetry process, through ``sampler`` (built, not started). ``activity``: the
    backend's activity input in this process (devices/base.py's ActivityInput; None for devices
    that measure their own), whose levels are then published to the devices in the telemetry
    process."""

    mode = "process"

    def __init__(self, sampler: ProcessSampler, activity: ActivityInput | None = None) -> None:
        self._sampler = sampler
        self._activity = activity
        self._windows: WindowRecorder | None = None
        self._request_seq = itertools.count()
        # (t_begin, t_end) -> (slot seq, the figures asked for; None = all)
        self._requests: dict[tuple[int, int], tuple[int, frozenset[str] | None]] = {}
        self._masks: dict[tuple[str, ...] | None, tuple[int, frozenset[str] | None]] = {}
        self._figure_columns: tuple[str, ...] = ()
        self._liveness_due = 0

    @property
    def sampler(self) -> ProcessSampler:
        return self._sampler

    @property
    def running(self) -> bool:
        return self._sampler.running

    @property
    def health(self) -> SamplerHealth:
        return self._sampler.health

    def health_counts(self) -> tuple[float, float, float]:
        return self._sampler.health_counts()

    @property
    def disk_full(self) -> bool:
        return self._sampler.disk_full

    @property
    def pid(self) -> int | None:
        return self._sampler.pid

    def start(self, windows: WindowRecorder) -> bool:
        """Start the telemetry process and send the recorder's marks there; False when it did
        not start (its reason: ``sampler.health.stop_reason``)."""
        s = self._sampler
        s.start()
        marks = s.marks
        if not s.running or marks is None:
            return False
        self._windows = windows
        s.names = windows.names.names
        windows.names.set_on_new(marks.publish_name)
        windows.set_sink(marks.emit_many)
        windows.log_sink = marks.emit_step_log  # steps' windows are made there
        if self._activity is not None:  # the synthetic device there follows the marks made here
            self._activity.on_change = s.activity_publisher()
        self._figure_columns = figure_columns()
        return True

    def detach(self) -> None:
        """Marks from now on stay in this process (after a stop, or before a takeover)."""
        windows = self._windows
        if windows is not None:
            windows.reset_sink()
            windows.log_sink = None
        if self._activity is not None:  # the synthetic device here follows the marks again
            self._activity.on_change = None

    def lost(self, t_end_mono_ns: int) -> bool:
        """Whether the telemetry process has stopped mid-run (checked at most once a second of
        the windows' time, from :meth:`request_figures`' caller)."""
        if t_end_mono_ns < self._liveness_due:
            return False
        self._liveness_due = t_end_mono_ns + LIVENESS_CHECK_NS
        return not self._sampler.running

    def flush(self) -> None:
        """Nothing: the telemetry process flushes."""

    def live_rows(self, since_mono_ns: int = 0, before: int = 0) -> list[Row]:
        """What the shared ring still holds (up to 16 s)."""
        import bisect

        rows = self._sampler.peek_rows()
        first = bisect.bisect_left(rows, since_mono_ns, key=lambda r: r[0])
        return rows[max(0, first - before) :]

    def request_figures(
        self, t_begin_mono_ns: int, t_end_mono_ns: int, figures: Collection[str] | None, batch: int = 1
    ) -> None:
        """Ask the telemetry process for a window's figures: it computes them as soon as it has a
        sample past the end (or after ``batch`` windows). Asking again for a window already asked
        for, with no figure beyond those asked for then, does nothing."""
        marks = self._sampler.marks
        if marks is None:
            return
        mask, wanted = self._mask_of(figures)
        key = (t_begin_mono_ns, t_end_mono_ns)
        asked = self._requests.get(key)
        if asked is not None:
            if _covers(asked, wanted):
                return
            # More figures than asked for (so asked[1] is a set): ask again for the union (a new slot).
            union = None if wanted is None else wanted | (asked[1] or frozenset())
            mask, wanted = self._mask_of(None if union is None else tuple(sorted(union)))
        seq = next(self._request_seq)
        self._requests[key] = (seq, wanted)
        if len(self._requests) > 2 * FIGURE_SLOTS:  # answers that old are overwritten anyway
            del self._requests[next(iter(self._requests))]
        marks.request_figures(seq, t_begin_mono_ns, t_end_mono_ns, mask, batch)

    def _mask_of(self, figures: Collection[str] | None) -> tuple[int, frozenset[str] | None]:
        """A request's mask and figure set (``duration_s`` always included), cached per set."""
        key = None if figures is None else tuple(figures)
        hit = self._masks.get(key)
        if hit is None:
            wanted = None if figures is None else frozenset({"duration_s", *figures})
            hit = self._masks[key] = (figure_mask(wanted), wanted)
        return hit

    def figures(
        self, t_begin: int, t_end: int, wait_s: float, figures: Collection[str] | None
    ) -> list[dict[str, Any]] | None:
        """The telemetry process's answer (~10 µs to read), asking first if not yet asked."""
        keep = self._mask_of(figures)[1]  # the figures wanted and duration_s, or None: all
        asked = self._requests.get((t_begin, t_end))
        if asked is None or not _covers(asked, keep):
            self.request_figures(t_begin, t_end, figures)  # not asked for (all of) them yet
            asked = self._requests.get((t_begin, t_end))
            if asked is None:
                return None
        seq = asked[0]
        answer = self._sampler.read_figures(seq)
        if answer is None and wait_s > 0:
            deadline = time.monotonic() + wait_s
            while answer is None and self._sampler.running and time.monotonic() < deadline:
                time.sleep(0.002)
                answer = self._sampler.read_figures(seq)
        if answer is None:
            return None
        out = []
        for idx, values in answer[2]:
            row = decode_figures(values, self._figure_columns, keep)
            row["device_index"] = idx
            out.append(row)
        return out

    def stop_for_takeover(self) -> dict[str, Any]:
        """Stop what is left of a telemetry process lost mid-run (its salvage stores what the
        rings still hold) and return its store's counts, for the thread engine that goes on."""
        self.detach()
        self._requests.clear()
        self._sampler.stop(1.0)
        return self._sampler.store_counts()

    def close(self, windows: WindowRecorder, open_records: Sequence[Record]) -> EngineClosed:
        marks = self._sampler.marks
        if marks is not None and open_records:
            marks.emit_many(list(open_records))
        self.detach()  # marks after close stay in the recorder, not sent to a block that is gone
        self._sampler.stop()
        counts = self._sampler.store_counts()
        extra = {
            "flusher": {
                "flushes": counts.get("flushes", 0),
                "errors": counts.get("flush_errors", 0),
                "flush_ms_max": counts.get("flush_ms_max", 0.0),
                "interval_s": self._sampler.store["flush_interval_s"] if self._sampler.store else None,
                "where": "telemetry process",
            },
            "store_process": {
                k: counts.get(k)
                for k in ("done", "salvaged", "figures_served", "rows_lost", "marks_dropped")
                if k in counts
            },
        }
        keys = ("segments", "rows", "bytes_written", "rows_unwritten", "disk_full")
        store_counts = {k: counts[k] for k in keys if k in counts}
        # Steps' windows are made in the telemetry process: count what it stored.
        stored = counts.get("rows", {}).get("windows")
        recorded = windows.total_recorded if stored is None else stored - len(open_records)
        return EngineClosed(extra=extra, counts=store_counts or None, recorded=int(recorded))
