"""The hardened write layer (telemetry/write.py): no link followed, nothing outside the output
directory, nothing half-written, file-system limits raised as DiskFull."""

from __future__ import annotations

import errno
import os
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from tests.deadline import deadline

from charllm_nemo.errors import DiskFull, StoreError
from charllm_nemo.telemetry.write import AtomicOutput, anchor, make_dir, write_bytes, write_text, write_with


def test_a_link_at_the_name_is_replaced_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim.rc"
    victim.write_text("echo safe\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "problems.txt").symlink_to(victim)
    write_text(out / "problems.txt", "$(id>PWNED);#\n")
    assert victim.read_text() == "echo safe\n"
    assert not (out / "problems.txt").is_symlink()
    assert (out / "problems.txt").read_text() == "$(id>PWNED);#\n"


def test_a_link_planted_as_the_temporary_is_removed_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".manifest.json.tmp").symlink_to(victim)
    write_bytes(out / "manifest.json", b"{}")
    assert victim.read_text() == "keep"
    assert (out / "manifest.json").read_bytes() == b"{}"
    assert not (out / ".manifest.json.tmp").exists() and not (out / ".manifest.json.tmp").is_symlink()


def test_an_output_directory_that_is_a_link_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").symlink_to(elsewhere)
    with pytest.raises(StoreError, match="symbolic link"):
        write_text(tmp_path / "out" / "problems.txt", "x")
    assert list(elsewhere.iterdir()) == []


