"""The telemetry process's store and live figures: what it takes from the shared block.

A :class:`Collector` reads the shared block (telemetry/process/ring.py): the sample ring that its own
sampling loop fills, and the mark ring that the training process fills with finished windows,
figure requests and steps' raw mark logs (whose windows it makes: telemetry/steplog.py). On
every :meth:`~Collector.tick` it takes the new samples (as numpy columns:
no Python work per sample) and records, answers the figure requests whose window the samples
have passed (the same :func:`~charllm_nemo.telemetry.attribution.attribute_windows` over the
same samples the store gets, so live figures equal those computed later from the run
directory), and every ``flush_interval_s`` writes one samples and one windows segment.

It runs on a thread of the telemetry process (telemetry/process/child.py); the training
process runs one too, at close, only to salvage what a telemetry process that died left in the
block (:func:`salvage`). Writing the store here keeps Arrow conversion, Parquet encoding and
the attribution off the training process entirely: no GIL shared with training.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections import deque
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from charllm_nemo.telemetry.attribution import ENERGY_METHODS, attribute_windows, sample_columns
from charllm_nemo.telemetry.buffered import BufferedStore
from charllm_nemo.telemetry.layout import SIZE_CAPS, read_json
from charllm_nemo.telemetry.process.mark_ring import (
    MAX_HOLD_NS,
    REC_KIND,
    REC_NAME,
    REC_TYPE,
    STEP_LOG_HEAD,
    STEP_LOG_SIZE,
    FigureRequest,
    figure_columns,
    mask_figures,
    read_figure_request,
    read_names,
    step_log_records,
    valid_records,
    write_figures,
)
from charllm_nemo.telemetry.process.ring import (
    COLLECTOR_COUNTERS,
    D_EXPORT_RATES,
    FLOAT_COLUMNS,
    H_MARK_WRITE,
    H_SLOT_T,
    INT_COLUMNS,
    N_FLOAT,
    N_INT,
    STORE_WORDS,
    Block,
    newest_t,
    read_store_counts,
    ring_span,
    still_valid,
    write_store_counts,
)
from charllm_nemo.telemetry.sampler import columns_to_table
from charllm_nemo.telemetry.steplog import step_records, unpack
from charllm_nemo.telemetry.store import SegmentWriter, atomic_write_bytes, finish_manifest, records_to_table
from charllm_nemo.telemetry.windows import RECORD_FIGURES, RECORD_LEN, RECORD_STEP_LOG, RECORD_WINDOW

log = logging.getLogger("charllm_nemo.telemetry")

Columns = dict[str, np.ndarray[Any, Any]]

AFTER_S = 1.0
"""How far past a window's end live figures look for samples."""
_NEVER = 2**63 - 1


def encode_figures(
    result: dict[str, np.ndarray[Any, Any]], columns: tuple[str, ...], n_windows: int = 1
) -> list[list[float]]:
    """Each window's attribution as float64 values in ``columns`` order (``energy_method`` as its
    index in ENERGY_METHODS, booleans as 0 / 1, a column not in ``result`` as NaN);
    :func:`decode_figures` reverses it."""
    per_column = []
    for name in columns:
        if name not in result:
            per_column.append([math.nan] * n_windows)
        elif name == "energy_method":
            per_column.append([float(ENERGY_METHODS.index(str(v))) for v in result[name]])
        else:
            per_column.append(result[name].astype(np.float64).tolist())
    return [list(values) for values in zip(*per_column, strict=True)]


def decode_figures(
    values: list[float], columns: tuple[str, ...], keep: Collection[str] | None = None
) -> dict[str, Any]:
    """The figures :func:`encode_figures` encoded; only those in ``keep`` (None = all)."""
    if len(values) != len(columns):
        raise ValueError(f"{len(values)} figure values for {len(columns)} columns")
    out: dict[str, Any] = {}
    for i, name, convert in _picker(columns, None if keep is None else frozenset(keep)):
        v = values[i]
        out[name] = v if convert is None else convert(v)
    return out


