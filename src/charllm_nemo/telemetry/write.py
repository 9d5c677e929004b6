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
* a write that fails removes its temporary; one that hit a limit of the file system (ENOSPC,
  EDQUOT, EFBIG: a full disk, a quota, ``ulimit -f``) raises :class:`~charllm_nemo.errors.DiskFull`,
  so callers handle all three the same way.
"""

from __future__ import annotations

import errno
import os
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


def _check_name(name: str) -> None:
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"not a file name: {name!r}")


def make_dir(path: Path) -> None:
    """Create ``path`` (and its parents) if missing; refuse it if it is a link or not a directory."""
    with suppress(FileExistsError):  # a link or a file there: _open_dir says which
        path.mkdir(parents=True, exist_ok=True)
    os.close(_open_dir(path))


def _open_dir(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise StoreError(
                f"output directory {path} is a symbolic link or not a directory; the tool writes only "
                "into a real directory: remove it or give another (--out DIR)"
            ) from exc
        raise


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
        make_dir(self.path.parent)
        self._dfd = _open_dir(self.path.parent)
        try:
            fd = _create_temp(self._dfd, self._tmp)
        except OSError as exc:
            os.close(self._dfd)
            _reraise(exc, self.path)
        self.file: IO[bytes] = os.fdopen(fd, "wb")

    def commit(self) -> Path:
        """Flush, close and rename into place; a failure discards the temporary and raises
        (:class:`DiskFull` for a file-system limit)."""
        try:
            if not self.file.closed:
                self.file.flush()
                if self._fsync:
                    os.fsync(self.file.fileno())
                self.file.close()
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
