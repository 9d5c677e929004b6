"""The hardened write layer (telemetry/write.py): no link followed, nothing outside the output
directory, nothing half-written, file-system limits raised as DiskFull."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tests.deadline import deadline

from charllm_nemo.errors import DiskFull, StoreError
from charllm_nemo.telemetry.write import AtomicOutput, write_bytes, write_text, write_with


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
