"""The hostile-input corpus, continued (tests/test_hostile_corpus.py): outputs that are devices,
FIFOs or links to them; linked directories inside a run folder; secrets by shape; Parquet bombs
spread over many segments, in every reader and in ``compact``; overlapping compacted ranges;
run folders whose names are not UTF-8; huge and non-finite CSV fields; spreadsheet formula
cells; sweeps whose only manifest is unreadable.

Like the first part, each command runs in this process and must end with 0 or 2 (a
``charllm: error`` line), never a traceback, and print no control character. scripts/test.sh
runs both files once as root and once as an unprivileged user.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from charllm_nemo.analysis.csv_cells import spreadsheet_safe
from charllm_nemo.cli import main
from charllm_nemo.errors import StoreError
from tests.analysis.helpers import constant_run
from tests.test_hostile_corpus import CONTROL, WHOLE_FILE_CASES, _sweep


def run_rc(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """(exit status, what was printed) of ``charllm argv`` run here; no control character."""
    rc = main(argv)
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc in (0, 2), (argv, rc, text[-2000:])
    assert not CONTROL.search(text), (argv, text[-2000:])
    return rc, text


# -- sweeps ---------------------------------------------------------------------------------------


UNREADABLE_SWEEPS = [
    "runs_as_dict",
    "schema_other",
    "sweep_json_deep",
    "sweep_json_empty_object",
    "sweep_json_list",
    "sweep_json_not_utf8",
]
"""WHOLE_FILE_CASES that give no sweep at all: every one (an empty sweep is no reading of a
broken record)."""

NO_RECORD = {"runs_as_dict": "field 'runs' is object, not a list", "sweep_json_not_utf8": "in field 'name'"}
"""sweep.json cases that parse but are no record of the sweep, and the field their error names."""


@pytest.mark.parametrize("case", UNREADABLE_SWEEPS)
def test_sweep_status_fails_when_its_only_sweep_is_unreadable(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing listed is a failure, not a success: exit 2 and an error line (was exit 0)."""
    s = _sweep(tmp_path, raw=WHOLE_FILE_CASES[case])
    rc, text = run_rc(["sweep", "status", str(s), "--no-slurm"], capsys)
    assert rc == 2 and "error: no sweep under" in text, text
    if case in NO_RECORD:  # the file, the field and the fix (was exit 0, an empty sweep)
        assert f"{s / 'sweep.json'}: " in text and NO_RECORD[case] in text, text
        assert "restore the file or write that field back" in text, text


