"""A step's marks as one flat log, and the windows it makes.

:class:`~charllm_nemo.train.marks.StepMarker` notes every Megatron-Core timer start and stop of a
step as two ints appended to a flat list: a **key** (the timer, its phase's name code, begin or
end: :func:`mark_key`) and the clock reading. At step end the log becomes the step's windows
(:func:`step_records`) in one of two places:

* on the training thread (the session samples in a thread, or a step cut short at close);
* in the telemetry process: the training thread writes the raw log into the mark ring as one
  step-log record (:func:`pack`'s pieces here, ``MarkWriter.emit_step_log`` in telemetry/process/ring.py), and
  the collector turns it into window records (:func:`unpack`, :func:`step_records`). With the
  caches a training step leaves, that took ``end_step`` in a tiny_gpt step from 79 µs to
  44-48 µs (18 -> 3.5 µs hot; docs/bench-train.md).

Either way the records are the same, window ids included: the training thread reserves the ids
(the step's own, then one per possible child) before it hands the log on.

This module is plain Python on ints (no numpy): the telemetry process and the training process
both import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from charllm_nemo.telemetry.schema import WINDOW_LABELS
from charllm_nemo.telemetry.windows import NULL, RECORD_WINDOW, SEEDED_NAMES, Record

CODE: dict[str, int] = {name: i for i, name in enumerate(SEEDED_NAMES)}
"""Codes of the names every name table starts with (the same in every process)."""

KIND_MICROBATCH, KIND_PHASE = 1, 2
"""Bits of a log's ``kinds``: which child windows to make from it."""

_TIMER_BITS = 16
_VPP_AT = WINDOW_LABELS.index("vpp_chunk")


def mark_key(phase_code: int, timer_index: int, begin: bool) -> int:
    """The key of one mark: the phase's name code, the timer (a marker's timers are numbered
    from 0: two timers may share a phase) and begin (1) or end (0)."""
    return (((phase_code << _TIMER_BITS) | timer_index) << 1) | int(begin)


@dataclass
class StepLog:
    """One step's marks and what is needed to make its windows.

    ``marks``: flat ``[key, t, key, t, ...]`` (t in CLOCK_MONOTONIC ns). ``t_end`` None: the step
    is still running (cut short at close); it and the phases still open are then the caller's to
    begin as open windows. ``step_window_id`` None: no step window (it is not recorded, or it is
    begun open by the caller, who passes its id as ``parent_id``). ``first_child_id``: the first
    of the ids reserved for the children (:func:`ids_needed`). ``order``: the (microbatch,
    chunk) of the k-th forward, flat; empty without virtual pipeline chunks (the k-th forward is
    microbatch k). ``labels``: the recorder's labels, NULL for null."""

    step: int
    t_begin: int
    t_end: int | None
    wall_offset: int
    timing: int
    step_window_id: int | None
    parent_id: int | None
    first_child_id: int
    num_microbatches: int
    num_chunks: int
    kinds: int
    labels: tuple[int, ...]
    order: Sequence[int]
    marks: Sequence[int]


def ids_needed(n_mark_ints: int, num_microbatches: int, kinds: int) -> int:
    """Ids to reserve for a log's children: at most one phase per two marks (a stop is logged only
    while its timer is open) and one span per microbatch."""
    phases = n_mark_ints // 4 if kinds & KIND_PHASE else 0
    return phases + (num_microbatches if kinds & KIND_MICROBATCH else 0)


def _opt(v: int | None) -> int:
    return NULL if v is None else v


def _or_none(v: int) -> int | None:
    return None if v == NULL else v


_FIXED = 12 + len(WINDOW_LABELS)  # the ints before the order and the marks


def head(
    step: int, t_begin: int, t_end: int | None, wall_offset: int, timing: int,
    step_window_id: int | None, parent_id: int | None, first_child_id: int,
) -> tuple[int, ...]:  # fmt: skip
    """The ints a log starts with: what changes from step to step."""
    return (
        step, t_begin, _opt(t_end), wall_offset, timing,
        _opt(step_window_id), _opt(parent_id), first_child_id,
    )  # fmt: skip


def shape(
    num_microbatches: int, num_chunks: int, kinds: int, labels: Sequence[int], order: Sequence[int]
) -> list[int]:
    """The ints between the :func:`head` and the marks: what a marker keeps from step to step."""
    return [num_microbatches, num_chunks, kinds, *labels, len(order), *order]


def pack(log: StepLog) -> list[int]:
    """The log as ints (what goes into the mark ring after the record type and the length):
    :func:`head`, :func:`shape`, the marks. A marker ships the three pieces as they are
    (``MarkWriter.emit_step_log`` takes them in order)."""
    return [
        *head(log.step, log.t_begin, log.t_end, log.wall_offset, log.timing, log.step_window_id,
              log.parent_id, log.first_child_id),
        *shape(log.num_microbatches, log.num_chunks, log.kinds, log.labels, log.order),
        *log.marks,
    ]  # fmt: skip


