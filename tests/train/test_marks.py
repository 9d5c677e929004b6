"""StepMarker: mcore's timer calls -> step / microbatch / phase windows, host and CUDA-event paths.

The schedule is driven by hand here (the calls megatron-core's schedules make, in their order);
the CUDA path runs against a stand-in for ``torch.cuda.Event`` whose clock is the host's, so the
resolution maths (anchor + elapsed_time -> CLOCK_MONOTONIC ns, one synchronize per step) is
checked without a GPU.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from charllm_nemo.telemetry.windows import WindowRecorder
from charllm_nemo.train.marks import StepMarker

torch = pytest.importorskip("torch")


@pytest.fixture
def Marker() -> type[StepMarker]:
    return StepMarker


def one_f_one_b(marker: StepMarker, order: list[tuple[str, int]]) -> None:
    """Call the timers as a 1F1B schedule would, with a p2p exchange after each compute."""
    for kind, _mb in order:
        name = "forward-compute" if kind == "F" else "backward-compute"
        marker(name, log_level=2).start()
        time.sleep(0.0005)
        marker(name).stop()
        marker("forward-send-backward-recv", log_level=2).start()
        marker("forward-send-backward-recv").stop()
    marker("all-grads-sync", log_level=1).start(barrier=False)
    marker("all-grads-sync").stop()


STAGE0 = [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]


def run_step(marker: StepMarker, step: int) -> Any:
    marker.begin_step(step)
    marker("forward-backward", log_level=1).start(barrier=False)  # the whole schedule: no window
    one_f_one_b(marker, STAGE0)
    marker("forward-backward").stop()
    opt = marker.phase("optimizer")
    opt.start()
    opt.stop()
    return marker.end_step()


def check_windows(rows: list[dict[str, Any]], timing: str) -> None:
    step = [r for r in rows if r["kind"] == "step"]
    assert len(step) == 1
    st = step[0]
    phases = sorted((r for r in rows if r["kind"] == "phase"), key=lambda r: r["t_begin_mono_ns"])
    compute = [
        (r["name"][0].upper(), r["microbatch"]) for r in phases if r["name"] in ("forward", "backward")
    ]
    assert compute == STAGE0
    names = {r["name"] for r in phases}
    assert {"pp-forward-send-backward-recv", "grad-sync", "optimizer"} <= names
    assert "forward-backward" not in names
    mbs = {r["microbatch"]: r for r in rows if r["kind"] == "microbatch"}
    assert sorted(mbs) == [0, 1, 2, 3]
    for r in rows:
        assert r["timing"] == timing
        assert r["t_begin_mono_ns"] <= r["t_end_mono_ns"]
        assert st["t_begin_mono_ns"] <= r["t_begin_mono_ns"] and r["t_end_mono_ns"] <= st["t_end_mono_ns"]
        if r is not st:
            assert r["parent_id"] == st["window_id"]
    for mb, m in mbs.items():
        f = next(p for p in phases if p["name"] == "forward" and p["microbatch"] == mb)
        b = next(p for p in phases if p["name"] == "backward" and p["microbatch"] == mb)
        assert (m["t_begin_mono_ns"], m["t_end_mono_ns"]) == (f["t_begin_mono_ns"], b["t_end_mono_ns"])
    # The warmup forward of microbatch 1 begins before microbatch 0's backward: windows overlap.
    assert mbs[1]["t_begin_mono_ns"] < mbs[0]["t_end_mono_ns"]


def test_host_marks_follow_the_1f1b_schedule(Marker: Any) -> None:
    rec = WindowRecorder()
    seen: list[tuple[str, str, bool]] = []
    rec.add_listener(lambda kind, name, is_begin: seen.append((kind, name, is_begin)))
    marker = Marker(rec, num_microbatches=4)
    timing = run_step(marker, 0)
    rows = rec.drain()
    check_windows(rows, "host")
    assert timing.window_id == next(r["window_id"] for r in rows if r["kind"] == "step")
    assert timing.seconds > 0
    # Host marks happen live: listeners (the synthetic device) see every phase begin and end.
    assert ("phase", "forward", True) in seen and ("phase", "optimizer", False) in seen
    assert marker.unmatched == 0


class FakeEvent:
    """torch.cuda.Event stand-in: records the host clock; elapsed_time in ms like CUDA's."""

    syncs = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.t: int | None = None

    def record(self) -> None:
        self.t = time.monotonic_ns()

    def elapsed_time(self, other: FakeEvent) -> float:
        assert self.t is not None and other.t is not None, "resolved before both were recorded"
        return (other.t - self.t) / 1e6


def test_cuda_event_marks_resolve_at_step_end(monkeypatch: pytest.MonkeyPatch, Marker: Any) -> None:
    syncs: list[int] = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(1))
    rec = WindowRecorder()
    marker = Marker(rec, num_microbatches=4, cuda=True)
    t_before = time.monotonic_ns()
    for step in range(2):
        timing = run_step(marker, step)
        rows = rec.drain()
        check_windows(rows, "cuda_event")
        assert t_before <= timing.t_begin_mono_ns <= timing.t_end_mono_ns <= time.monotonic_ns()
    # One synchronize per step, none per microbatch; events are reused from step to step.
    assert len(syncs) == 2
    assert len(marker._events) == marker._next_event


