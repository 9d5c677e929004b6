"""The shared block's mark ring, names and figure slots: the parts that carry a payload between
two processes (the training process and its telemetry process), and why a reader never takes a
torn entry, on x86-64 and on weakly ordered CPUs (aarch64, e.g. Grace) alike.

The problem. Pure Python issues no memory barrier. A writer stores an entry's words, then a
counter; on x86-64 (TSO) another core sees the stores in that order, but on aarch64 stores to
different addresses may become visible in any order (and loads may be satisfied in any order),
so a reader that trusted the counter could read an entry whose last words are still the previous
lap's. A seqlock or a sequence word written last does not help: it is one more store whose
order against the payload nothing guarantees.

The rule here: an entry says itself whether it is complete, so order does not matter. Each
entry carries a check word computed from its index and its content; a reader copies the entry
once, recomputes the check from the copy and takes the entry only if it matches, else treats it
as not yet written and reads it again later (every store becomes visible in finite time: Arm
ARM B2.3, "Memory ordering", the observability requirement). What this relies on:

* single-copy atomicity of aligned 8-byte loads and stores (x86-64; ARMv8 Arm ARM B2.2.1):
  CPython's memoryview and numpy copy int64 items with 8-byte loads and stores, so a word is
  either its old or its new value, never half of each. Even that only matters for the check
  word and the counter: a torn payload word fails the check like a stale one;
* per-location coherence: once a reader has seen a word's new value it never again sees an older
  one, so the stale content a reader can meet is the previous lap's (the index in the check
  tells laps apart) or the block's zeros;
* CRC-32 (zlib.crc32) of the entry's bytes: a mix of old and new words passes the check only if
  the CRCs collide, 2^-32 per mixed read; the writer's window for a mixed read is the
  microseconds between its stores becoming visible, so in practice never;
* the reader frees a slot (H_MARKS_FLUSHED) only after its check passed, and the writer reuses
  a slot only after reading that counter: both are control dependencies from a load to a store,
  which ARMv8 keeps in order (no store is made visible speculatively), so the writer cannot
  overwrite a record the reader is still reading.

The three parts:

* **mark ring** (training process -> telemetry process): ``mark_capacity`` records of RECORD_LEN
  int64 words (telemetry/windows.py): finished windows, figure requests and step logs. A step
  log (telemetry/steplog.py) fills whole consecutive records: ``[RECORD_STEP_LOG, n]``, then the
  ``n`` ints of ``steplog.pack``, zero-padded to a record boundary. Record ``i`` sits in slot
  ``i % mark_capacity``; its check word (``mark_capacity`` words after the ring) is
  :func:`stamp` ``(i, record bytes)``. The writer stores the records, their check words, then
  ``H_MARK_WRITE``; the reader takes records below that counter up to the first whose check
  fails (and never half a step log).
* **names**, 16 KiB: the strings the records' codes stand for, appended by the training process
  before the first record that uses them, as ``<u16 length><u32 check><utf-8>`` with check =
  CRC-32 of the code (u32) and the text. The reader stops at the first entry whose check fails
  and stores a segment's windows only once it knows every name they use.
* **figure slots** (telemetry process -> training process), ``fig_slots`` slots of
  ``slot_words``: ``[seq + 1, t_begin, t_end, n_devices]``, then per device its index and one
  float64 per :func:`figure_columns` entry (zeros for devices past ``n_devices``), then a check
  word: CRC-32 of all the words before it.
  The reader copies the whole slot once and decodes it from the copy only if ``seq`` and the
  check match.
"""

from __future__ import annotations

import functools
import struct
import threading
import zlib
from array import array
from collections.abc import Collection, Sequence
from typing import NamedTuple

from charllm_nemo.telemetry.process.ring import (
    FIG_HEAD,
    H_MARK_WRITE,
    H_MARKS_DROPPED,
    H_MARKS_FLUSHED,
    H_NAMES_BYTES,
    H_NAMES_COUNT,
    NAMES_SIZE,
    Block,
)
from charllm_nemo.telemetry.windows import (
    NULL,
    RECORD_FIELDS,
    RECORD_FIGURES,
    RECORD_LEN,
    RECORD_STEP_LOG,
    Record,
)

RECORD_BYTES = RECORD_LEN * 8

