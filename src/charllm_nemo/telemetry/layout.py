"""What a run directory holds, read as untrusted input: the one place that finds its files.

A run directory may come from another user, a shared file system or an archive, so nothing in
it is taken on trust (docs/store.md, "What a reader accepts and rejects"):

* only the documented names are accepted: rank folders ``rank=<N>`` with ``N`` written the way
  the writer writes it (``rank=0``, ``rank=12``; never ``rank=00``), segments
  ``samples-NNNNNN.parquet`` / ``windows-NNNNNN.parquet`` (six digits, or more without a
  leading zero), ``manifest.json``, and at the top ``config.yaml``, ``steps.jsonl``,
  ``summary.json``, ``alerts.jsonl``;
* no symbolic link is followed, anywhere: a rank folder linked to another run, or a segment
  linked to a file outside the run, would mix foreign data into this one;
* only regular files are read (a FIFO would block a reader forever, ``/dev/zero`` would never
  end), opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat`` on the open file, so
  a file swapped for a link or a FIFO after the scan is refused too;
* every read is bounded by a size cap per kind of file (:data:`SIZE_CAPS`).

Whatever is not accepted is listed in :attr:`RunFiles.ignored` with the reason; readers report
it (writers' dot-prefixed temporaries are listed too, as ``temporary``, and not reported).
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from charllm_nemo.errors import StoreError

MiB = 2**20

SIZE_CAPS: dict[str, int] = {
    "manifest": 16 * MiB,
    "summary": 256 * MiB,
    "steps": 4096 * MiB,
    "config": 16 * MiB,
    "segment": 1024 * MiB,
    "alerts": 64 * MiB,
    "table": 16384 * MiB,
}
"""Largest file, in bytes, a reader accepts of each kind. A manifest is a few KiB (its config
and argv included); ``summary.json`` grows by ~0.5 KiB per step; ``steps.jsonl`` is read line by
line (each line at most :data:`MAX_LINE_BYTES`); a segment holds half a second of samples; an alert's
line is ~1 KiB and the rate limit allows a few per rank and 100 steps; a ``table`` is the
``windows.parquet`` an analysis writes (tens of bytes per window, every window of a sweep)."""

MAX_SEGMENT_UNPACKED = 256 * MiB
"""Most bytes a segment's row groups (and any one column chunk) may unpack to, as its footer
states (a 0.5 s segment of 8 devices at 1 kHz is ~1 MiB): a 1.3 MB file can claim 2.4 GB."""

MAX_READ_UNPACKED = 2048 * MiB
"""Most bytes the files one read holds at once (a rank's segments of one kind, a compaction's
batch) may decode to, as their footers state, before :func:`read_budget` lowers it to
1/:data:`READ_MEMORY_SHARE` of the memory free (``CHARLLM_MAX_UNPACKED_BYTES`` sets it): six
small files that unpack to 200 MiB each passed the per-file cap and took a reader to
MemoryError, ``compact`` to bad_alloc. A compacted rank-hour (100 Hz, 8 devices) is ~0.5 GB."""

READ_MEMORY_SHARE = 16
"""Free memory over the read budget: ``charllm inspect`` peaked at 4.2 GB of RSS for 0.41 GB
decoded (measured here: the table, its arrays, the attribution's copies)."""

MAX_SEGMENT_ROWS = 4_000_000
"""Most rows a segment may hold, as its footer states (0.5 s of 8 devices at 1 kHz is 4,000;
a driver-buffered segment a few times that)."""

MAX_LINE_BYTES = 1 * MiB
"""Longest ``steps.jsonl`` line read, in bytes (a step's line is ~0.5 KiB)."""

TOP_FILES: dict[str, str] = {
    "config.yaml": "config",
    "steps.jsonl": "steps",
    "summary.json": "summary",
    "alerts.jsonl": "alerts",
}
"""Files at the top of a run directory that readers open, and their kind (for the size cap)."""

_RANK_NAME = re.compile(r"^rank=(0|[1-9][0-9]{0,8})$")
_RANK_LIKE = re.compile(r"^rank=")
_NUMBER = r"([0-9]{6}|[1-9][0-9]{6,17})"
_SEGMENT_NAME = re.compile(rf"^(samples|windows|buffered)-{_NUMBER}(?:-{_NUMBER})?\.parquet$")
"""A segment (``samples-000012.parquet``) or a compacted file of segments ``first..last``
(``samples-000000-000119.parquet``, telemetry/compact.py)."""
_TEMPORARY = re.compile(r"^\..*\.tmp$")
RESERVE_NAME = ".manifest.json.reserve"
"""telemetry.store.RESERVE_NAME: the hidden file an open rank folder holds (a normal part of a
running or killed writer's folder, like its temporaries)."""


class UnsafeFileError(StoreError):
    """A file a reader was asked to open is not a regular file inside the run, or is too large."""


@dataclass(frozen=True, slots=True)
class Ignored:
    """An entry of the run directory that no reader uses, and why (``kind``: ``temporary``,
    ``symlink``, ``not a regular file``, ``not a directory``, ``name``, ``unreadable``,
    ``superseded``: a segment whose rows a compacted file holds)."""

    path: Path
    kind: str
    reason: str

    def message(self) -> str:
        """``<path>: ignored: <reason>``, for a warning."""
        return f"{self.path}: ignored: {self.reason}"


@dataclass(frozen=True, slots=True)
class RankFiles:
    """One accepted rank folder: its manifest (None when absent or refused) and its segments,
    each list in sequence (write) order."""

    rank: int
    folder: Path
    manifest: Path | None
    samples: tuple[Path, ...]
    windows: tuple[Path, ...]
    buffered: tuple[Path, ...] = ()
    """``buffered-NNNNNN.parquet``: the driver-buffered timeline (telemetry/buffered.py)."""


@dataclass(frozen=True, slots=True)
class RunFiles:
    """Everything a reader may open in one run directory, and what it must not."""

    path: Path
    ranks: dict[int, RankFiles]
    config: Path | None = None
    steps: Path | None = None
    summary: Path | None = None
    alerts: Path | None = None
    ignored: tuple[Ignored, ...] = field(default=())

    @property
    def rank_ids(self) -> list[int]:
        """Accepted ranks, ascending."""
        return sorted(self.ranks)

    def problems(self) -> list[str]:
        """One line per ignored entry worth telling a person (temporaries are normal)."""
        return [i.message() for i in self.ignored if i.kind not in ("temporary", "superseded")]


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _file_kind(st: os.stat_result | None) -> tuple[str, str] | None:
    """None for a regular file; else (kind, reason) for the ignored list."""
    if st is None:
        return ("unreadable", "cannot be examined (removed while scanning?)")
    if stat.S_ISLNK(st.st_mode):
        return ("symlink", "is a symbolic link (readers follow no links: it could point outside the run)")
    if not stat.S_ISREG(st.st_mode):
        return ("not a regular file", "is not a regular file (a FIFO, device or folder is never read)")
    return None


def _scan_rank(folder: Path, rank: int, ignored: list[Ignored]) -> RankFiles:
    manifest: Path | None = None
    segments: dict[str, list[tuple[int, int, Path]]] = {"samples": [], "windows": [], "buffered": []}
    try:
        entries = sorted(os.listdir(folder))
    except OSError as exc:
        ignored.append(Ignored(folder, "unreadable", f"cannot be listed ({exc.strerror})"))
        entries = []
    for name in entries:
        p = folder / name
        if name == RESERVE_NAME:
            ignored.append(Ignored(p, "temporary", "space a writer holds back for its final manifest"))
            continue
        if _TEMPORARY.match(name):
            ignored.append(Ignored(p, "temporary", "a writer's temporary (being written, or left by a kill)"))
            continue
        m = _SEGMENT_NAME.match(name)
        if name != "manifest.json" and m is None:
            ignored.append(
                Ignored(
                    p,
                    "name",
                    "not a store file name (manifest.json, samples-NNNNNN.parquet, windows-NNNNNN.parquet, "
                    "buffered-NNNNNN.parquet)",
                )
            )
            continue
        bad = _file_kind(_lstat(p))
        if bad is not None:
            ignored.append(Ignored(p, *bad))
            continue
        if m is None:
            manifest = p
        else:
            first = int(m.group(2))
            segments[m.group(1)].append((first, int(m.group(3)) if m.group(3) else first, p))
    return RankFiles(
        rank,
        folder,
        manifest,
        _uncovered(segments["samples"], ignored),
        _uncovered(segments["windows"], ignored),
        _uncovered(segments["buffered"], ignored),
    )


def _uncovered(found: list[tuple[int, int, Path]], ignored: list[Ignored]) -> tuple[Path, ...]:
    """The files to read, in order: every segment and compacted file whose numbers no wider
    compacted file covers. A covered one is what an interrupted compaction (telemetry/compact.py)
    had not yet removed: its rows are in the wider file, so reading both would count them twice;
    it is listed as ``superseded``."""
    keep: list[tuple[int, int, Path]] = []
    # Widest first at each start, so a file is kept only when nothing kept already covers it.
    for first, last, p in sorted(found, key=lambda f: (f[0], -f[1])):
        cover = next((k for k in keep if k[0] <= first and last <= k[1]), None)
        if cover is not None:
            ignored.append(
                Ignored(p, "superseded", f"its rows are in {cover[2].name} (an interrupted compaction)")
            )
            continue
        keep.append((first, last, p))
    return tuple(p for _, _, p in keep)


def scan_run(path: str | os.PathLike[str]) -> RunFiles:
    """Find what a reader may open in the run directory ``path`` (the directory itself may be
    reached through a link; nothing inside it is). Raises StoreError when ``path`` is not a
    directory; a directory with no rank folder gives an empty ``ranks`` (callers that need one
    say so). Reads no file: only names and ``lstat``."""
    root = Path(path)
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise StoreError(f"run directory {root} {what}")
    ignored: list[Ignored] = []
    ranks: dict[int, RankFiles] = {}
    top: dict[str, Path | None] = dict.fromkeys(TOP_FILES.values())
    try:
        names = sorted(os.listdir(root))
    except OSError as exc:
        raise StoreError(f"run directory {root} cannot be listed: {exc.strerror}") from None
    for name in names:
        p = root / name
        if name in TOP_FILES:
            bad = _file_kind(_lstat(p))
            if bad is None:
                top[TOP_FILES[name]] = p
            else:
                ignored.append(Ignored(p, *bad))
            continue
        if not _RANK_LIKE.match(name):
            continue  # not ours to judge: logs/, a wandb/ folder, a user's notes
        m = _RANK_NAME.match(name)
        if m is None:
            ignored.append(
                Ignored(p, "name", "not a rank folder name (rank=N, N written without leading zeros)")
            )
            continue
        st = _lstat(p)
        if st is not None and stat.S_ISLNK(st.st_mode):
            ignored.append(
                Ignored(
                    p, "symlink", "is a symbolic link (a rank folder linked from elsewhere is another run's)"
                )
            )
            continue
        if st is None or not stat.S_ISDIR(st.st_mode):
            ignored.append(Ignored(p, "not a directory", "is not a directory"))
            continue
        ranks[int(m.group(1))] = _scan_rank(p, int(m.group(1)), ignored)
    return RunFiles(root, ranks, top["config"], top["steps"], top["summary"], top["alerts"], tuple(ignored))


# -- bounded reads ---------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / MiB:.3g} MiB"


def open_regular(path: Path, cap: int) -> IO[bytes]:
    """Open ``path`` for reading if it is a regular file (not a link, FIFO or device) of at most
    ``cap`` bytes; raises UnsafeFileError naming the file and why otherwise. Never blocks: a
    FIFO put in the file's place after a scan is refused, not opened for reading."""
    flags = (
        os.O_RDONLY
        | getattr(os, "O_NOFOLLOW", 0)
        | getattr(os, "O_NONBLOCK", 0)
        | getattr(os, "O_CLOEXEC", 0)
    )
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(f"{path}: is a symbolic link; not followed") from None
        raise UnsafeFileError(f"{path}: cannot be opened ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(f"{path}: is not a regular file; not read")
        if st.st_size > cap:
            raise UnsafeFileError(
                f"{path}: {st.st_size} bytes, over the {_mib(cap)} a reader accepts for this file; not read"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: Path, cap: int) -> bytes:
    """The bytes of regular file ``path``, at most ``cap`` (a file that grows past it while
    being read is refused: UnsafeFileError)."""
    with open_regular(path, cap) as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise UnsafeFileError(f"{path}: over the {_mib(cap)} a reader accepts for this file; not read")
    return data


def read_tail(path: Path, max_bytes: int) -> bytes:
    """The last ``max_bytes`` bytes of regular file ``path``, opened as :func:`open_regular` does
    (a log of any size: only its end is read)."""
    with open_regular(path, cap=2**62) as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - max_bytes))
        return f.read(max_bytes)


