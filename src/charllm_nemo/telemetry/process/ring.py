"""The shared-memory block between a training process and its telemetry process.

One POSIX shared-memory block per rank (``/dev/shm/charllm-sampler-<pid>-<hex>``), made the way
``multiprocessing.shared_memory`` makes its blocks, with its ``_posixshmem`` module
(telemetry/process/parent.py says why not its class). Every field is an aligned int64 or
float64 (``q[i]`` = int64 word i, ``d[i]`` = float64 word i), in this order:

* **header**, 128 words: magic, sizes, the sample ring's write counter, the process state and
  stop request, start-up timestamps, the sampler's health counters, the synthetic device's
  activity level (float64, NaN = no mark yet), the mark ring's counters and the store's counts
  (``H_*`` below);
* **message**, 1 KiB UTF-8: why the telemetry process stopped (a crash, a backend that would not
  open);
* **sample ring**, column-major, ``capacity`` rows: int64 columns ``t_mono_ns``, ``t_wall_ns``,
  ``read_ns``, ``device_index`` and every int metric (null = INT_NULL), then one float64 column
  per float metric (null = NaN), then one check word per row (:func:`row_check`: its index
  and a CRC-32 of its values). 64-bit counters stay int64 end to end. Written by the sampling
  loop only;
* **mark ring**, ``mark_capacity`` records of RECORD_LEN int64 words (telemetry/windows.py):
  finished windows, figure requests and step logs, written by the training process only; then
  one check word per record; then the **names**, 16 KiB; then the **figure slots**, written by
  the telemetry process only (telemetry/process/mark_ring.py: their layout and how they are
  read).

Ordering. The sample ring's writer (the sampling loop) and reader (the collector) are threads of
one process, the telemetry process: every access of either is made holding CPython's GIL, whose
hand-over is a pthread mutex / condition variable, and POSIX (Base Definitions 4.12, "Memory
Synchronization") makes mutex lock and unlock synchronize memory. So a row's stores happen
before the collector's loads of any counter that covers it, on x86-64 and aarch64 alike; the
row order within one thread is program order. The training process reads the ring too (a
session's ``live_rows``: parent.py's ``peek_rows``): there no lock orders anything, so each row
carries a check word, written with it, that the reader recomputes from its copy
(:func:`copy_rows`), taking a row only if they match, as mark_ring.py's module doc explains.
The header's statistics (health, store counts)
are single aligned 8-byte words read by the other process as single values: CPython's
memoryview reads and writes an int64 / float64 item with a fixed-size 8-byte memcpy, which
compilers emit as one ``mov`` / ``ldr`` / ``str``, single-copy atomic for aligned 8-byte
accesses on both x86-64 and ARMv8 (Arm ARM B2.2.1); no payload hangs on them. A parent that
reads the rings after its telemetry process died (collector.salvage) does so after ``waitpid``
or ``kill(pid, 0)`` reported the death: the kernel's exit path holds the locks wait takes, so
every store of the dead process is visible. The two rings that cross processes with a payload
(the mark ring and the figure slots) do not rely on store order at all: mark_ring.py.

This module imports only the standard library and the package's light modules, so that the
telemetry process starts sampling before it imports numpy or pyarrow.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import mmap
import os
import re
import secrets
import struct
import zlib
from dataclasses import dataclass
from typing import Any, NamedTuple

from charllm_nemo.telemetry.sample_loop import Row
from charllm_nemo.telemetry.schema import FLOAT_METRICS, INT_METRICS, INT_NULL, METRIC_INDEX, METRICS
from charllm_nemo.telemetry.windows import RECORD_LEN

MAGIC = 0x636C6D2D72696E67  # "clm-ring"

# -- header words --------------------------------------------------------------------------------
(H_MAGIC, H_CAPACITY, H_N_INT, H_N_FLOAT, H_WRITE_COUNT, H_STATE, H_STOP, H_PID) = range(8)
(H_T_SPAWNED, H_T_MAIN, H_T_IMPORTED, H_T_OPENED, H_STOP_CODE, H_MSG_LEN) = range(8, 14)
H_HEALTH = 16  # .. 27: HEALTH_FIELDS
HEALTH_FIELDS = (
    "started_mono_ns",
    "stopped_mono_ns",
    "samples",
    "slots",
    "on_time",
    "deadlines_missed",
    "late_max_ns",
    "read_ns_total",
    "read_ns_max",
    "devices_lost",
    "errors",
    "counter_every",
)
D_ACTIVITY = 40  # float64: the synthetic activity level the training process's marks set
D_EXPORT_RATES = 41  # .. 43, float64: tokens per step, FLOPs per step per device, peak FLOP/s per
# device, published once by the training process for the live exporter (0: unknown)
# The mark ring and the names (written by the training process).
H_MARK_WRITE = 48  # records written
H_MARKS_DROPPED = 49  # records the training process dropped because the ring was full
H_NAMES_COUNT = 50  # names published
H_NAMES_BYTES = 51  # bytes of the names area used
# The store (written by the telemetry process).
H_SVC_STATE = 56  # SVC_* below
H_SAMPLES_FLUSHED = 57  # sample-ring index up to which samples are on disk
H_MARKS_FLUSHED = 58  # mark-ring index up to which records are on disk (or served)
H_SEG_SAMPLES = 59  # next samples segment number
H_SEG_WINDOWS = 60  # next windows segment number
H_ROWS_SAMPLES = 61
H_ROWS_WINDOWS = 62
H_BYTES = 63
H_FLUSHES = 64
H_FLUSH_ERRORS = 65
H_FLUSH_NS_MAX = 66
H_FIGURES_SERVED = 67
H_ROWS_LOST = 68  # sample rows the store's reader lost (lapped by the sampling loop)
# A flush's intent, written before its segment: the ring index it stores up to and the segment
# number that follows it. Once H_SEG_* equals that number the segment is on disk, and a salvage
# takes the index from here even if H_*_FLUSHED never followed (see collector.salvage).
H_PENDING_SAMPLES = 69
H_PENDING_SAMPLES_SEG = 70
H_PENDING_MARKS = 71
H_PENDING_WINDOWS_SEG = 72
# The first reading's time of the newest complete sampling slot: every device still sampled has a
# ring row at or after it (0: no slot reported, rows written by something else).
H_SLOT_T = 73
# The store hit a full disk (1) and stopped writing; the rows it did not write since.
H_DISK_FULL = 74
H_ROWS_UNWRITTEN_SAMPLES = 75
H_ROWS_UNWRITTEN_WINDOWS = 76


class StoreWords(NamedTuple):
    """The header words of one kind of store segment (``samples`` or ``windows``)."""

    seg: int  # next segment number
    rows: int  # rows written
    rows_unwritten: int  # rows not written after a full disk
    flushed: int  # ring index up to which this kind is on disk
    pending: int  # a flush's intent: the ring index it stores up to ...
    pending_seg: int  # ... and the segment number that follows it


STORE_WORDS: dict[str, StoreWords] = {
    "samples": StoreWords(
        H_SEG_SAMPLES,
        H_ROWS_SAMPLES,
        H_ROWS_UNWRITTEN_SAMPLES,
        H_SAMPLES_FLUSHED,
        H_PENDING_SAMPLES,
        H_PENDING_SAMPLES_SEG,
    ),
    "windows": StoreWords(
        H_SEG_WINDOWS,
        H_ROWS_WINDOWS,
        H_ROWS_UNWRITTEN_WINDOWS,
        H_MARKS_FLUSHED,
        H_PENDING_MARKS,
        H_PENDING_WINDOWS_SEG,
    ),
}
"""The store's words per segment kind, by name (the collector's, written by the telemetry process)."""
COLLECTOR_COUNTERS: dict[str, int] = {
    "flushes": H_FLUSHES,
    "flush_errors": H_FLUSH_ERRORS,
    "flush_ns_max": H_FLUSH_NS_MAX,
    "figures_served": H_FIGURES_SERVED,
    "rows_lost": H_ROWS_LOST,
}
"""The collector's own counters: its attribute names and their header words."""