# -- the records' words, by name: declared once, for the writer here and the reader (collector.py) --
REC_TYPE = RECORD_FIELDS.index("record_type")
"""Every record's first word: RECORD_WINDOW, RECORD_FIGURES or RECORD_STEP_LOG."""
REC_KIND, REC_NAME = RECORD_FIELDS.index("kind"), RECORD_FIELDS.index("name")
"""A window record (RECORD_FIELDS): the words holding its kind's and name's name-table codes."""
FIGURE_REQUEST_WORDS: dict[str, int] = {
    "seq": 1,
    "mask": 2,
    "batch": 3,
    "t_begin_mono_ns": RECORD_FIELDS.index("t_begin_mono_ns"),
    "t_end_mono_ns": RECORD_FIELDS.index("t_end_mono_ns"),
}
"""A figure request (RECORD_FIGURES): where each of its fields sits; the other words are NULL."""
STEP_LOG_SIZE = 1
"""A step log (RECORD_STEP_LOG): the word holding its payload's length in ints ..."""
STEP_LOG_HEAD = 2
"""... and the words before its payload, which fills whole consecutive records."""


MAX_HOLD_NS = 250_000_000
"""The longest a figure request waits past its window's end for the rest of its batch (the
collector's ``serve``; the live exporter waits as long before it computes a step's figures itself; the
training loop waits at least 2 s for its last steps' figures: train.loop.final_wait)."""


class FigureRequest(NamedTuple):
    """A request for one window's live figures (answered in figure slot ``seq``)."""

    seq: int
    t_begin_mono_ns: int
    t_end_mono_ns: int
    mask: int
    batch: int


def figure_request_record(req: FigureRequest) -> Record:
    """The mark-ring record of ``req`` (:data:`FIGURE_REQUEST_WORDS`)."""
    words = [NULL] * RECORD_LEN
    words[REC_TYPE] = RECORD_FIGURES
    for name, pos in FIGURE_REQUEST_WORDS.items():
        words[pos] = getattr(req, name)
    return tuple(words)


def read_figure_request(record: Sequence[int]) -> FigureRequest:
    """The request a RECORD_FIGURES record carries (:func:`figure_request_record` reversed)."""
    return FigureRequest(**{name: int(record[pos]) for name, pos in FIGURE_REQUEST_WORDS.items()})