@functools.lru_cache(maxsize=64)
def _picker(columns: tuple[str, ...], keep: frozenset[str] | None) -> tuple[tuple[int, str, Any], ...]:
    """(position, name, conversion or None) of the columns to decode (the training thread decodes
    a step's figures once a step: worked out once per set)."""
    convert: dict[str, Any] = {
        "energy_method": lambda v: ENERGY_METHODS[int(v)],
        "interpolated": bool,
        "n_samples": int,
    }
    wanted = [(i, name) for i, name in enumerate(columns) if keep is None or name in keep]
    return tuple((i, name, convert.get(name)) for i, name in wanted)


class Collector:
    """Takes samples and records from ``block`` and writes them under ``rank_dir``.

    ``period_ns``: how often whole samples arrive: the sampling period, or the counter period
    where a device reads its counters apart (live figures slice samples from two such periods
    before a window, so that a counter's tick inside it is found as in the stored run).
    ``live_window_s``: how long samples stay in memory for figure requests. ``names``: the
    record codes' strings (None: read from the block as the training process publishes them).
    ``buffered``: the devices' driver buffers, drained and written at every flush.
    """

    def __init__(
        self,
        block: Block,
        rank_dir: Path,
        *,
        source: str,
        period_ns: int,
        flush_interval_s: float = 0.5,
        live_window_s: float = 120.0,
        names: list[str] | None = None,
        buffered: BufferedStore | None = None,
    ) -> None:
        self.block = block
        self.buffered = buffered
        q, lay = block.q, block.layout
        self.source = source
        self.period_ns = period_ns
        self.flush_interval_ns = int(flush_interval_s * 1e9)
        self.live_window_ns = int(live_window_s * 1e9)
        self.writer = SegmentWriter.continuing(rank_dir, read_store_counts(q))
        self._names_from_block = names is None
        self.names: list[str] = [] if names is None else names
        self.columns = figure_columns()
        cap = lay.capacity
        self._ints = np.frombuffer(block.mm, np.int64, N_INT * cap, lay.ring0 * 8).reshape(N_INT, cap)
        self._floats = np.frombuffer(block.mm, np.float64, N_FLOAT * cap, lay.float_base(0) * 8).reshape(
            N_FLOAT, cap
        )
        self._marks = np.frombuffer(
            block.mm, np.int64, RECORD_LEN * lay.mark_capacity, lay.marks0 * 8
        ).reshape(lay.mark_capacity, RECORD_LEN)
        self._checks = np.frombuffer(block.mm, np.int64, lay.mark_capacity, lay.checks0 * 8)
        self._sample_idx = q[STORE_WORDS["samples"].flushed]  # next ring row to take
        self._mark_idx = q[STORE_WORDS["windows"].flushed]  # next record to take
        self._pending_samples: list[Columns] = []
        self._pending_records: list[np.ndarray[Any, Any]] = []
        self._history: deque[Columns] = deque()
        self._requests: deque[FigureRequest] = deque()
        self._serve_at = _NEVER  # the newest sample time at which serve() would answer (has_work)
        self._last_t = 0
        self._next_flush = time.monotonic_ns() + self.flush_interval_ns
        # COLLECTOR_COUNTERS, as the header holds them (a salvage goes on from a dead collector's)
        self.flushes: int = q[COLLECTOR_COUNTERS["flushes"]]
        self.flush_errors: int = q[COLLECTOR_COUNTERS["flush_errors"]]
        self.flush_ns_max: int = q[COLLECTOR_COUNTERS["flush_ns_max"]]
        self.figures_served: int = q[COLLECTOR_COUNTERS["figures_served"]]
        self.rows_lost: int = q[COLLECTOR_COUNTERS["rows_lost"]]
        self.exporter: Any = None  # telemetry.export: fed the new samples and records every tick

    def close(self) -> None:
        """Drop the views into the block (the block cannot be closed while they exist)."""
        del self._ints, self._floats, self._marks, self._checks

    # -- taking ----------------------------------------------------------------------------
    def take_samples(self) -> None:
        slot_t = self.block.q[H_SLOT_T]
        first, end, lost = ring_span(self.block, self._sample_idx)
        self.rows_lost += lost
        n = end - first
        if n <= 0:
            return
        cap = self.block.layout.capacity
        lo = first % cap
        if lo + n <= cap:
            ints, floats = self._ints[:, lo : lo + n].copy(), self._floats[:, lo : lo + n].copy()
        else:
            k = cap - lo
            ints = np.concatenate([self._ints[:, lo:], self._ints[:, : n - k]], axis=1)
            floats = np.concatenate([self._floats[:, lo:], self._floats[:, : n - k]], axis=1)
        keep = still_valid(self.block, first, n)
        if keep < n:  # overwritten while copied: the oldest rows are not the ones we wanted
            self.rows_lost += n - keep
            ints, floats = ints[:, n - keep :], floats[:, n - keep :]
        self._sample_idx = end
        if keep == 0:
            return
        chunk: Columns = {name: ints[j] for j, name in enumerate(INT_COLUMNS)}
        chunk.update({name: floats[j] for j, name in enumerate(FLOAT_COLUMNS)})
        self._pending_samples.append(chunk)
        self._history.append(chunk)
        # Live figures need a row past a window's end on every device: the newest complete
        # slot's time (read before the rows: all of that slot is in them), not the newest row's.
        newest = int(chunk["t_mono_ns"][-1])
        self._last_t = max(self._last_t, min(newest, slot_t) if slot_t else newest)
        horizon = self._last_t - self.live_window_ns
        while len(self._history) > 1 and self._history[0]["t_mono_ns"][-1] < horizon:
            self._history.popleft()

    def take_marks(self) -> None:
        q = self.block.q
        end = q[H_MARK_WRITE]
        n = end - self._mark_idx
        if n <= 0:
            return
        cap = self.block.layout.mark_capacity
        n = min(n, cap)  # a torn counter (a writer killed mid-store) can say more than a lap
        first = self._mark_idx
        lo = first % cap
        if lo + n <= cap:
            recs = self._marks[lo : lo + n].copy()
            checks = self._checks[lo : lo + n].tolist()
        else:
            recs = np.concatenate([self._marks[lo:], self._marks[: n - (cap - lo)]])
            checks = self._checks[lo:].tolist() + self._checks[: n - (cap - lo)].tolist()
        # Take only the records whose check word matches the copy (mark_ring: on a weakly ordered
        # CPU the counter may become visible before the records): the rest are read next time.
        n = valid_records(recs.tobytes(), checks, first)
        if n == 0:
            return
        recs = recs[:n]
        # Window records are stored as they are; a figure request is queued; a step log (several
        # records, its later ones holding arbitrary ints) becomes its windows' records.
        types = recs[:, REC_TYPE].tolist()
        i, run = 0, 0  # run: where the current run of window records began
        while i < n:
            kind = types[i]
            if kind == RECORD_WINDOW:
                i += 1
                continue
            if i > run:
                self._pending_records.append(recs[run:i])
            if kind == RECORD_FIGURES:
                req = read_figure_request(recs[i].tolist())
                self._requests.append(req._replace(batch=max(1, req.batch)))
                i += 1
            elif kind == RECORD_STEP_LOG:
                size = int(recs[i, STEP_LOG_SIZE])
                rows = step_log_records(size)
                if i + rows > n:  # its last records are not visible whole yet: next time
                    n = run = i
                    break
                payload = recs[i : i + rows].ravel()[STEP_LOG_HEAD : STEP_LOG_HEAD + size]
                made, _ = step_records(unpack(payload.tolist()))
                if made:
                    self._pending_records.append(np.array(made, np.int64))
                i += rows
            else:
                log.error("unknown record type %d in the mark ring: records %d.. skipped", kind, i)
                i = n
            run = i
        if n > run:
            self._pending_records.append(recs[run:n])
        self._mark_idx = first + n

    # -- live figures ----------------------------------------------------------------------
    def _between(self, since_ns: int, until_ns: int, names: Sequence[str]) -> Columns:
        """The samples in memory with ``since_ns <= t_mono_ns <= until_ns``, each device's last
        one before ``since_ns`` and first one after ``until_ns``: the columns ``names`` (which
        include ``t_mono_ns``). Those two more slots bracket a window next to a sampling stall
        (a loaded node keeping the sampler off the CPU for longer than the slice's margins), as
        the whole stored run does."""
        chunks: list[Columns] = []
        after: Columns | None = None  # the chunk right after those: its first slot may be needed
        for chunk in reversed(self._history):
            t = chunk["t_mono_ns"]
            if t[0] > until_ns:
                after = chunk
                continue
            if not chunks and after is not None:
                chunks.append(after)
            chunks.append(chunk)
            if t[0] < since_ns:
                break
        if not chunks:
            return {name: np.zeros(0, np.int64 if name in INT_COLUMNS else np.float64) for name in names}
        chunks.reverse()
        if len(chunks) == 1:
            cols = {name: chunks[0][name] for name in names}
        else:
            cols = {name: np.concatenate([c[name] for c in chunks]) for name in names}
        t = cols["t_mono_ns"]
        # A slot's rows are consecutive, one per device: one slot more on each side.
        n_dev = self.block.layout.n_devices
        lo = max(0, int(np.searchsorted(t, since_ns, side="left")) - n_dev)
        hi = int(np.searchsorted(t, until_ns, side="right")) + n_dev
        return {name: a[lo:hi] for name, a in cols.items()}

    def figures(
        self, t_begin: int, t_end: int, figures: Collection[str] | None = None
    ) -> list[tuple[int, list[float]]]:
        """The attribution figures of one window (``figures``: those wanted, None = all; the
        others are NaN), per device: :meth:`figures_of_windows` for one window."""
        return self.figures_of_windows([(t_begin, t_end)], figures)[0]

    def figures_of_windows(
        self, windows: Sequence[tuple[int, int]], figures: Collection[str] | None = None
    ) -> list[list[tuple[int, list[float]]]]:
        """Per window, per device, the attribution figures (``figures``: those wanted, None =
        all; the others are NaN) from the samples in memory, all windows in one
        ``attribute_windows`` call per device (a call costs about the same for one window as for
        eight): from two periods before the first window (so every sample inside has its
        predecessor and counter ticks are found as in the stored run) to :data:`AFTER_S` after
        the last (a metric missing from the first samples past the end still finds its next
        value, as in the stored run)."""
        names = ("device_index", *sample_columns(figures))  # the figures' metrics only
        t0s = [w[0] for w in windows]
        t1s = [w[1] for w in windows]
        cols = self._between(min(t0s) - 2 * self.period_ns, max(t1s) + int(AFTER_S * 1e9), names)
        win = {"t_begin_mono_ns": np.array(t0s, np.int64), "t_end_mono_ns": np.array(t1s, np.int64)}
        out: list[list[tuple[int, list[float]]]] = [[] for _ in windows]
        dev = cols.pop("device_index")
        devices = [int(dev[0])] if dev.size and (dev == dev[0]).all() else np.unique(dev).tolist()
        for idx in devices:
            # One device per rank is the common case: its columns as they are, no masks.
            per_dev = cols if len(devices) == 1 else {name: a[dev == idx] for name, a in cols.items()}
            result = attribute_windows(per_dev, win, figures=figures)
            for k, values in enumerate(encode_figures(result, self.columns, len(windows))):
                out[k].append((int(idx), values))
        return out

    def serve(self, final: bool = False) -> None:
        """Answer figure requests, oldest first, all those the samples have passed in one
        computation (``final``: every request): once the oldest request's ``batch`` can be
        answered whole, or once the samples are past its window's end by ``batch + 1`` times the
        window's length, at most :data:`MAX_HOLD_NS` (a short batch: the run ended, or a step
        took longer)."""
        reqs = self._requests
        if reqs and (final or self._last_t >= self._serve_time()):
            ready = 0  # the oldest requests whose windows the samples have passed
            while ready < len(reqs) and (final or reqs[ready].t_end_mono_ns <= self._last_t):
                ready += 1
            by_mask: dict[int, list[FigureRequest]] = {}
            for _ in range(ready):
                r = reqs.popleft()
                by_mask.setdefault(r.mask, []).append(r)
            for mask, group in by_mask.items():  # one mask in a training loop's requests
                try:
                    wanted = mask_figures(mask)
                    answers = self.figures_of_windows(
                        [(r.t_begin_mono_ns, r.t_end_mono_ns) for r in group], wanted
                    )
                    for r, per_device in zip(group, answers, strict=True):
                        t0, t1 = r.t_begin_mono_ns, r.t_end_mono_ns
                        write_figures(self.block, r.seq, t0, t1, per_device)
                        self.figures_served += 1
                        if self.exporter is not None:  # a step's figures, not computed twice
                            self.exporter.served(t0, t1, per_device, wanted)
                except Exception:
                    first = group[0].t_begin_mono_ns
                    log.exception("live figures of %d window(s) from t=%d failed", len(group), first)
        self._serve_at = self._serve_time()

    def _serve_time(self) -> int:
        """The newest sample time from which :meth:`serve` answers the oldest request."""
        if not self._requests:
            return _NEVER
        oldest = self._requests[0]
        t0, t1, batch = oldest.t_begin_mono_ns, oldest.t_end_mono_ns, oldest.batch
        held = t1 + min((batch + 1) * max(t1 - t0, self.period_ns), MAX_HOLD_NS)
        whole = self._requests[batch - 1].t_end_mono_ns if len(self._requests) >= batch else held
        return max(t1, min(whole, held))

    # -- storing ---------------------------------------------------------------------------
    def flush(self) -> None:
        """Write what was taken since the last flush: one samples and one windows segment."""
        t0 = time.monotonic_ns()
        try:
            # Each segment: its intent, the segment, the counts (its number: the commit), then the
            # ring index. A death anywhere in between loses nothing and stores nothing twice.
            q = self.block.q
            samples, windows = STORE_WORDS["samples"], STORE_WORDS["windows"]
            if self._pending_samples:
                chunks = self._pending_samples
                cols = {name: np.concatenate([c[name] for c in chunks]) for name in chunks[0]}
                q[samples.pending] = self._sample_idx
                q[samples.pending_seg] = self.writer.counts()["segments"]["samples"] + 1
                self.writer.write_segment("samples", columns_to_table(cols, self.source))
                self._pending_samples = []
                self.publish()
            q[samples.flushed] = self._sample_idx
            names_whole = True
            if self._pending_records and self._names_from_block:
                # A name not visible whole yet (mark_ring): its windows wait for the next flush.
                names_whole = read_names(self.block, self.names)
            if self._pending_records and names_whole:
                recs = np.concatenate(self._pending_records)
                top_code = int(recs[:, [REC_KIND, REC_NAME]].max(initial=0))
                names = self.names + ["?"] * max(0, top_code + 1 - len(self.names))
                q[windows.pending] = self._mark_idx
                q[windows.pending_seg] = self.writer.counts()["segments"]["windows"] + 1
                self.writer.write_segment("windows", records_to_table(recs, names))
                self._pending_records = []
                self.publish()
            if not self._pending_records:  # else their ring slots stay theirs until stored
                q[windows.flushed] = self._mark_idx
            if self.buffered is not None:  # the driver buffers, drained now: their own segments
                self.buffered.flush()
            self.flushes += 1
        except Exception:
            # Kept for the next try (a full disk may clear); the rings still hold it too.
            self.flush_errors += 1
            log.exception("telemetry flush failed; will retry at the next interval")
        self.flush_ns_max = max(self.flush_ns_max, time.monotonic_ns() - t0)
        self.publish()

    def publish(self) -> None:
        q = self.block.q
        write_store_counts(q, self.writer.counts())
        for name, word in COLLECTOR_COUNTERS.items():
            q[word] = getattr(self, name)

    def has_work(self) -> bool:
        """Whether a :meth:`tick` now would do more than flush: the training process wrote records
        since the last take, or the samples have reached the time from which figure requests
        are answered. A few reads of the block: the sampling loop asks this after every slot."""
        block = self.block
        return block.q[H_MARK_WRITE] != self._mark_idx or newest_t(block) >= self._serve_at

    def until_flush_s(self) -> float:
        """Seconds until the next flush is due (0 when overdue)."""
        return max(0.0, (self._next_flush - time.monotonic_ns()) / 1e9)

    def tick(self) -> None:
        """Take, answer, and flush when due. Never raises."""
        try:
            n_samples, n_records = len(self._pending_samples), len(self._pending_records)
            self.take_samples()
            self.take_marks()
            self.serve()
            self._export(n_samples, n_records)
        except Exception:
            log.exception("telemetry collector tick failed")
        # Records free their ring slots only once stored (so that a salvage finds them): flush
        # early when the mark ring fills faster than the flush interval drains it.
        unflushed = self._mark_idx - self.block.q[STORE_WORDS["windows"].flushed]
        if time.monotonic_ns() >= self._next_flush or unflushed > self.block.layout.mark_capacity // 4:
            self._next_flush = time.monotonic_ns() + self.flush_interval_ns
            self.flush()

    def _export(self, n_samples: int, n_records: int, final: bool = False) -> None:
        """Hand the live exporter (telemetry/export/) what was taken since those counts."""
        if self.exporter is not None:
            d = self.block.d
            rates = (d[D_EXPORT_RATES], d[D_EXPORT_RATES + 1], d[D_EXPORT_RATES + 2])
            new = self._pending_samples[n_samples:], self._pending_records[n_records:]
            self.exporter.update(self, *new, rates, final=final)

    def finish(self) -> None:
        """Take everything left, answer every request, flush."""
        n_samples, n_records = len(self._pending_samples), len(self._pending_records)
        self.take_samples()
        self.take_marks()
        self.serve(final=True)
        self._export(n_samples, n_records, final=True)
        self.flush()


