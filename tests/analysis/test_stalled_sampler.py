"""Issue #32, sampling gaps end to end with the real session: the telemetry process is paused
(SIGSTOP) for ~1 s inside one step; that step's windows have coverage below 1 and a gap of about
a second, and `inspect`, `analyze`, the report and the timeline data all show it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from charllm_nemo.analysis.analyze import analyze
from charllm_nemo.analysis.figures_run import broken_at_gaps
from charllm_nemo.cli import main
from charllm_nemo.telemetry.join import attribute_run
from charllm_nemo.telemetry.reader import load_run
from charllm_nemo.telemetry.session import TelemetrySession
from charllm_nemo.telemetry.session_options import SessionOptions

STALLED = 2
STALL_S = 1.0


def _record(out: Path) -> tuple[int, int]:
    """Four steps of ~0.3 s (the stalled one ~1.6 s) on a real session with its telemetry
    process; returns the CLOCK_MONOTONIC ns the process was stopped and continued."""
    with TelemetrySession(
        out,
        SessionOptions(backend="synthetic", hz=100, sampler="process", backend_options={"activity": "marks"}),
        handle_signals=False,
    ) as tel:
        assert tel.sampler_mode == "process"
        pid = tel.sampler.pid
        assert pid is not None
        for step in range(4):
            with tel.windows.window("step", step=step):
                with tel.windows.window("phase", "forward", step=step, microbatch=0):
                    time.sleep(0.15)
                if step == STALLED:
                    os.kill(pid, signal.SIGSTOP)
                    stopped = time.monotonic_ns()
                    try:
                        time.sleep(STALL_S)
                    finally:
                        continued = time.monotonic_ns()
                        os.kill(pid, signal.SIGCONT)
                with tel.windows.window("phase", "backward", step=step, microbatch=0):
                    time.sleep(0.15)
            time.sleep(0.05)
    return stopped, continued


def test_a_stalled_sampler_is_flagged_everywhere(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    stopped, continued = _record(run_dir)
    run = load_run(run_dir)
    steps = {r["step"]: r for r in attribute_run(run, ("step",)).to_pylist()}
    hit = steps[STALLED]
    # No sample can be taken while the process is stopped: the gap spans at least the stop,
    # less the sampling period either side.
    assert hit["gap_max_s"] >= (continued - stopped) / 1e9 - 0.03
    assert hit["coverage"] < 1.0 - 0.9 / hit["duration_s"]
    for step in (0, 1, 3):
        assert steps[step]["gap_max_s"] < hit["gap_max_s"]

    # inspect: a SAMPLING GAP line naming the step, and its row marked
    assert main(["inspect", str(run_dir), "--kind", "step"]) == 0
    out = capsys.readouterr().out
    gap_line = next(line for line in out.splitlines() if line.startswith("SAMPLING GAP"))
    assert f"steps {STALLED}" in gap_line or f", {STALLED}" in gap_line, gap_line
    assert "!" in out

    # analyze: the per-step and per-rank tables
    a = analyze(run_dir)
    flagged = [r["step"] for r in a.tables["sampling_steps"].to_pylist()]
    assert STALLED in flagged
    (rank,) = a.tables["sampling_ranks"].to_pylist()
    assert rank["flagged"] and rank["gap_max_s"] >= hit["gap_max_s"] - 1e-9
    (dev,) = a.tables["ranks"].to_pylist()
    assert dev["coverage"] < 1.0 and dev["gap_max_s"] >= hit["gap_max_s"] - 1e-9

    # analyze on the command line: the data-quality line
    assert main(["analyze", str(run_dir), "--out", str(tmp_path / "an0")]) == 0
    assert "measured step(s) with a sampling gap" in capsys.readouterr().out

    # the report: the caveat counts the gap, the table is on the page
    html = tmp_path / "report.html"
    assert main(["report", str(run_dir), "--out", str(tmp_path / "an"), "--html", str(html)]) == 0
    page = html.read_text()
    assert "with a sampling gap" in page and "Table: sampling_steps" in page

    # the timeline data: a break (NaN) between the last sample before the stop and the first after
    t = run.samples.column("t_mono_ns").to_numpy()
    p = run.samples.column("power_instant_w").to_numpy(zero_copy_only=False)
    tb, (pb,) = broken_at_gaps(t, p)
    breaks = tb[np.isnan(pb)]
    assert np.any((breaks > stopped - 30_000_000) & (breaks < continued + 30_000_000)), breaks