def step_log_records(size: int) -> int:
    """How many consecutive records a step log of ``size`` ints fills."""
    return -(-(STEP_LOG_HEAD + size) // RECORD_LEN)


_NAME_HEAD = struct.Struct("<HI")  # length, check
NAME_HEAD_BYTES = _NAME_HEAD.size


def stamp(index: int, record: bytes | memoryview) -> int:
    """Record ``index``'s check word: ``(index + 1) mod 2**31`` in the high half (0 is never a
    stamp: a zero-filled slot fails), CRC-32 of its bytes in the low half."""
    return ((index + 1) & 0x7FFFFFFF) << 32 | zlib.crc32(record)


def valid_records(records: bytes | memoryview, checks: Sequence[int], first: int) -> int:
    """How many of the records copied from ``first`` on (``records``: their bytes, ``checks``:
    their check words, copied before or after them) pass their check, from the first on."""
    view = memoryview(records).cast("B")
    for k, check in enumerate(checks):
        if check != stamp(first + k, view[k * RECORD_BYTES : (k + 1) * RECORD_BYTES]):
            return k
    return len(checks)


def figure_columns() -> tuple[str, ...]:
    """The figure slot's columns: every attribution column (imports attribution: numpy)."""
    from charllm_nemo.telemetry.attribution import ATTRIBUTION_COLUMN_NAMES

    return ATTRIBUTION_COLUMN_NAMES


def figure_mask(figures: Collection[str] | None) -> int:
    """A figure request's mask: bit i set = ``figure_columns()[i]`` wanted; NULL = all of them.
    Unknown names raise ValueError."""
    if figures is None:
        return NULL
    from charllm_nemo.telemetry.attribution import check_figures

    wanted = check_figures(figures)
    return sum(1 << i for i, name in enumerate(figure_columns()) if name in wanted)


def mask_figures(mask: int) -> tuple[str, ...] | None:
    """The figures a request's mask asks for (None = all): the inverse of :func:`figure_mask`."""
    if mask == NULL:
        return None
    return tuple(name for i, name in enumerate(figure_columns()) if mask >> i & 1)


# -- the mark ring and the names (training process -> telemetry process) ---------------------------


def write_ring(q: memoryview, base: int, checks: int, cap: int, w: int, *parts: Sequence[int]) -> int:
    """The ints of ``parts``, one after another and zero-padded to whole records, written into
    the ring of ``cap`` records at int64 word ``base`` of ``q`` from record ``w % cap`` on,
    wrapping to record 0, each record's :func:`stamp` into the check words at word ``checks``;
    returns the records written. The caller checks the room and publishes the write position."""
    data = array("q", [v for part in parts for v in part])
    n = -(-len(data) // RECORD_LEN)
    if n > cap:
        raise ValueError("write_ring: more records than the ring holds")
    data.extend(_ZEROS[: n * RECORD_LEN - len(data)])
    words, pos = cap * RECORD_LEN, (w % cap) * RECORD_LEN
    if max(base + words, checks + cap) > len(q):
        raise ValueError("write_ring: the ring does not fit in the buffer")
    raw = data.tobytes()
    k = min(len(data), words - pos)
    q[base + pos : base + pos + k] = data[:k]
    if k < len(data):
        q[base : base + len(data) - k] = data[k:]
    for j in range(n):
        q[checks + (w + j) % cap] = stamp(w + j, raw[j * RECORD_BYTES : (j + 1) * RECORD_BYTES])
    return n


_ZEROS = array("q", [0] * RECORD_LEN)


class MarkWriter:
    """The training process's side of the mark ring: the WindowRecorder's sink and the
    publisher of its name table. Never blocks: a full ring drops the record and counts it."""

    def __init__(self, block: Block) -> None:
        self.block = block
        lay = block.layout
        self.cap = lay.mark_capacity
        self.base = lay.marks0
        self.checks = lay.checks0
        self._lock = threading.Lock()
        self._names_used = block.q[H_NAMES_BYTES]
        self.dropped = 0
        self.overflow_names = 0

    def emit(self, rec: Record) -> None:
        """Write one record (a window or a figure request); drop it if the ring is full."""
        self.emit_many((rec,))

    def emit_many(self, recs: Sequence[Record]) -> None:
        """Write records in order (the WindowRecorder's sink); those that do not fit in the ring
        are dropped and counted."""
        if any(len(rec) != RECORD_LEN for rec in recs):
            raise TypeError(f"a mark-ring record has {RECORD_LEN} ints")
        self._write(len(recs), recs, whole=False)

    def emit_step_log(self, *parts: Sequence[int]) -> None:
        """Write a step's packed log (the ints of ``parts`` one after another: steplog.pack or
        its pieces) as one run of consecutive records; drop it (counting its records) if the ring
        lacks room for all of them."""
        size = sum(map(len, parts))
        self._write(step_log_records(size), ((RECORD_STEP_LOG, size), *parts), whole=True)

    def _write(self, n: int, parts: Sequence[Sequence[int]], whole: bool) -> None:
        """Write ``n`` records' ints (``parts``, one after another; ``write_ring`` pads the last
        record) and publish them. Where the ring lacks room for all: ``whole``, drop them all;
        else write the records that fit (then each part is one record) and drop the rest. The
        drops are counted."""
        q = self.block.q
        try:
            with self._lock:
                w = q[H_MARK_WRITE]
                room = self.cap - (w - q[H_MARKS_FLUSHED])
                if room < n:
                    kept = 0 if whole else max(room, 0)
                    self.dropped += n - kept
                    q[H_MARKS_DROPPED] = self.dropped
                    n, parts = kept, parts[:kept]
                    if not n:
                        return
                write_ring(q, self.base, self.checks, self.cap, w, *parts)
                q[H_MARK_WRITE] = w + n
        except ValueError:  # the block was released by a concurrent close: nowhere to write
            self.dropped += n

    def publish_name(self, code: int, text: str) -> None:
        """Append name ``code`` (codes arrive in order 0, 1, 2, ...) to the names area."""
        data = text.encode("utf-8")[:4096]
        q, lay = self.block.q, self.block.layout
        with self._lock:
            if q[H_NAMES_COUNT] != code:
                return  # already published (a table re-installed on the same block)
            head = _NAME_HEAD.size
            if self._names_used + head + len(data) > NAMES_SIZE:
                # Full: the telemetry process stores "?" for this code. An empty entry keeps the
                # codes in order while one fits; after that none is published (nothing may be
                # written past the area: the figure slots follow it).
                self.overflow_names += 1
                if self._names_used + head > NAMES_SIZE:
                    return
                data = b""
            off = lay.names_offset + self._names_used
            entry = _NAME_HEAD.pack(len(data), name_check(code, data)) + data
            self.block.mm[off : off + len(entry)] = entry
            self._names_used += len(entry)
            q[H_NAMES_BYTES] = self._names_used
            q[H_NAMES_COUNT] = code + 1

    def request_figures(
        self, seq: int, t_begin_mono_ns: int, t_end_mono_ns: int, mask: int = NULL, batch: int = 1
    ) -> None:
        """Ask the telemetry process for the figures of one window (answered in slot ``seq``):
        those whose bit is set in ``mask`` (:func:`figure_mask`; NULL = every figure). ``batch``:
        the answer may wait until that many requests can be answered together (the collector's
        ``serve`` says how long at most)."""
        record = figure_request_record(FigureRequest(seq, t_begin_mono_ns, t_end_mono_ns, mask, batch))
        self._write(1, (record,), whole=True)


def name_check(code: int, data: bytes) -> int:
    """A names entry's check word: CRC-32 of its code (u32) and its UTF-8 text."""
    return zlib.crc32(data, zlib.crc32(struct.pack("<I", code & 0xFFFFFFFF)))


def read_names(block: Block, known: list[str]) -> bool:
    """Extend ``known`` with the names published since (the telemetry process's side); True if
    it now holds every name the block counts, False if an entry is not visible whole yet (its
    check fails: read again later)."""
    q, lay = block.q, block.layout
    count = q[H_NAMES_COUNT]
    if count <= len(known):
        return True
    off, head = lay.names_offset, _NAME_HEAD.size
    pos, i = 0, 0
    while i < count and pos + head <= NAMES_SIZE:
        n, check = _NAME_HEAD.unpack_from(block.mm, off + pos)
        if i >= len(known):
            data = bytes(block.mm[off + pos + head : off + pos + head + n])
            if pos + head + n > NAMES_SIZE or check != name_check(i, data):
                return False
            known.append(data.decode("utf-8", "replace") or "?")
        pos += head + n
        i += 1
    return len(known) >= count


# -- figure slots (telemetry process -> training process) ------------------------------------------


@functools.cache
def _slot_struct(n_devices: int, n_columns: int) -> struct.Struct:
    """A figure slot's head and ``n_devices`` devices of ``n_columns`` figures."""
    return struct.Struct("<4q" + ("q" + "d" * n_columns) * n_devices)


def write_figures(
    block: Block, seq: int, t_begin: int, t_end: int, per_device: list[tuple[int, list[float]]]
) -> None:
    """Publish the figures of request ``seq`` into its slot, its check word last (module doc)."""
    lay = block.layout
    n = min(len(per_device), lay.n_devices)
    words: list[float] = [seq + 1, t_begin, t_end, n]  # ints too: struct packs each by its code
    for idx, values in per_device[:n]:
        words.append(idx)
        words.extend(values)
    slot = _slot_struct(n, lay.n_fig_columns).pack(*words)
    slot += bytes((lay.slot_words - 1) * 8 - len(slot))  # unused devices: zeros, checked too
    off = (lay.figs0 + (seq % lay.fig_slots) * lay.slot_words) * 8
    block.mm[off : off + len(slot) + 8] = slot + _CHECK.pack(zlib.crc32(slot))


_CHECK = struct.Struct("<q")


def read_figures(block: Block, seq: int) -> tuple[int, int, list[tuple[int, list[float]]]] | None:
    """(t_begin, t_end, [(device index, values)]) of request ``seq``, or None while its slot does
    not hold it whole (not computed yet, being rewritten, or reused by a later request)."""
    lay = block.layout
    words = lay.slot_words
    base = lay.figs0 + (seq % lay.fig_slots) * words
    if block.q[base] != seq + 1:  # the common "not yet": no copy
        return None
    slot = block.mm[base * 8 : (base + words) * 8]  # one copy: everything below reads it
    if _CHECK.unpack_from(slot, (words - 1) * 8)[0] != zlib.crc32(slot[:-8]):
        return None
    first, t0, t1, n = struct.unpack_from("<4q", slot)
    if first != seq + 1 or not 0 <= n <= lay.n_devices:
        return None
    values = _slot_struct(n, lay.n_fig_columns).unpack_from(slot)
    per = 1 + lay.n_fig_columns
    return (
        t0,
        t1,
        [(values[i], list(values[i + 1 : i + per])) for i in range(FIG_HEAD, FIG_HEAD + n * per, per)],
    )
