"""Progress lines of the long commands (charllm_nemo/progress.py): quiet when short; then what is
being done, how far and how long so far; and the commands that use them (report, analyze)."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest

from charllm_nemo.cli import main
from charllm_nemo.progress import Progress, elapsed_text, every_s_from_env
from tests.analysis.helpers import constant_run
from tests.deadline import deadline


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_short_command_says_nothing_a_long_one_says_stage_count_and_time() -> None:
    out, clock = io.StringIO(), Clock()
    p = Progress("charllm report", every_s=5, stream=out, clock=clock)
    p.stage("reading and attributing the runs", total=10, unit="runs")
    p.update(3)
    assert out.getvalue() == ""  # within 5 s: quiet
    clock.t = 6.0
    p.update(4)
    clock.t = 7.0
    p.update(5)  # throttled: the line of 6 s was less than 5 s ago
    clock.t = 11.5
    p.update(9, "2 skipped")
    p.stage("drawing the figures")  # a new stage is said at once
    assert out.getvalue().splitlines() == [
        "charllm report: reading and attributing the runs: 4/10 runs; 6 s so far",
        "charllm report: reading and attributing the runs: 9/10 runs (2 skipped); 11 s so far",
        "charllm report: drawing the figures; 11 s so far",
    ]


def test_one_long_stage_still_says_how_long_so_far() -> None:
    # A single Spark job or SLURM wait gives the command no chance to speak: the heartbeat does.
    class Stream(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.seen = threading.Event()

        def write(self, s: str) -> int:
            self.seen.set()
            return super().write(s)

    out = Stream()
    with Progress("charllm analyze", every_s=0.01, stream=out) as p:
        p.stage("Spark computes the ranks table (1 of 3)")
        assert out.seen.wait(deadline(10))
        first = out.getvalue().count("\n")
        out.seen.clear()
        assert out.seen.wait(deadline(10))  # another line, with no call from the command
    assert out.getvalue().count("\n") > first
    assert "charllm analyze: Spark computes the ranks table (1 of 3); " in out.getvalue()


def test_the_environment_sets_the_period_or_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHARLLM_PROGRESS_EVERY_S", "off")
    assert every_s_from_env() is None
    out = io.StringIO()
    Progress("x", stream=out).stage("a")
    assert out.getvalue() == ""
    monkeypatch.setenv("CHARLLM_PROGRESS_EVERY_S", "2.5")
    assert every_s_from_env() == 2.5
    monkeypatch.setenv("CHARLLM_PROGRESS_EVERY_S", "soon")
    assert every_s_from_env() == 5.0
    assert (elapsed_text(12.7), elapsed_text(185), elapsed_text(3725)) == ("12 s", "3 min 05 s", "1 h 02 min")


@pytest.mark.parametrize("command", ["report", "analyze"])
def test_report_and_analyze_say_what_they_do(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for i in range(2):
        constant_run(tmp_path / f"run={i}", ranks=1, seconds=1.0, steps=2)
    monkeypatch.setenv("CHARLLM_PROGRESS_EVERY_S", "0")  # every stage at once
    # analyze without figures (the report draws them): the same stages, less CI time
    assert main([command, str(tmp_path), *(["--no-figures"] if command == "analyze" else [])]) == 0
    err = capsys.readouterr().err
    prefix = f"charllm {command}: "
    assert f"{prefix}reading and attributing the runs: 0/2 runs;" in err
    assert f"{prefix}reading and attributing the runs: 2/2 runs;" in err
    assert f"{prefix}writing the tables;" in err and "so far" in err
    if command == "report":
        assert f"{prefix}drawing the figures;" in err and f"{prefix}writing the page;" in err