def read_store_counts(q: memoryview) -> dict[str, Any]:
    """The store's counts as the header holds them, in ``SegmentWriter.counts()``'s shape
    (``rows_unwritten`` and ``disk_full`` only after a full disk)."""
    counts: dict[str, Any] = {
        "segments": {kind: q[w.seg] for kind, w in STORE_WORDS.items()},
        "rows": {kind: q[w.rows] for kind, w in STORE_WORDS.items()},
        "bytes_written": q[H_BYTES],
    }
    if q[H_DISK_FULL]:
        counts["rows_unwritten"] = {kind: q[w.rows_unwritten] for kind, w in STORE_WORDS.items()}
        counts["disk_full"] = True
    return counts


def write_store_counts(q: memoryview, counts: dict[str, Any]) -> None:
    """Publish ``SegmentWriter.counts()`` into the header (:func:`read_store_counts` reverses it)."""
    for kind, w in STORE_WORDS.items():
        q[w.seg], q[w.rows] = counts["segments"][kind], counts["rows"][kind]
    q[H_BYTES] = counts["bytes_written"]
    if counts.get("disk_full"):
        q[H_DISK_FULL] = 1
        for kind, w in STORE_WORDS.items():
            q[w.rows_unwritten] = counts["rows_unwritten"][kind]


