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
from pathlib import Path

import pyarrow as pa
import pytest

from charllm_nemo.analysis.csv_cells import spreadsheet_safe
from charllm_nemo.cli import main
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


UNREADABLE_SWEEPS = ["schema_other", "sweep_json_deep", "sweep_json_empty_object", "sweep_json_list"]
"""WHOLE_FILE_CASES that give no sweep at all (the others are read, with a warning, as a sweep of
no configuration: its name and folder are listed)."""


@pytest.mark.parametrize("case", UNREADABLE_SWEEPS)
def test_sweep_status_fails_when_its_only_sweep_is_unreadable(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing listed is a failure, not a success: exit 2 and an error line (was exit 0)."""
    s = _sweep(tmp_path, raw=WHOLE_FILE_CASES[case])
    rc, text = run_rc(["sweep", "status", str(s), "--no-slurm"], capsys)
    assert rc == 2 and "error: no sweep under" in text, text


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