@pytest.mark.parametrize("case", sorted(NO_RECORD))
def test_analysis_fails_on_a_sweep_json_that_is_no_record(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sweep with a readable run and a sweep.json that parses but is no record of the sweep:
    analyze and report fail naming the file, the field and the fix (its out-of-memory and failed
    configurations, the figures' gaps, silently went unseen, exit 0)."""
    s = tmp_path / "sweep=demo"
    constant_run(s / "run=good-1" / "attempt=1", ranks=1, seconds=1.0, steps=1)
    (s / "sweep.json").write_bytes(WHOLE_FILE_CASES[case])
    for argv in (
        ["analyze", str(s), "--no-figures", "--out", str(tmp_path / "a")],
        ["report", str(s), "--out", str(tmp_path / "r")],
    ):
        rc, text = run_rc(argv, capsys)
        assert rc == 2 and f"error: {s / 'sweep.json'}: " in text and NO_RECORD[case] in text, (argv, text)
        assert "restore the file or write that field back" in text, text


# -- spreadsheet formulas in CSV cells ------------------------------------------------------------

FORMULAS = ["=cmd|' /C calc'!A0", "+SUM(1)", "-2+3", "@SUM(A1)"]


def _cells(path: Path) -> list[str]:
    with path.open(newline="") as f:
        return [c for row in csv.reader(f) for c in row]


def test_csv_cells_are_never_formulas(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Host names that a spreadsheet would run reach ``nodes``, ``ranks``, ``runs`` and
    ``windows.csv`` escaped with a leading ``'``, in every CSV written; numbers stay numbers."""
    run = tmp_path / "run"
    constant_run(run, ranks=4, seconds=1.0, steps=1, hosts=FORMULAS)
    out = tmp_path / "out"
    run_rc(["analyze", str(run), "--out", str(out), "--no-figures"], capsys)
    files = sorted(out.glob("*.csv"))
    assert {"nodes.csv", "ranks.csv", "runs.csv", "windows.csv"} <= {f.name for f in files}
    seen = set()
    for f in files:
        for cell in _cells(f):
            if cell[:1] in ("=", "+", "-", "@"):
                float(cell)  # a number (a negative one), never text: ValueError otherwise
            seen.add(cell)
    assert {"'" + h for h in FORMULAS} <= seen  # escaped, in full


def test_spreadsheet_safe_keeps_numbers_and_plain_text() -> None:
    t = pa.table({"s": ["=1", "a=1", None, "\t=x"], "n": [-1.0, 2.0, None, -3.0]})
    d = pa.table({"s": pa.array(["-x", "y", "-x", "z"]).dictionary_encode()})
    assert spreadsheet_safe(t).column("s").to_pylist() == ["'=1", "a=1", None, "'\t=x"]
    assert spreadsheet_safe(t).column("n").to_pylist() == [-1.0, 2.0, None, -3.0]
    assert spreadsheet_safe(d).column("s").to_pylist() == ["'-x", "y", "'-x", "z"]


# -- names ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["report", "advise", "energy", "analyze", "inspect"])
def test_run_folder_named_in_bytes_that_are_not_utf8(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run folder named ``run\\xff\\xfe`` (a Latin-1 file system, an archive): read, labelled with
    the odd bytes written as ``\\xff`` (was a UnicodeEncodeError traceback)."""
    run = tmp_path / os.fsdecode(b"run\xff\xfe")
    constant_run(run, ranks=2, seconds=1.0, steps=1)
    extra = {
        "report": ["--out", str(tmp_path / "out"), "--html", str(tmp_path / "r.html")],
        "analyze": ["--out", str(tmp_path / "out"), "--no-figures"],
    }.get(command, [])
    rc, text = run_rc([command, str(run), *extra], capsys)
    assert rc == 0, text
    if command == "energy":
        assert "run\\xff\\xfe" in text


# -- outputs that are not regular files; linked folders inside the run -----------------------------


def _fifo_reader(fifo: Path, got: list[bytes]) -> threading.Thread:
    def read() -> None:
        with open(fifo, "rb") as f:  # the test's own far end of the FIFO
            got.append(f.read())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("small") / "run"
    constant_run(d, ranks=2, seconds=1.0, steps=1)
    return d


def test_report_html_into_a_fifo_is_streamed(
    small_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "page.html"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = _fifo_reader(fifo, got)
    time.sleep(0.2)  # the reader's open() waits for a writer; give it the time to get there
    rc, text = run_rc(["report", str(small_run), "--out", str(tmp_path / "o"), "--html", str(fifo)], capsys)
    reader.join(timeout=60)
    assert rc == 0, text
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and got and b"<html" in got[0].lower()


@pytest.mark.parametrize("target", ["/dev/null", "/dev/full", "fifo-without-reader", "."])
def test_wandb_dashboard_json_to_a_special_file(
    target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A link to a device is written through (or a clear error for /dev/full), a FIFO nobody
    reads is refused, ``.`` is named as a directory: never replaced, never a traceback."""
    pytest.importorskip("wandb_workspaces")
    if target.startswith("/dev/"):
        path = tmp_path / "w.json"
        path.symlink_to(target)
    elif target == ".":
        path = Path(".")
    else:
        path = tmp_path / "w.json"
        os.mkfifo(path)
    before = os.lstat(path)
    rc, text = run_rc(["wandb-dashboard", "--dry-run", "--project", "p", "--json", str(path)], capsys)
    assert rc == (0 if target == "/dev/null" else 2), text
    after = os.lstat(path)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)  # the same entry, kept


@pytest.mark.parametrize("command", ["report", "analyze"])
def test_a_linked_analysis_folder_in_the_run_is_refused(
    command: str, small_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ln -s ELSEWHERE RUN/analysis``: the default output folder, and ``figures`` below it,
    are not written through (the figures were: a folder two levels down was not checked)."""
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "analysis").symlink_to(elsewhere)
    rc, text = run_rc([command, str(run)], capsys)
    assert rc == 2 and "symbolic link" in text, text
    assert list(elsewhere.iterdir()) == []


# -- huge and non-finite input fields --------------------------------------------------------------


@pytest.mark.parametrize(
    "content, named",
    [
        ("time,g_per_kwh\n0," + "1" * 200_000 + "\n", "not a CSV line"),
        ("time,g_per_kwh\n0,1e308\n", "g_per_kwh 1e+308"),
        ("time,g_per_kwh\n0,inf\n", "g_per_kwh inf"),
        ("time,g_per_kwh\n1e300,400\n", "not unix seconds"),
    ],
)
def test_grid_csv_huge_and_non_finite_fields(
    content: str, named: str, small_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    grid = tmp_path / "grid.csv"
    grid.write_text(content)
    rc, text = run_rc(["energy", str(small_run), "--grid-csv", str(grid)], capsys)
    assert rc == 2 and named in text and "inf g" not in text, text


def test_grid_intensity_over_any_grid_is_refused(small_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, text = run_rc(["energy", str(small_run), "--grid-g-per-kwh", "1e308"], capsys)
    assert rc == 2 and "--grid-g-per-kwh" in text, text


@pytest.mark.parametrize(
    "steps", ["0:99999999999999999999999", "99999999999999999999999", "-99999999999999999999999:"]
)
def test_inspect_steps_past_64_bits(steps: str, small_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, text = run_rc(["inspect", str(small_run), f"--steps={steps}"], capsys)
    assert rc == 0, text


# -- a Parquet bomb spread over many small segments ------------------------------------------------

BOMB_FILES = 6
BOMB_ROWS = 400_000
"""Rows of each bomb segment: 8 int64 columns of zeros, ~26 MB decoded from ~15 KB: under the
per-file caps (rows, stated size); six of them over the budget of one read."""

BUDGET = 40 * 2**20
"""CHARLLM_MAX_UNPACKED_BYTES in the child (the budget of a machine with 640 MiB free): one bomb
segment fits, the second does not (the real default is larger; a smaller bomb keeps the test
quick)."""


@pytest.fixture(scope="module")
def bomb_run(small_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bomb") / "run"
    shutil.copytree(small_run, d)
    zeros = pa.array(np.zeros(BOMB_ROWS, np.int64))
    names = ["t_mono_ns", "device_index", "energy_mj", "throttle_reasons"] + [f"x{i}" for i in range(4)]
    first = d / "rank=0" / "samples-000000.parquet"
    pq.write_table(pa.table(dict.fromkeys(names, zeros)), first, compression="zstd", row_group_size=BOMB_ROWS)
    assert first.stat().st_size < 1_000_000
    for k in range(1, BOMB_FILES):
        shutil.copyfile(first, first.with_name(f"samples-{k:06d}.parquet"))
    return d


_CHILD = """
import os, resource, sys
os.environ["CHARLLM_ANALYZE_WORKERS"] = "1"
from charllm_nemo.cli import main
rc = main(sys.argv[1:])
print("RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
sys.exit(rc)
"""


@pytest.mark.parametrize("command", ["inspect", "report", "advise", "analyze", "compact"])
def test_a_bomb_over_many_segments_is_refused_by_every_reader_and_compact(
    command: str, bomb_run: Path, tmp_path: Path
) -> None:
    """Six segments that decode to ~26 MB each (the issue's were 200 MiB): each passes the
    per-file caps; together they took inspect, report and advise to MemoryError and compact to
    bad_alloc (exit 134). The files one read holds are counted against one budget, from the
    footers, before decoding (before: 2-3.3 GB of RSS here)."""
    run = tmp_path / "run"
    shutil.copytree(bomb_run, run)
    argv = [
        command,
        str(run),
        *{
            "report": ["--out", str(tmp_path / "o"), "--html", str(tmp_path / "r.html")],
            "analyze": ["--out", str(tmp_path / "o"), "--no-figures"],
        }.get(command, []),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "CHARLLM_MAX_UNPACKED_BYTES": str(BUDGET)}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *argv], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode in (0, 2), proc.stderr[-3000:]
    rss = int(re.findall(r"^RSS (\d+)$", proc.stdout, re.M)[-1])
    assert rss < 1536 * 2**20, (command, rss)  # one segment's worth and the interpreter's own
    text = proc.stdout + proc.stderr
    if command == "compact":  # no two fit one batch: each stays as it was, nothing lost
        assert len(list((run / "rank=0").glob("samples-*.parquet"))) == BOMB_FILES, text[-2000:]
    elif command in ("inspect", "analyze"):
        assert "one read may decode" in text, text[-2000:]


def test_the_read_budget_is_a_share_of_the_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from charllm_nemo.telemetry import layout

    monkeypatch.delenv("CHARLLM_MAX_UNPACKED_BYTES", raising=False)
    monkeypatch.setattr(layout, "_free_memory", lambda: 2 * 2**30)
    assert layout.read_budget() == 2 * 2**30 // layout.READ_MEMORY_SHARE
    monkeypatch.setattr(layout, "_free_memory", lambda: None)
    assert layout.read_budget() == layout.MAX_READ_UNPACKED
    monkeypatch.setenv("CHARLLM_MAX_UNPACKED_BYTES", "x")
    with pytest.raises(StoreError, match="CHARLLM_MAX_UNPACKED_BYTES"):
        layout.read_budget()
