"""Every file the tool writes, written without following a link: the write side of :mod:`.layout`.

A run directory may be another user's (a shared file system, an archive), and ``charllm analyze``
writes into it (``RUN/analysis/`` by default). A writer that opens ``problems.txt`` by name would
follow a link planted there and overwrite whatever it points to (a shell start-up file) with text
read from the run. So every writer goes through this module:

* the output directory is created if missing and then opened with ``O_DIRECTORY | O_NOFOLLOW``:
  an output directory that is itself a link is refused (:class:`~charllm_nemo.errors.StoreError`);
* a file is written into a temporary ``.<name>.tmp`` in that directory, created with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` relative to the directory's descriptor (a leftover temporary,
  or a link planted under its name, is unlinked first, never followed), then renamed over
  ``<name>``: the rename replaces a link at ``<name>`` itself, never what it points to, and a
  reader sees the old file or the new one, never half of one;
* names are single path components (no ``/``, no ``..``): nothing lands outside the directory;
* every directory below a run folder (or an output folder) that a writer creates or enters is
  opened component by component from that folder's descriptor with ``O_NOFOLLOW``
  (:func:`anchor` names such folders; :func:`open_dir`): a link planted at ``RUN/logs`` or
  ``RUN/analysis`` is refused, not followed, whichever file is written into it first. Above the
  anchor the path is the user's own (``/scratch`` may be a link);
* a name that exists and is not a regular file is never renamed over: a FIFO, a terminal or
  ``/dev/null`` / ``/dev/full`` / ``/dev/zero`` (directly or through a link, as ``/dev/stdout``
  is) is written to as a stream, in place; any other device, a socket or a directory is refused
  (:class:`~charllm_nemo.errors.StoreError`). Run as root, a rename would have put a regular
  file in place of ``/dev/null``;
* a write that fails removes its temporary; one that hit a limit of the file system (ENOSPC,
  EDQUOT, EFBIG: a full disk, a quota, ``ulimit -f``) raises :class:`~charllm_nemo.errors.DiskFull`,
  so callers handle all three the same way.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, NoReturn

from charllm_nemo.errors import DiskFull, StoreError

WRITE_LIMIT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""Errors that mean the file system will take no more from this process: treated as a full disk."""


def limit_error(exc: OSError, what: object) -> DiskFull | None:
    """A :class:`DiskFull` for ``exc`` when it is a file-system limit (:data:`WRITE_LIMIT_ERRNOS`)."""
    if exc.errno not in WRITE_LIMIT_ERRNOS:
        return None
    reason = "file size limit (ulimit -f) reached" if exc.errno == errno.EFBIG else "no space left"
    return DiskFull(f"{reason} writing {what} ({exc.strerror or exc})")


def _reraise(exc: OSError, what: object) -> NoReturn:
    full = limit_error(exc, what)
    if full is not None:
        raise full from exc
    raise exc


class NotAFileName(StoreError, ValueError):
    """An output path whose last component is not a file name (``.``, ``..``, empty: a directory)."""


def _check_name(name: str) -> None:
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise NotAFileName(
            f"not a file name: {name!r} (the path names a directory; give a file to write, e.g. DIR/out.json)"
        )


_ANCHORS: set[Path] = set()


def anchor(folder: str | os.PathLike[str]) -> Path:
    """Mark ``folder`` (a run folder, an output folder) as one whose inside is not trusted: every
    directory below it that :func:`open_dir` creates or enters is opened component by component
    with ``O_NOFOLLOW`` from ``folder``'s descriptor (``folder`` itself may be reached through a
    link: the user named it). For this process; returns the absolute path."""
    root = Path(os.path.abspath(folder))
    _ANCHORS.add(root)
    return root


def _anchor_of(path: Path) -> Path:
    """The deepest anchor that holds ``path`` (lexically); ``path``'s parent when none does (the
    last component alone is then checked)."""
    held = [a for a in _ANCHORS if a != path and path.is_relative_to(a)]
    return max(held, key=lambda a: len(a.parts)) if held else path.parent


def _refuse_dir(path: Path, exc: OSError) -> StoreError:
    return StoreError(
        f"output directory {path} is a symbolic link or not a directory; the tool writes only "
        "into a real directory: remove it or give another (--out DIR)"
    )