def _decode(data: bytes, path: Path, problems: list[str]) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        problems.append(
            f"{path}: bytes that are not UTF-8 (first at byte {exc.start}); read with them replaced"
        )
        return data.decode("utf-8", errors="replace")


def read_json(path: Path, cap: int, problems: list[str]) -> Any:
    """Parse the JSON file ``path`` (at most ``cap`` bytes). Returns None, with a line in
    ``problems`` naming the file and what is wrong, when it cannot be read or parsed."""
    try:
        data = read_bounded(path, cap)
    except UnsafeFileError as exc:
        problems.append(str(exc))
        return None
    return parse_json(data, path, problems)


def parse_json(data: bytes, path: Path, problems: list[str]) -> Any:
    """The JSON value of ``data`` read from ``path`` (bytes that are not UTF-8 replaced, said);
    None, with a line in ``problems`` naming the file, when it does not parse."""
    try:
        return json.loads(_decode(data, path, problems))
    except (ValueError, RecursionError) as exc:
        problems.append(f"{path}: not valid JSON ({type(exc).__name__}: {str(exc)[:200]})")
    return None


def iter_jsonl(path: Path, cap: int, problems: list[str]) -> Iterator[Any]:
    """The JSON value of each good line of ``path``, as :func:`iter_jsonl_numbered` reads them."""
    for _, value in iter_jsonl_numbered(path, cap, problems):
        yield value