def test_cuda_marks_stay_inside_their_step_when_the_anchor_runs_late(
    monkeypatch: pytest.MonkeyPatch, Marker: Any
) -> None:
    # The anchor event executes some time after the host clock is read (on a GPU: the stream's
    # latency; here: 2 ms). Times resolved from it must not run ahead of the host clock, or the
    # step's end, clamped to the host clock after the sync, would cut its last marks.
    marker: Any = None

    class LateAnchor(FakeEvent):
        def record(self) -> None:
            super().record()
            if marker._events and marker._events[0] is self:
                time.sleep(0.002)

    monkeypatch.setattr(torch.cuda, "Event", LateAnchor)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    rec = WindowRecorder()
    marker = Marker(rec, num_microbatches=4, cuda=True)
    for step in range(3):
        run_step(marker, step)
        check_windows(rec.drain(), "cuda_event")


def test_kinds_select_windows(Marker: Any) -> None:
    rec = WindowRecorder()
    marker = Marker(rec, num_microbatches=4, kinds=["step"])
    assert not marker.phases_on
    run_step(marker, 0)
    assert {r["kind"] for r in rec.drain()} == {"step"}
    rec2 = WindowRecorder()
    marker = Marker(rec2, num_microbatches=4, kinds=["microbatch"])
    assert marker.phases_on  # microbatch windows are built from the phase timers
    run_step(marker, 0)
    assert {r["kind"] for r in rec2.drain()} == {"microbatch"}
    rec3 = WindowRecorder()  # telemetry off: the loop still times its steps, nothing is recorded
    marker = Marker(rec3, num_microbatches=4, kinds=[])
    timing = run_step(marker, 0)
    assert timing.window_id is None and timing.seconds > 0
    assert rec3.drain() == [] and rec3.total_recorded == 0


def test_interleaved_order_assigns_chunks(Marker: Any) -> None:
    pytest.importorskip("megatron.core")
    rec = WindowRecorder()
    # PP=2, 2 chunks, 4 microbatches, group size 2: mcore's table runs (mb, chunk)
    # (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1); backward mirrors the chunks.
    marker = Marker(rec, num_microbatches=4, num_chunks=2, group_size=2)
    marker.begin_step(0)
    for _ in range(8):
        marker("forward-compute").start()
        marker("forward-compute").stop()
    for _ in range(8):
        marker("backward-compute").start()
        marker("backward-compute").stop()
    marker.end_step()
    rows = rec.drain()
    fwd = [(r["microbatch"], r["vpp_chunk"]) for r in rows if r["name"] == "forward"]
    bwd = [(r["microbatch"], r["vpp_chunk"]) for r in rows if r["name"] == "backward"]
    assert fwd == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert bwd == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]
    # A microbatch window closes with its last backward (chunk 0 runs backward last).
    mbs = {r["microbatch"]: r for r in rows if r["kind"] == "microbatch"}
    assert sorted(mbs) == [0, 1, 2, 3]


def test_host_marks_are_noted_live_and_recorded_at_step_end(Marker: Any) -> None:
    # Between two pieces of training work a mark only notes its time (cheap with cold caches);
    # the step's windows reach the recorder, and its sink, at end_step. Listeners hear it live.
    rec = WindowRecorder()
    seen: list[tuple[str, str, bool]] = []
    rec.add_listener(lambda kind, name, is_begin: seen.append((kind, name, is_begin)))
    marker = Marker(rec, num_microbatches=1)
    marker.begin_step(0)
    marker("forward-compute").start()
    marker("forward-compute").stop()
    assert rec.drain_records() == [] and rec.total_recorded == 0
    assert seen == [("step", "step", True), ("phase", "forward", True), ("phase", "forward", False)]
    marker("backward-compute").start()
    marker("backward-compute").stop()
    marker.end_step()
    assert seen[-1] == ("step", "step", False)
    assert sorted((r["kind"], r["name"]) for r in rec.drain()) == [
        ("microbatch", "microbatch"), ("phase", "backward"), ("phase", "forward"), ("step", "step"),
    ]  # fmt: skip


def test_a_step_cut_short_hands_over_what_it_marked_with_the_rest_open(Marker: Any) -> None:
    # What the session does at close (SIGTERM, an exception) in the middle of a step.
    rec = WindowRecorder()
    marker = Marker(rec, num_microbatches=2)
    marker.begin_step(7)
    marker("forward-compute").start()
    marker("forward-compute").stop()
    marker("backward-compute").start()
    marker("backward-compute").stop()  # microbatch 0 complete
    marker("forward-compute").start()  # microbatch 1's forward: still running
    rec.flush_pending()
    done = rec.drain()
    assert sorted((r["kind"], r["name"], r["microbatch"]) for r in done) == [
        ("microbatch", "microbatch", 0), ("phase", "backward", 0), ("phase", "forward", 0),
    ]  # fmt: skip
    still_open = rec.open_windows()
    assert sorted((r["kind"], r["name"], r["microbatch"]) for r in still_open) == [
        ("phase", "forward", 1), ("step", "step", None),
    ]  # fmt: skip
    step_id = next(r["window_id"] for r in still_open if r["kind"] == "step")
    assert all(r["parent_id"] == step_id for r in done) and all(r["step"] == 7 for r in done + still_open)
    rec.flush_pending()  # nothing twice
    assert rec.drain() == [] and len(rec.open_windows()) == 2


def test_a_marker_without_microbatches_is_refused() -> None:
    # Window ids are reserved per microbatch at step end: with none, a stray backward mark would
    # take ids belonging to the next step.
    with pytest.raises(ValueError, match="num_microbatches=0 and num_chunks=1 must be >= 1"):
        StepMarker(WindowRecorder(), num_microbatches=0)