# The sampling loop's null counts, one word per schema metric (SamplerHealth.nulls).
H_NULLS0 = 80
HEADER_WORDS = 128
assert H_NULLS0 + len(METRICS) <= HEADER_WORDS, "the header has no room for a null count per metric"

MSG_OFFSET = HEADER_WORDS * 8
MSG_SIZE = 1024
NAMES_SIZE = 16 * 1024

# H_STATE: the sampling loop.
STARTING, RUNNING, STOPPED, FAILED = 0, 1, 2, 3
# H_SVC_STATE: the store and figures service (0: not started yet).
SVC_NONE, SVC_STARTING, SVC_RUNNING, SVC_DONE, SVC_FAILED = 0, 1, 2, 3, 4

INT_COLUMNS: tuple[str, ...] = ("t_mono_ns", "t_wall_ns", "read_ns", "device_index", *INT_METRICS)
FLOAT_COLUMNS: tuple[str, ...] = FLOAT_METRICS
INT_METRIC_POS = tuple(METRIC_INDEX[m] for m in INT_METRICS)
FLOAT_METRIC_POS = tuple(METRIC_INDEX[m] for m in FLOAT_METRICS)
N_INT, N_FLOAT = len(INT_COLUMNS), len(FLOAT_COLUMNS)

FIG_HEAD = 4  # seq + 1, t_begin, t_end, n_devices; a slot ends with a check word (mark_ring.py)


# A memoryview cast to "d": typeshed's memoryview.__setitem__ accepts only ints, so it is Any here.
FloatView = Any


@dataclass(frozen=True)
class Layout:
    """Sizes of the block's parts (in rows, records, slots) and the word offsets they give
    (worked out once: the training thread reads a figure slot's offset every step)."""

    capacity: int
    mark_capacity: int = 0
    fig_slots: int = 0
    n_devices: int = 1
    n_fig_columns: int = 0

    @functools.cached_property
    def ring0(self) -> int:
        return (MSG_OFFSET + MSG_SIZE) // 8

    def int_base(self, column: int) -> int:
        return self.ring0 + column * self.capacity

    def float_base(self, column: int) -> int:
        return self.ring0 + (N_INT + column) * self.capacity

    @functools.cached_property
    def row_checks0(self) -> int:
        """Word offset of the sample ring's check column (one word per row: :func:`row_check`)."""
        return self.ring0 + (N_INT + N_FLOAT) * self.capacity

    @functools.cached_property
    def marks0(self) -> int:
        return self.row_checks0 + self.capacity

    @functools.cached_property
    def checks0(self) -> int:
        """Word offset of the mark ring's check words (one per record: mark_ring.stamp)."""
        return self.marks0 + RECORD_LEN * self.mark_capacity

    @functools.cached_property
    def names_offset(self) -> int:
        """Byte offset of the names area."""
        return (self.checks0 + self.mark_capacity) * 8

    @functools.cached_property
    def slot_words(self) -> int:
        return FIG_HEAD + self.n_devices * (1 + self.n_fig_columns) + 1

    @functools.cached_property
    def figs0(self) -> int:
        return (self.names_offset + (NAMES_SIZE if self.mark_capacity else 0)) // 8

    @functools.cached_property
    def size(self) -> int:
        """Bytes of the whole block."""
        return (self.figs0 + self.fig_slots * self.slot_words) * 8


class Block:
    """An open block: the mmap and its int64 / float64 views."""

    def __init__(self, mm: mmap.mmap, layout: Layout) -> None:
        self.mm = mm
        self.layout = layout
        self.q: memoryview = memoryview(mm).cast("q")
        self.d: FloatView = memoryview(mm).cast("d")

    def close(self) -> None:
        self.q.release()
        self.d.release()
        self.mm.close()

    def message(self) -> str:
        n = self.q[H_MSG_LEN]
        return self.mm[MSG_OFFSET : MSG_OFFSET + n].decode("utf-8", "replace")

    def set_message(self, text: str) -> None:
        msg = text.encode("utf-8", "replace")[:MSG_SIZE]
        self.mm[MSG_OFFSET : MSG_OFFSET + len(msg)] = msg
        self.q[H_MSG_LEN] = len(msg)


def _posixshmem() -> Any:
    # The C module multiprocessing.shared_memory is built on (it has no type stubs).
    return importlib.import_module("_posixshmem")