def open_dir(
    path: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None, create: bool = True
) -> int:
    """A descriptor on directory ``path`` (created with its parents if missing and ``create``),
    every component below ``root`` (default: the deepest :func:`anchor` holding ``path``, else
    ``path``'s parent) created and opened with ``O_NOFOLLOW`` relative to its parent's descriptor:
    a link or a non-directory on the way raises StoreError naming it. The caller closes it."""
    path = Path(os.path.abspath(path))
    base = Path(os.path.abspath(root)) if root is not None else _anchor_of(path)
    if not path.is_relative_to(base):
        raise ValueError(f"{path} is not inside {base}")
    if create:
        with suppress(FileExistsError):  # a link or a file there: opened below, and refused
            base.mkdir(parents=True, exist_ok=True)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the user's: OSError as it is
    where = base
    for part in path.relative_to(base).parts:
        where = where / part
        try:
            if create:
                with suppress(FileExistsError):
                    os.mkdir(part, 0o777, dir_fd=fd)
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _refuse_dir(where, exc) from exc
            raise
        finally:
            os.close(fd)
        fd = nfd
    return fd


def make_dir(path: Path, *, root: str | os.PathLike[str] | None = None) -> None:
    """Create ``path`` (and its parents) if missing; refuse it if it, or a directory below
    ``root`` / its anchor on the way to it, is a link or not a directory (:func:`open_dir`)."""
    os.close(open_dir(path, root=root))


_HARMLESS_DEVICES = {(1, 3), (1, 5), (1, 7)}
"""Character devices (major, minor) that take a stream and keep nothing: /dev/null, /dev/zero,
/dev/full (Linux numbers)."""


_TERMINAL_MAJORS = frozenset({4, 5, *range(136, 144)})
"""Character device majors of terminals (Linux: tty, console / ptmx, pseudo-terminals)."""


def _streamable(st: os.stat_result) -> bool:
    """A FIFO, a terminal or a device that keeps nothing; judged before any open (opening some
    devices does something)."""
    if stat.S_ISFIFO(st.st_mode):
        return True
    if stat.S_ISCHR(st.st_mode):
        dev = (os.major(st.st_rdev), os.minor(st.st_rdev))
        return dev in _HARMLESS_DEVICES or dev[0] in _TERMINAL_MAJORS
    return False


_FD_LINK = re.compile(r"^/(?:proc/self|proc/thread-self|dev)/fd/([0-9]{1,9})$")


def _own_descriptor(target: str) -> int | None:
    """The descriptor number a link names when it is ``/proc/self/fd/N`` or ``/dev/fd/N`` (what
    ``/dev/stdout`` and ``/dev/stderr`` point to) and N is open here; else None."""
    m = _FD_LINK.match(target)
    if m is None:
        return None
    try:
        os.fstat(int(m.group(1)))
    except OSError:
        return None
    return int(m.group(1))