def iter_jsonl_numbered(path: Path, cap: int, problems: list[str]) -> Iterator[tuple[int, Any]]:
    """(line number from 1, JSON value) of each non-blank line of ``path`` (at most ``cap``
    bytes, each line at most :data:`MAX_LINE_BYTES`). A line that does not parse, is too long
    or is not UTF-8 is skipped with a line in ``problems`` naming the file and the line number
    (a truncated last line, as a full disk or a kill leaves, says so)."""
    try:
        f = open_regular(path, cap)
    except UnsafeFileError as exc:
        problems.append(str(exc))
        return
    with f:
        total = 0
        lineno = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            lineno += 1
            total += len(raw)
            if total > cap:
                problems.append(
                    f"{path}: grew over the {_mib(cap)} a reader accepts; read up to line {lineno - 1}"
                )
                return
            if len(raw) > MAX_LINE_BYTES:
                problems.append(f"{path}:{lineno}: line over {_mib(MAX_LINE_BYTES)} skipped")
                while raw and not raw.endswith(b"\n"):  # skip the rest of the line, boundedly
                    raw = f.readline(MAX_LINE_BYTES + 1)
                    total += len(raw)
                    if total > cap:
                        return
                continue
            if not raw.strip():
                continue
            last = not raw.endswith(b"\n")
            try:
                yield lineno, json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                problems.append(f"{path}:{lineno}: bytes that are not UTF-8 (at byte {exc.start}); skipped")
            except (ValueError, RecursionError) as exc:
                why = "truncated last line" if last else f"not valid JSON ({type(exc).__name__})"
                problems.append(f"{path}:{lineno}: {why}; skipped")