# MAP_POPULATE: the block's pages are allocated and mapped when it is mapped, in each process.
# Otherwise the first write to each 4 KiB page of the mark ring faults, on the training thread
# inside end_step: with ~700 bytes per tiny_gpt step, one step in five paid ~35 µs for it, for
# the first ~3000 steps (docs/bench-train.md).
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def create(name: str, layout: Layout) -> Block:
    """Create a zero-filled block (state STARTING, counters 0) with its header sizes set."""
    fd = _posixshmem().shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, layout.size)
        mm = mmap.mmap(fd, layout.size, flags=_MAP_FLAGS)
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(fd)
    block = Block(mm, layout)
    q = block.q
    q[H_MAGIC], q[H_CAPACITY], q[H_N_INT], q[H_N_FLOAT] = MAGIC, layout.capacity, N_INT, N_FLOAT
    block.d[D_ACTIVITY] = math.nan
    return block


def attach(name: str, layout: Layout) -> Block:
    fd = _posixshmem().shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size, flags=_MAP_FLAGS)
    finally:
        os.close(fd)
    block = Block(mm, layout)
    if block.q[H_MAGIC] != MAGIC or block.q[H_CAPACITY] != layout.capacity or len(mm) != layout.size:
        block.close()
        raise ValueError(f"shared block {name} does not have the layout {layout}")
    return block


def unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _posixshmem().shm_unlink("/" + name)


SHM_DIR = "/dev/shm"
BLOCK_PREFIX = "charllm-sampler-"
_BLOCK_NAME = re.compile(re.escape(BLOCK_PREFIX) + r"(\d+)-[0-9a-f]+")


def block_name(owner_pid: int) -> str:
    """A new block's name: ``charllm-sampler-<training process pid>-<8 hex digits>``."""
    return f"{BLOCK_PREFIX}{owner_pid}-{secrets.token_hex(4)}"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a killed process whose parent died
    too may stay a zombie where nothing reaps orphans, e.g. a container without an init)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def sweep_stale() -> list[str]:
    """Unlink this user's blocks that nobody will unlink: those whose training process (the pid
    in the name) and telemetry process (the header's ``H_PID``, 0 until it started) are both
    gone, which happens only when both died by SIGKILL at once (a cgroup kill). Each such block
    would otherwise hold its size of RAM in the tmpfs until the node reboots. Returns the names
    removed. A process that still maps a block keeps its mapping when the name goes, so even a
    misjudged block (a pid namespace that hides a live owner) loses nothing once its telemetry
    process has attached."""
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return []
    uid, removed = os.getuid(), []
    for entry in entries:
        m = _BLOCK_NAME.fullmatch(entry)
        if m is None or _alive(int(m.group(1))):
            continue
        path = os.path.join(SHM_DIR, entry)
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_uid != uid:
                    continue
                head = f.read(8 * (H_PID + 1))
        except OSError:
            continue
        if len(head) == 8 * (H_PID + 1) and _alive(struct.unpack_from("<q", head, 8 * H_PID)[0]):
            continue
        unlink(entry)
        removed.append(entry)
    return removed


# -- the sample ring ------------------------------------------------------------------------------

_ROW = struct.Struct(f"<{N_INT}q{N_FLOAT}d")


def row_check(index: int, values: tuple[Any, ...]) -> int:
    """Ring row ``index``'s check word, from its stored values (INT_COLUMNS then FLOAT_COLUMNS,
    nulls as stored): ``(index + 1) mod 2**31`` in the high half, CRC-32 of the packed values
    in the low half (as mark_ring.stamp)."""
    return ((index + 1) & 0x7FFFFFFF) << 32 | zlib.crc32(_ROW.pack(*values))