def salvage(block: Block, rank_dir: Path, *, source: str, names: list[str]) -> dict[str, Any]:
    """What a telemetry process that died left unwritten in ``block``: write it (the training
    process calls this at close). Returns the store's counts, as :meth:`SegmentWriter.counts`."""
    q = block.q
    # A flush that died after its segment's counts were published but before the ring index
    # followed: what it stored starts after that segment, not before.
    for w in STORE_WORDS.values():
        if q[w.pending_seg] == q[w.seg] and q[w.pending] > q[w.flushed]:
            q[w.flushed] = q[w.pending]
    c = Collector(block, rank_dir, source=source, period_ns=1, names=names)
    try:
        c.take_samples()
        c.take_marks()
        c.flush()
        return c.writer.counts()
    finally:
        c.close()


def mark_manifest_killed(rank_dir: Path, counts: dict[str, Any], extra: dict[str, Any]) -> None:
    """The training process died without closing its telemetry: say so in its manifest."""
    path = rank_dir / "manifest.json"
    problems: list[str] = []
    manifest = read_json(path, SIZE_CAPS["manifest"], problems)
    if not isinstance(manifest, dict):
        log.error("cannot mark %s killed: %s", path, "; ".join(problems) or "not a JSON object")
        return
    manifest.update(extra)
    finish_manifest(manifest, "killed", counts)
    atomic_write_bytes(path, json.dumps(manifest, indent=2, sort_keys=True, default=str).encode())