def _fd_path(fd: int) -> str:
    """A path naming the open file ``fd`` itself (Linux ``/proc/self/fd``, else ``/dev/fd``): opening
    it gives the same file, whatever its name now points to."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(folder):
            return f"{folder}/{fd}"
    raise StoreError("this system has neither /proc/self/fd nor /dev/fd: Parquet files cannot be read safely")


@contextmanager
def open_parquet(path: Path, cap: int) -> Iterator[Any]:
    """``path`` as a ``pyarrow.parquet.ParquetFile``, opened as :func:`open_regular` does.

    Arrow reads it through a file of its own opened on the checked file descriptor, never through
    the Python file object: given one, Arrow's I/O and CPU pool threads hold buffers owned by
    Python, and one released on such a thread after the interpreter began to exit aborts the
    process ("terminate called without an active exception", SIGABRT) after a run had printed
    all it had to. Seen in CI; here in 2 of 67 runs of ``charllm telemetry --sampler thread``
    four at once (0 of 200 with this). A native file keeps Arrow's threads: a 32 MiB file read
    1.7x faster on 2 cores than on the caller's thread alone (the other way to avoid the crash)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open_regular(path, cap) as f, pa.OSFile(_fd_path(f.fileno()), "rb") as native:
        yield pq.ParquetFile(native)