class RingWriter:
    """Writes sampler rows into the ring, then publishes the write counter (the loop's ``emit``)."""

    def __init__(self, block: Block) -> None:
        lay = block.layout
        self.q, self.d, self.cap = block.q, block.d, lay.capacity
        self.n = 0
        self.bases = tuple(lay.int_base(c) for c in range(4))
        self.ints = tuple((lay.int_base(4 + j), pos) for j, pos in enumerate(INT_METRIC_POS))
        self.floats = tuple((lay.float_base(j), pos) for j, pos in enumerate(FLOAT_METRIC_POS))
        self.bad_values = 0
        self.checks = lay.row_checks0

    def emit(self, row: Row) -> None:
        t0, tw, dt, idx, reading = row
        q, d = self.q, self.d
        slot = self.n % self.cap
        b0, b1, b2, b3 = self.bases
        q[b0 + slot] = t0
        q[b1 + slot] = tw
        q[b2 + slot] = dt
        q[b3 + slot] = idx
        stored: list[Any] = [t0, tw, dt, idx]  # what the row's check word is computed from
        keep = stored.append
        try:
            for base, pos in self.ints:
                v = reading[pos]
                q[base + slot] = v = INT_NULL if v is None else v
                keep(v)
            for base, pos in self.floats:
                v = reading[pos]
                d[base + slot] = v = math.nan if v is None else v
                keep(v)
            check = ((self.n + 1) & 0x7FFFFFFF) << 32 | zlib.crc32(_ROW.pack(*stored))
        except (TypeError, ValueError, OverflowError, struct.error):
            check = self._coerce(reading, slot)
        q[self.checks + slot] = check
        self.n += 1
        q[H_WRITE_COUNT] = self.n  # publish after the row (the order matters only on x86-64)

    def _coerce(self, reading: tuple[Any, ...], slot: int) -> int:
        """A backend returned a value of the wrong type: convert what converts, null the rest;
        returns the row's check word, from what was stored."""
        for base, pos in self.ints:
            try:
                self.q[base + slot] = INT_NULL if reading[pos] is None else int(reading[pos])
            except (TypeError, ValueError, OverflowError):
                self.q[base + slot] = INT_NULL
                self.bad_values += 1
        for base, pos in self.floats:
            try:
                self.d[base + slot] = math.nan if reading[pos] is None else float(reading[pos])
            except (TypeError, ValueError, OverflowError):
                self.d[base + slot] = math.nan
                self.bad_values += 1
        stored = [self.q[base + slot] for base in self.bases]
        stored += [self.q[base + slot] for base, _ in self.ints] + [
            self.d[base + slot] for base, _ in self.floats
        ]
        return row_check(self.n, tuple(stored))


def newest_t(block: Block) -> int:
    """``t_mono_ns`` of the newest row in the ring (0 while it is empty)."""
    w = block.q[H_WRITE_COUNT]
    if w == 0:
        return 0
    lay = block.layout
    t: int = block.q[lay.int_base(0) + (w - 1) % lay.capacity]
    return t


def ring_span(block: Block, first: int) -> tuple[int, int, int]:
    """(first, end, lost): the ring indices readable from ``first`` up to the write counter now,
    moved past rows already overwritten (``lost`` of them)."""
    cap = block.layout.capacity
    end = block.q[H_WRITE_COUNT]
    lost = 0
    if end - first > cap:
        lost = end - cap - first
        first = end - cap
    return first, end, lost


def still_valid(block: Block, first: int, n: int) -> int:
    """How many of the ``n`` rows copied from ``first`` the writer cannot have overwritten while
    they were copied (the slot of row i is reused by row i + capacity)."""
    oldest_safe = block.q[H_WRITE_COUNT] - block.layout.capacity + 1
    return n - min(max(oldest_safe - first, 0), n)


def _column(view: Any, base: int, cap: int, first: int, n: int) -> list[Any]:
    lo = first % cap
    split = min(n, cap - lo)
    values: list[Any] = view[base + lo : base + lo + split].tolist()
    if split < n:
        values += view[base : base + n - split].tolist()
    return values


def copy_rows(block: Block, first: int, end: int) -> tuple[list[Row], list[bool]]:
    """Rows ``first`` .. ``end`` of the ring as sampler rows (None for null), and for each
    whether its check word matches what was copied (False: not visible whole yet, or being
    overwritten: a reader in another process must not take it; module doc)."""
    n = end - first
    if n <= 0:
        return [], []
    lay, q, d = block.layout, block.q, block.d
    cap = lay.capacity
    ints = [_column(q, lay.int_base(c), cap, first, n) for c in range(N_INT)]
    floats = [_column(d, lay.float_base(j), cap, first, n) for j in range(N_FLOAT)]
    checks = _column(q, lay.row_checks0, cap, first, n)
    ok = [row_check(first + k, raw) == checks[k] for k, raw in enumerate(zip(*ints, *floats, strict=True))]
    metrics: list[list[Any]] = [[]] * len(METRICS)
    for j, pos in enumerate(INT_METRIC_POS):
        metrics[pos] = [None if v == INT_NULL else v for v in ints[4 + j]]
    for j, pos in enumerate(FLOAT_METRIC_POS):
        metrics[pos] = [None if v != v else v for v in floats[j]]
    readings = list(zip(*metrics, strict=True))
    return list(zip(*ints[:4], readings, strict=True)), ok