def test_a_name_must_be_one_component(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a file name"):
        write_text(tmp_path / "..", "x")


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    (tmp_path / "t.parquet").write_bytes(b"old")

    def fail(f: object) -> None:
        f.write(b"PAR1")  # type: ignore[attr-defined]
        raise OSError(errno.EIO, "I/O error")

    with pytest.raises(OSError, match="I/O error"):
        write_with(tmp_path / "t.parquet", fail)
    assert (tmp_path / "t.parquet").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.parquet"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_file_system_limits_are_a_full_disk(tmp_path: Path, code: int) -> None:
    def fail(f: object) -> None:
        raise OSError(code, os.strerror(code))

    with pytest.raises(DiskFull):
        write_with(tmp_path / "x", fail)
    assert list(tmp_path.iterdir()) == []


def test_a_streamed_output_appears_only_on_commit(tmp_path: Path) -> None:
    out = AtomicOutput(tmp_path / "windows.parquet")
    out.file.write(b"abc")
    assert not (tmp_path / "windows.parquet").exists()
    out.commit()
    assert (tmp_path / "windows.parquet").read_bytes() == b"abc"
    gone = AtomicOutput(tmp_path / "other.parquet")
    gone.file.write(b"x")
    gone.discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["windows.parquet"]


def test_a_real_file_size_limit_raises_disk_full(tmp_path: Path) -> None:
    """``ulimit -f``: the kernel refuses the write with EFBIG (SIGXFSZ ignored, as Python does)."""
    code = textwrap.dedent(
        f"""
        import resource, signal, sys
        from pathlib import Path
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        from charllm_nemo.errors import DiskFull
        from charllm_nemo.telemetry.write import write_bytes
        write_bytes(Path({str(tmp_path)!r}) / "small", b"x" * 1000)
        try:
            write_bytes(Path({str(tmp_path)!r}) / "big", b"x" * 200_000)
        except DiskFull as exc:
            print("DiskFull:", exc)
            sys.exit(0)
        sys.exit(1)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=deadline(120))
    assert proc.returncode == 0, proc.stderr
    assert "ulimit -f" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small"]  # no temporary, nothing half-written


def test_analyze_does_not_overwrite_a_file_a_run_links_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The attack of issue 33: a run whose ``analysis/problems.txt`` links to a user's file, and a
    rank folder named like a shell command, so that the problems text is a payload."""
    pytest.importorskip("duckdb")
    from tests.analysis.helpers import constant_run

    from charllm_nemo.cli import main

    run = tmp_path / "run"
    constant_run(run, ranks=1)
    (run / "rank=$(id>PWNED);#").mkdir()
    victim = tmp_path / "bashrc"
    victim.write_text("# the user's start-up file\n")
    (run / "analysis").mkdir()
    (run / "analysis" / "problems.txt").symlink_to(victim)
    (run / "analysis" / "runs.csv").symlink_to(tmp_path / "created-by-link")
    assert main(["analyze", str(run), "--no-figures"]) == 0
    capsys.readouterr()
    assert victim.read_text() == "# the user's start-up file\n"
    assert not (tmp_path / "created-by-link").exists()
    problems = run / "analysis" / "problems.txt"
    assert not problems.is_symlink() and "PWNED" in problems.read_text()
    linked = tmp_path / "linked-out"
    linked.mkdir()
    (tmp_path / "run2").mkdir()
    constant_run(tmp_path / "run2", ranks=1)
    (tmp_path / "run2" / "analysis").symlink_to(linked)
    assert main(["analyze", str(tmp_path / "run2"), "--no-figures"]) != 0
    assert "symbolic link" in capsys.readouterr().err
    assert list(linked.iterdir()) == []


# -- special files at the name: written in place as a stream, or refused; never renamed over ------


def _read_fifo(fifo: Path, got: list[bytes]) -> threading.Thread:
    def read() -> None:
        with open(fifo, "rb") as f:  # a test's own reader: the far end of the FIFO
            got.append(f.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader


def test_a_fifo_with_a_reader_is_written_as_a_stream(tmp_path: Path) -> None:
    fifo = tmp_path / "report.html"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = _read_fifo(fifo, got)
    for _ in range(200):  # the reader's open: then the FIFO has one
        try:
            write_text(fifo, "<html>page</html>")
            break
        except StoreError:
            time.sleep(0.05)
    reader.join(timeout=deadline(30))
    assert got == [b"<html>page</html>"]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # still the FIFO: nothing renamed over it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]  # no temporary left


def test_a_fifo_nobody_reads_is_refused_not_replaced(tmp_path: Path) -> None:
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    with pytest.raises(StoreError, match="FIFO that no process is reading"):
        write_text(fifo, "{}")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_link_to_dev_null_is_written_through_and_kept(tmp_path: Path) -> None:
    """``--json /dev/stdout`` and friends: a link to a stream device is written through (as root
    a rename put a regular file in place of the link's target directory entry's link)."""
    link = tmp_path / "w.json"
    link.symlink_to("/dev/null")
    write_text(link, "{}")
    assert link.is_symlink() and os.readlink(link) == "/dev/null"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_link_to_dev_full_is_a_full_disk(tmp_path: Path) -> None:
    link = tmp_path / "w.json"
    link.symlink_to("/dev/full")
    with pytest.raises(DiskFull):
        write_text(link, "{}")
    assert link.is_symlink()


@pytest.mark.parametrize("kind", ["directory", "socket"])
def test_a_directory_or_socket_at_the_name_is_refused(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "out.json"
    if kind == "directory":
        target.mkdir()
    else:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(target))
        s.close()
    with pytest.raises(StoreError, match="writes only to a regular file"):
        write_text(target, "{}")
    assert target.is_dir() if kind == "directory" else stat.S_ISSOCK(os.lstat(target).st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="making device nodes needs root (CI runs it as root)")
def test_device_nodes_as_root(tmp_path: Path) -> None:
    """As root the danger is real: a null device is streamed to and stays; a device that keeps
    what it is given (memory: major 1, minor 1) is refused, never written, never replaced."""
    null = tmp_path / "null"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    write_text(null, "x")
    assert stat.S_ISCHR(os.lstat(null).st_mode)
    mem = tmp_path / "mem"
    os.mknod(mem, 0o600 | stat.S_IFCHR, os.makedev(1, 1))
    with pytest.raises(StoreError, match="a device"):
        write_text(mem, "x")
    assert stat.S_ISCHR(os.lstat(mem).st_mode)


def test_a_path_naming_a_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="not a file name"):
        write_text(Path("."), "x")


# -- directories below a run folder: every one checked, whichever is entered first -----------------


def test_a_linked_folder_below_an_anchor_is_refused_at_any_depth(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "analysis").symlink_to(elsewhere)
    anchor(run)
    with pytest.raises(StoreError, match="symbolic link"):
        write_text(run / "analysis" / "figures" / "f.png", "x")  # two levels down, written first
    with pytest.raises(StoreError, match="symbolic link"):
        make_dir(run / "analysis" / "a" / "b")
    assert list(elsewhere.iterdir()) == []


def test_a_link_to_this_process_stdout_writes_to_stdout_even_when_it_is_a_file(tmp_path: Path) -> None:
    """``--json /dev/stdout > out.txt``: stdout is a regular file, and the link (as /dev/stdout
    is) must be written through, never replaced (as root that replaced /dev/stdout itself)."""
    code = textwrap.dedent(
        f"""
        from pathlib import Path
        from charllm_nemo.telemetry.write import write_text
        link = Path({str(tmp_path)!r}) / "stdout"
        link.symlink_to("/proc/self/fd/1")
        write_text(link, "to stdout\\n")
        assert link.is_symlink()
        """
    )
    with (tmp_path / "out.txt").open("wb") as out:
        proc = subprocess.run(
            [sys.executable, "-c", code], stdout=out, stderr=subprocess.PIPE, timeout=deadline(60)
        )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out.txt").read_text() == "to stdout\n"