def unpack(ints: Sequence[int]) -> StepLog:
    """:func:`pack` reversed."""
    n_lab = len(WINDOW_LABELS)
    n_order = int(ints[_FIXED - 1])
    return StepLog(
        step=int(ints[0]),
        t_begin=int(ints[1]),
        t_end=_or_none(int(ints[2])),
        wall_offset=int(ints[3]),
        timing=int(ints[4]),
        step_window_id=_or_none(int(ints[5])),
        parent_id=_or_none(int(ints[6])),
        first_child_id=int(ints[7]),
        num_microbatches=int(ints[8]),
        num_chunks=int(ints[9]),
        kinds=int(ints[10]),
        labels=tuple(int(v) for v in ints[11 : 11 + n_lab]),
        order=[int(v) for v in ints[_FIXED : _FIXED + n_order]],
        marks=[int(v) for v in ints[_FIXED + n_order :]],
    )


def step_records(log: StepLog) -> tuple[list[Record], list[tuple[int, int | None, int | None, int]]]:
    """The window records of a step's log, and the phases still open (phase name code,
    microbatch, vpp chunk, begin) in the order they began.

    Records: the step window (when ``step_window_id`` is set and the step ended), then the
    microbatch spans, then the phases in the order they began; children's ids run from
    ``first_child_id``. Pairing: a stop closes its timer's open start. The k-th forward of the
    step is the schedule's k-th (``order``); the k-th backward likewise, with the chunk order
    reversed (as mcore runs backward); a microbatch spans its first forward begin to its last
    backward end."""
    marks, order = log.marks, log.order
    n_order = len(order) // 2
    n_micro, n_chunks = log.num_microbatches, max(1, log.num_chunks)
    fwd_code, bwd_code = CODE["forward"], CODE["backward"]
    fwd_k = bwd_k = 0
    first_begin: dict[int, int] = {}
    backwards_left = dict.fromkeys(range(n_micro), n_chunks)
    open_: dict[int, tuple[int, int, int | None, int | None, int]] = {}
    phases: list[tuple[int, int, int | None, int | None, int, int]] = []
    spans: list[tuple[int, int, int]] = []

    def nth(k: int) -> tuple[int, int]:
        """(microbatch, chunk) of the step's k-th forward (and k-th backward, chunk mirrored)."""
        if n_order:
            k %= n_order
            return order[2 * k], order[2 * k + 1]
        return k % max(n_micro, 1), 0

    for pos in range(0, len(marks) - 1, 2):
        key, t = marks[pos], marks[pos + 1]
        ident, phase = key >> 1, key >> (_TIMER_BITS + 1)
        if key & 1:
            mb: int | None = None
            chunk: int | None = None
            if phase == fwd_code:
                mb, chunk = nth(fwd_k)
                fwd_k += 1
                first_begin.setdefault(mb, t)
            elif phase == bwd_code:
                mb, fchunk = nth(bwd_k)
                chunk = n_chunks - 1 - fchunk
                bwd_k += 1
            open_[ident] = (pos, phase, mb, chunk if n_chunks > 1 else None, t)
            continue
        begun = open_.pop(ident, None)
        if begun is None:  # a stop without its start (the marker logs none: kept robust)
            continue
        phases.append((*begun, t))
        mb = begun[2]
        if phase == bwd_code and mb is not None:
            left = backwards_left.get(mb, 1) - 1
            backwards_left[mb] = left
            if left == 0 and mb in first_begin:
                spans.append((mb, first_begin[mb], t))
    phases.sort(key=lambda p: p[0])

    labels, wall, timing, step = log.labels, log.wall_offset, log.timing, log.step
    recs: list[Record] = []
    if log.step_window_id is not None and log.t_end is not None:
        recs.append(
            (RECORD_WINDOW, log.step_window_id, _opt(log.parent_id), CODE["step"], CODE["step"], step, NULL,
             log.t_begin, log.t_end, log.t_begin + wall, timing, *labels)
        )  # fmt: skip
    parent = _opt(log.step_window_id if log.step_window_id is not None else log.parent_id)
    wid = log.first_child_id
    if log.kinds & KIND_MICROBATCH:
        mbc = CODE["microbatch"]
        for mb, b, e in spans:
            recs.append((RECORD_WINDOW, wid, parent, mbc, mbc, step, mb, b, e, b + wall, timing, *labels))
            wid += 1
    if log.kinds & KIND_PHASE:
        phc = CODE["phase"]
        for _pos, name, mb_, chunk, b, e in phases:
            lab = labels if chunk is None else (*labels[:_VPP_AT], chunk, *labels[_VPP_AT + 1 :])
            mbv = _opt(mb_)
            recs.append((RECORD_WINDOW, wid, parent, phc, name, step, mbv, b, e, b + wall, timing, *lab))
            wid += 1
    still_open = [(p[1], p[2], p[3], p[4]) for p in sorted(open_.values(), key=lambda p: p[0])]
    return recs, still_open