def _open_stream(dfd: int, name: str, where: Path) -> int | None:
    """A descriptor to write ``name`` in place when it exists and is not a regular file (a FIFO,
    a terminal, /dev/null, /dev/full: directly or through a link); None when it is absent, a
    regular file, or a link to one (replaced by rename, never followed). StoreError otherwise."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    follow = stat.S_ISLNK(st.st_mode)
    if follow:
        own = _own_descriptor(os.readlink(name, dir_fd=dfd))
        if own is not None:  # /dev/stdout: this process's own stdout, whatever it is (a file too)
            return os.dup(own)
        try:
            st = os.stat(name, dir_fd=dfd)
        except OSError:
            return None  # a dangling link: replaced
    if stat.S_ISREG(st.st_mode) or (follow and stat.S_ISDIR(st.st_mode)):
        return None
    what = "a directory" if stat.S_ISDIR(st.st_mode) else "a device, socket or other special file"
    refuse = StoreError(
        f"{where} is {what}; the tool writes only to a regular file, a FIFO, a terminal or /dev/null "
        "(never replaces a special file): give another path"
    )
    if not _streamable(st):
        raise refuse
    flags = os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(name, flags, dir_fd=dfd)
    except OSError as exc:
        if exc.errno == errno.ENXIO and stat.S_ISFIFO(st.st_mode):  # nobody reads: would block for ever
            raise StoreError(f"{where} is a FIFO that no process is reading; start its reader first") from exc
        raise StoreError(f"{where} cannot be opened to write ({exc.strerror})") from exc
    now = os.fstat(fd)
    if not _streamable(now) or (now.st_mode, now.st_rdev) != (st.st_mode, st.st_rdev):  # swapped since
        os.close(fd)
        raise refuse
    os.set_blocking(fd, True)
    return fd


def _open_dir(path: Path) -> int:
    return open_dir(path, create=False)


def _create_temp(dfd: int, tmp: str) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(tmp, flags, 0o644, dir_fd=dfd)
    except FileExistsError:
        # A temporary left by a killed writer, or something planted under its name: unlink
        # removes the entry itself (a link is never followed), then create afresh.
        os.unlink(tmp, dir_fd=dfd)
        return os.open(tmp, flags, 0o644, dir_fd=dfd)


class AtomicOutput:
    """A file being written at ``path``: :attr:`file` takes the content (a binary file object on
    the temporary), :meth:`commit` renames it over ``path``, :meth:`discard` removes it. For a
    writer that streams over a long loop (a ``ParquetWriter``); :func:`atomic_file` otherwise."""

    def __init__(self, path: Path, *, fsync: bool = False, tmp_tag: str = "") -> None:
        self.path = Path(path)
        _check_name(self.path.name)
        # tmp_tag (a pid): writers in several processes at once each get their own temporary
        self._tmp = f".{self.path.name}.{tmp_tag}.tmp" if tmp_tag else f".{self.path.name}.tmp"
        self._fsync = fsync
        self._dfd = open_dir(self.path.parent)
        try:
            stream = _open_stream(self._dfd, self.path.name, self.path)
            fd = stream if stream is not None else _create_temp(self._dfd, self._tmp)
        except BaseException as exc:
            os.close(self._dfd)
            if isinstance(exc, OSError):
                _reraise(exc, self.path)
            raise
        self.streamed = stream is not None
        """``path`` is a FIFO, a terminal or /dev/null: written in place, no temporary, no rename."""
        self.file: IO[bytes] = os.fdopen(fd, "wb")

    def commit(self) -> Path:
        """Flush, close and rename into place; a failure discards the temporary and raises
        (:class:`DiskFull` for a file-system limit)."""
        try:
            if not self.file.closed:
                self.file.flush()
                if self._fsync and not self.streamed:
                    os.fsync(self.file.fileno())
                self.file.close()
            if not self.streamed:
                os.replace(self._tmp, self.path.name, src_dir_fd=self._dfd, dst_dir_fd=self._dfd)
        except OSError as exc:
            self.discard()
            _reraise(exc, self.path)
        os.close(self._dfd)
        self._dfd = -1
        return self.path

    def discard(self) -> None:
        """Remove the temporary; ``path`` stays as it was. Idempotent."""
        if self._dfd < 0:
            return
        with suppress(OSError):
            self.file.close()
        if not self.streamed:  # a stream's bytes are gone already: nothing to take back
            with suppress(OSError):
                os.unlink(self._tmp, dir_fd=self._dfd)
        os.close(self._dfd)
        self._dfd = -1


@contextmanager
def atomic_file(path: Path, *, fsync: bool = False, tmp_tag: str = "") -> Iterator[IO[bytes]]:
    """A binary file object to write ``path``'s new content into; on a clean exit it replaces
    ``path`` atomically (see the module's docstring), on an error the temporary is removed and
    nothing at ``path`` changes."""
    out = AtomicOutput(path, fsync=fsync, tmp_tag=tmp_tag)
    try:
        yield out.file
    except BaseException as exc:
        out.discard()
        if isinstance(exc, OSError):
            _reraise(exc, path)
        raise
    out.commit()


def write_bytes(path: Path, data: bytes, *, fsync: bool = False, tmp_tag: str = "") -> Path:
    """Write ``data`` to ``path`` atomically, without following links; returns ``path``."""
    with atomic_file(path, fsync=fsync, tmp_tag=tmp_tag) as f:
        f.write(data)
    return Path(path)


def write_text(path: Path, text: str, *, fsync: bool = False, tmp_tag: str = "") -> Path:
    """``text`` as UTF-8 (:func:`write_bytes`)."""
    return write_bytes(path, text.encode("utf-8"), fsync=fsync, tmp_tag=tmp_tag)


def write_with(path: Path, write: Callable[[IO[bytes]], object]) -> Path:
    """Call ``write(file)`` (a Parquet / CSV / figure writer given a file object) and put the result
    at ``path`` atomically; returns ``path``."""
    with atomic_file(path) as f:
        write(f)
    return Path(path)