def _free_memory() -> int | None:
    """Bytes of memory this process may still take: MemAvailable, or the address-space limit
    (``ulimit -v``) if lower; None when neither is known."""
    free: list[int] = []
    try:
        with open_regular(Path("/proc/meminfo"), cap=1 * MiB) as f:  # a kernel file: tiny
            for line in f.read().decode("ascii", "replace").splitlines():
                if line.startswith("MemAvailable:"):
                    free.append(int(line.split()[1]) * 1024)
    except (UnsafeFileError, OSError, ValueError, IndexError):
        pass
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            free.append(soft)
    except (ImportError, OSError, ValueError):
        pass
    return min(free) if free else None


def read_budget() -> int:
    """Bytes one read may decode (:data:`MAX_READ_UNPACKED`, at most 1/:data:`READ_MEMORY_SHARE`
    of the memory free: the decoded table is copied again into arrays and the attribution's
    tables); ``CHARLLM_MAX_UNPACKED_BYTES`` in the environment sets it instead."""
    env = os.environ.get("CHARLLM_MAX_UNPACKED_BYTES", "").strip()
    if env:
        try:
            return max(int(env), 0)
        except ValueError:
            raise StoreError(
                f"CHARLLM_MAX_UNPACKED_BYTES={env!r} is not a number of bytes; e.g. 4294967296"
            ) from None
    free = _free_memory()
    return MAX_READ_UNPACKED if free is None else min(MAX_READ_UNPACKED, free // READ_MEMORY_SHARE)


class UnpackBudget:
    """What one read (the files it holds at once) may still decode, in bytes (:func:`read_budget`);
    :meth:`take` refuses a file that would go over it, before decoding anything."""

    def __init__(self, total: int | None = None) -> None:
        self.total = read_budget() if total is None else total
        self.left = self.total

    def take(self, path: Path, unpacked: int) -> None:
        """Count ``unpacked`` bytes of ``path`` (UnsafeFileError when over what is left)."""
        if unpacked > self.left:
            raise UnsafeFileError(
                f"{path}: its row groups unpack to {unpacked} bytes and the files read with it already "
                f"to {self.total - self.left}, over the {_mib(self.total)} one read may decode "
                f"(1/{READ_MEMORY_SHARE} of the free memory; CHARLLM_MAX_UNPACKED_BYTES sets it); not read"
            )
        self.left -= unpacked


def footer_unpacked(meta: Any) -> int:
    """Bytes a Parquet file's row groups decode to, by its footer: per row group the larger of
    its stated size and, per column, its chunk's uncompressed size or rows x the width of a
    fixed-width type (a run-length or dictionary page of zeros states a few bytes and decodes to
    8 a row)."""
    total = 0
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        cols = 0
        for j in range(rg.num_columns):
            col = rg.column(j)
            width = _PHYSICAL_WIDTH.get(col.physical_type, 0)
            cols += max(col.total_uncompressed_size, rg.num_rows * width, 0)
        total += max(rg.total_byte_size, cols, 0)
    return total


_PHYSICAL_WIDTH = {"BOOLEAN": 1, "INT32": 4, "INT64": 8, "INT96": 12, "FLOAT": 4, "DOUBLE": 8}
"""Bytes a value of each fixed-width Parquet physical type takes decoded (Arrow's widths)."""


def read_parquet(
    path: Path,
    columns: list[str] | None = None,
    cap: int = SIZE_CAPS["segment"],
    missing_ok: bool = False,
    budget: UnpackBudget | None = None,
    null_ok: Callable[[str, Any], bool] | None = None,
) -> Any:
    """A segment as a ``pyarrow.Table`` (``columns``: only those; ``missing_ok``: those of them
    the file has; ``null_ok(name, arrow type)``: true for a column that may be left out when the
    footer's statistics say every value of it is null, as most metric columns of a backend
    without them are: not decoded, absent from the table), opened as :func:`open_parquet` does.
    Raises UnsafeFileError for a file that is not a regular one, too large, or whose footer says
    it holds more than
    :data:`MAX_SEGMENT_ROWS` rows or unpacks to more than :data:`MAX_SEGMENT_UNPACKED` bytes (a
    decompression bomb: checked before anything is decompressed), or over what ``budget`` has
    left (the files of one read together); pyarrow's own errors for a damaged one."""
    with open_parquet(path, cap) as pf:  # the footer, parsed once: checked, then used to read
        meta = pf.metadata
        if meta.num_rows > MAX_SEGMENT_ROWS or meta.num_rows < 0:
            raise UnsafeFileError(
                f"{path}: its footer claims {meta.num_rows} rows, over the {MAX_SEGMENT_ROWS} a reader "
                "accepts for a segment; not read"
            )
        groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
        unpacked = sum(max(rg.total_byte_size, 0) for rg in groups)
        # A footer's row-group total may understate its chunks: the largest chunk counts too.
        chunks = (rg.column(j).total_uncompressed_size for rg in groups for j in range(rg.num_columns))
        unpacked = max(unpacked, max(chunks, default=0))
        if unpacked > MAX_SEGMENT_UNPACKED:
            raise UnsafeFileError(
                f"{path}: its row groups unpack to {unpacked} bytes, over the "
                f"{_mib(MAX_SEGMENT_UNPACKED)} a reader accepts for a segment; not read"
            )
        if budget is not None:
            budget.take(path, footer_unpacked(meta))
        if columns is not None and missing_ok:
            have = set(pf.schema_arrow.names)
            columns = [c for c in columns if c in have]
        if columns is not None and null_ok is not None:
            columns = _not_all_null(pf, meta, columns, null_ok)
        return pf.read(columns=columns)


def _not_all_null(pf: Any, meta: Any, columns: list[str], null_ok: Callable[[str, Any], bool]) -> list[str]:
    """``columns`` less those ``null_ok`` accepts whose every row group's statistics count as
    many nulls as rows (a column without statistics is kept)."""
    arrow = pf.schema_arrow
    index = (
        {meta.row_group(0).column(j).path_in_schema: j for j in range(meta.num_columns)}
        if meta.num_row_groups
        else {}
    )
    groups = [meta.row_group(i) for i in range(meta.num_row_groups)]

    def all_null(name: str) -> bool:
        j = index.get(name)
        if j is None or name not in arrow.names or not null_ok(name, arrow.field(name).type):
            return False
        for rg in groups:
            st = rg.column(j).statistics
            if st is None or not st.has_null_count or st.null_count != rg.num_rows:
                return False
        return True

    return [c for c in columns if not all_null(c)]
