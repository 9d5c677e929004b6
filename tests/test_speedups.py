"""charllm_nemo._hot (C) against its Python twins: the same behaviour, call for call.

The C module is optional at install (no compiler: the Python twins run). scripts/test.sh sets
CHARLLM_REQUIRE_C=1, so that CI fails when the build silently did not happen.
"""

from __future__ import annotations

import array
import functools
import os
import random
from typing import Any

import numpy as np
import pytest

from charllm_nemo import speedups
from charllm_nemo.devices.synthetic import MarkActivity, PyMarkActivity
from charllm_nemo.telemetry.windows import WindowRecorder
from charllm_nemo.train.marks import PyStepMarker, StepMarker

needs_c = pytest.mark.skipif(
    not speedups.IN_C, reason="charllm_nemo._hot is not in use (not built, or CHARLLM_PURE_PYTHON=1)"
)


def test_the_c_module_is_built_where_required() -> None:
    if os.environ.get("CHARLLM_REQUIRE_C") != "1":
        pytest.skip("CHARLLM_REQUIRE_C=1 is not set (scripts/test.sh sets it)")
    assert speedups.IN_C, (
        "charllm_nemo._hot is not in use: it did not build (setup.py: is there a C compiler?), "
        "or CHARLLM_PURE_PYTHON=1 is set"
    )


class Clock:
    """A deterministic clock: 1000 ns further at every reading."""

    def __init__(self) -> None:
        self.t = 0

    def __call__(self) -> int:
        self.t += 1000
        return self.t


# Calls as mcore and the loop make them, with the odd ones a marker must survive: a stop without
# its start, marks between steps, a timer left open into the next step, timers that are not
# windows, keyword arguments.
SCRIPT: list[tuple[str, ...]] = [
    ("mark", "forward-compute", "start"),  # before any step: unmatched
    ("begin",),
    ("mark", "forward-backward", "start"),  # not a window
    ("mark", "forward-compute", "start"),
    ("mark", "forward-compute", "stop"),
    ("mark", "backward-compute", "stop"),  # no start: unmatched
    ("mark", "backward-compute", "start"),
    ("mark", "backward-compute", "stop"),
    ("mark", "forward-recv", "start"),  # left open into the next step
    ("mark", "all-grads-sync", "start", "barrier"),
    ("mark", "all-grads-sync", "stop"),
    ("mark", "forward-backward", "stop"),
    ("mark", "charllm:optimizer", "start"),
    ("mark", "charllm:optimizer", "stop"),
    ("end",),
    ("mark", "forward-compute", "stop"),  # between steps: unmatched
    ("begin",),
    ("mark", "forward-recv", "stop"),  # opened in the step before: unmatched
    ("mark", "forward-compute", "start"),
    ("mark", "forward-compute", "stop"),
    ("end",),
]


def play(marker: Any, heard: list[Any]) -> list[list[int]]:
    """Run SCRIPT; the logs of its steps (taken as end_step sees them)."""
    logs: list[list[int]] = []
    step = 0
    for op in SCRIPT:
        if op[0] == "begin":
            marker.begin_step(step)
            step += 1
        elif op[0] == "end":
            logs.append(list(marker._log))
            marker.end_step()
        else:
            timer = marker(op[1], log_level=2)
            if len(op) > 3:
                getattr(timer, op[2])(barrier=False)
            else:
                getattr(timer, op[2])()
    heard.extend(marker.recorder.drain())
    return logs


@needs_c
def test_c_timers_log_what_the_python_ones_log() -> None:
    out = {}
    for cls in (StepMarker, PyStepMarker):
        rec = WindowRecorder()
        heard: list[tuple[str, str, bool]] = []
        rec.add_listener(lambda *a, heard=heard: heard.append(a))
        marker = cls(rec, num_microbatches=1)
        marker._clock = Clock()
        windows: list[Any] = []
        logs = play(marker, windows)
        for w in windows:  # step windows are timed by end_step's own clock: differ
            if w["kind"] == "step":
                w.pop("t_begin_mono_ns"), w.pop("t_end_mono_ns")
            w.pop("t_begin_wall_ns")
        out[cls] = (logs, heard, windows, marker.unmatched)
    c, py = out[StepMarker], out[PyStepMarker]
    assert c == py
    logs, heard, windows, unmatched = c
    assert unmatched == 4
    assert [len(log) // 2 for log in logs] == [9, 2]  # marks noted per step
    assert ("phase", "grad-sync", True) in heard and ("phase", "forward-backward", True) not in heard
    assert sorted(w["name"] for w in windows if w["kind"] == "phase") == [
        "backward", "forward", "forward", "grad-sync", "optimizer",
    ]  # fmt: skip


@needs_c
def test_c_timers_raise_what_a_listener_raises_and_keep_the_mark() -> None:
    rec = WindowRecorder()

    def broken(kind: str, name: str, is_begin: bool) -> None:
        raise RuntimeError("listener failed")

    marker = StepMarker(rec, num_microbatches=1)
    marker.begin_step(0)
    rec.add_listener(broken)  # after begin_step, whose own notify would raise first
    with pytest.raises(RuntimeError, match="listener failed"):
        marker("forward-compute").start()
    assert len(marker._log) == 2


def events(seed: int, n: int = 400) -> list[tuple[str, str, bool]]:
    rng = random.Random(seed)
    names = ["forward", "backward", "optimizer", "grad-sync", "pp-forward-recv"]
    out = []
    for _ in range(n):
        kind = rng.choice(["phase", "phase", "phase", "step", "other"])
        out.append((kind, rng.choice(names), rng.random() < 0.55))
    return out


@needs_c
@pytest.mark.parametrize("seed", range(5))
def test_c_mark_activity_follows_the_marks_as_the_python_one(seed: int) -> None:
    levels: dict[type, list[float]] = {}
    published: dict[type, list[float]] = {}
    for cls in (MarkActivity, PyMarkActivity):
        act = cls()
        assert not act.seen_any and act.level() == 0.0
        pub: list[float] = []
        act.on_change = pub.append
        seen = []
        for i, ev in enumerate(events(seed)):
            if i == 200:  # on_change taken away and given back midway
                act.on_change = None
            if i == 250:
                act.on_change = pub.append
            act(*ev)
            seen.append(act.level())
        assert act.seen_any
        levels[cls], published[cls] = seen, pub
    assert levels[MarkActivity] == levels[PyMarkActivity]
    assert published[MarkActivity] == published[PyMarkActivity]
    assert set(levels[MarkActivity]) <= {0.0, 0.3, 0.5, 0.7, 1.0}


@pytest.mark.parametrize("cls", [MarkActivity, PyMarkActivity])
def test_mark_activity_stops_publishing_where_the_block_was_released(cls: Any) -> None:
    buf = memoryview(bytearray(8)).cast("d")
    act = cls()
    act.on_change = functools.partial(buf.__setitem__, 0)  # as the session's activity_publisher()
    act("step", "step", True)
    assert buf[0] == 0.3
    buf.release()  # what stop() does to the shared block
    act("phase", "forward", True)  # ValueError from the released view: dropped, not raised
    assert act.on_change is None and act.level() == 1.0

    def broken(level: float) -> None:
        raise RuntimeError("a bug, not a released block")

    act.on_change = broken
    with pytest.raises(RuntimeError):
        act("phase", "forward", False)


def one_step_of_levels(marker: Any, act: Any, step: int) -> list[float]:
    """The activity levels after each mark of a step with three phases, and after its end."""
    levels = []
    marker.begin_step(step)
    for name in ("forward-compute", "backward-compute", "all-grads-sync"):
        marker(name).start()
        levels.append(act.level())
        marker(name).stop()
        levels.append(act.level())
    marker.end_step()
    return [*levels, act.level()]


@needs_c
def test_c_timers_tell_a_mark_activity_what_the_python_ones_tell_it() -> None:
    """The C timers update a C MarkActivity listener directly (not through its __call__; the
    phase's level index cached per timer): the same levels and publications as the Python
    timers and MarkActivity, and other levels once its __init__ has run again."""
    seen = {}
    for marker_cls, act_cls in ((StepMarker, MarkActivity), (PyStepMarker, PyMarkActivity)):
        rec = WindowRecorder()
        act = act_cls()
        published: list[float] = []
        act.on_change = published.append
        rec.add_listener(act)
        marker = marker_cls(rec, num_microbatches=1)
        seen[act_cls] = (one_step_of_levels(marker, act, 0), published, marker, act)
    assert seen[MarkActivity][:2] == seen[PyMarkActivity][:2]
    assert seen[MarkActivity][0] == [1.0, 0.3, 1.0, 0.3, 0.7, 0.3, 0.0]
    _, _, marker, act = seen[MarkActivity]
    speedups.hot.MarkActivity.__init__(act, {"backward-x": 0, "backward": 2}, (0.9, 0.6, 0.4), 0.2, 0.1)
    assert one_step_of_levels(marker, act, 1) == [0.6, 0.2, 0.4, 0.2, 0.6, 0.2, 0.1]


@needs_c
@pytest.mark.parametrize("cls", [MarkActivity, PyMarkActivity])
def test_a_float_slot_is_written_by_mark_activity_and_dropped_once_released(cls: Any) -> None:
    import mmap

    mm = mmap.mmap(-1, 4096)
    slot = speedups.hot.FloatSlot(mm, 3)
    words = memoryview(mm).cast("d")
    act = cls()
    act.on_change = slot  # as the session's activity_publisher() gives it, where C is built
    act("step", "step", True)
    assert words[3] == 0.3
    act("phase", "forward", True)
    assert words[3] == 1.0 and words[2] == 0.0 and words[4] == 0.0
    slot(0.25)  # a slot is also an ordinary callable(level)
    assert words[3] == 0.25
    words.release()
    with pytest.raises(BufferError):  # held by the slot: the block cannot be unmapped under it
        mm.close()
    slot.release()
    assert slot.released
    with pytest.raises(ValueError, match="released"):
        slot(0.5)
    act("phase", "forward", False)  # released: dropped, not raised
    assert act.on_change is None and act.level() == 0.3
    mm.close()


@needs_c
def test_a_float_slot_refuses_a_word_outside_its_buffer() -> None:
    FloatSlot = speedups.hot.FloatSlot
    with pytest.raises(ValueError, match="outside the buffer"):
        FloatSlot(bytearray(16), 2)
    with pytest.raises(ValueError, match="outside the buffer"):
        FloatSlot(bytearray(16), -1)
    with pytest.raises(BufferError):  # read-only
        FloatSlot(bytes(16), 0)
    slot = FloatSlot(bytearray(16), 1)
    with pytest.raises(TypeError):
        slot("high")


def ring_writers() -> list[Any]:
    from charllm_nemo.telemetry.shm import write_ring_py

    return [write_ring_py] + ([speedups.hot.write_ring] if speedups.hot is not None else [])


@pytest.mark.parametrize("w", [0, 3, 5, 6, 11, 1000])
def test_write_ring_writes_pads_and_wraps_as_its_python_twin(w: int) -> None:
    """A 6-record ring of 4 words after a 16-byte head; 10 ints = 3 records from record w % 6."""
    outs = []
    for write in ring_writers():
        buf = bytearray(b"\xff" * (16 + 6 * 4 * 8))
        n = write(buf, 16, 6, w, 4, (7, -1), [2**62, -(2**63)], (1, 2, 3, np.int64(4), 5, 6))
        assert n == 3
        outs.append(bytes(buf))
        words = array.array("q", buf[16:])
        want = [7, -1, 2**62, -(2**63), 1, 2, 3, 4, 5, 6, 0, 0]
        got = [words[(w % 6 * 4 + i) % 24] for i in range(12)]
        assert got == want
        assert buf[:16] == b"\xff" * 16  # nothing before the ring
        untouched = [words[(w % 6 * 4 + i) % 24] for i in range(12, 24)]
        assert untouched == [-1] * 12
    assert len(set(outs)) == 1


def test_write_ring_refuses_what_does_not_fit_and_bad_ints() -> None:
    for write in ring_writers():
        buf = bytearray(16 + 2 * 4 * 8)
        with pytest.raises(ValueError):
            write(buf, 16, 2, 0, 4, list(range(9)))  # 3 records in a 2-record ring
        with pytest.raises(OverflowError):
            write(buf, 16, 2, 0, 4, [2**63])
        with pytest.raises((TypeError, BufferError)):
            write(bytes(buf), 16, 2, 0, 4, [1])  # read-only
        with pytest.raises(ValueError):  # the ring runs past the buffer
            write(bytearray(64), 16, 2, 0, 4, [1])
        assert write(buf, 16, 2, 1, 4, []) == 0


_EDGES = """
from charllm_nemo import _hot
from charllm_nemo.telemetry.windows import WindowRecorder
from charllm_nemo.train.marks import StepMarker

# A MarkActivity made without __init__: working defaults, not NULL fields.
a = _hot.MarkActivity.__new__(_hot.MarkActivity)
a("phase", "forward", True)
assert a.on_change is None

# A ring whose size overflows int64 (cap * record_len * 8 wraps to 0): refused, not written.
try:
    _hot.write_ring(bytearray(1024), 0, 2**61, 2**40, 8, [1] * 8)
except ValueError as exc:
    assert "does not fit" in str(exc)
else:
    raise AssertionError("write_ring wrote past its buffer")

# A conversion that fails is reported at once, not carried into the next argument's __index__.
class Index:
    def __index__(self):
        raise RuntimeError("must not run")
try:
    _hot.write_ring(bytearray(64), "x", Index(), 0, 1, [1])
except TypeError:
    pass

# A listener that replaces the marker's listeners list (its only holder) mid-call.
calls = []
m = StepMarker(WindowRecorder(), num_microbatches=1)
m.begin_step(0)
def swap(kind, name, begin):
    calls.append("swap")
    m._listeners = [lambda *args: calls.append("new")]
m._listeners = [swap, lambda *args: calls.append("second")]
m("forward-compute").start()
assert calls == ["swap", "second"], calls
print("ok")
"""


@needs_c
def test_c_edge_cases_that_once_crashed_the_process() -> None:
    # In a child (PYTHONMALLOC=debug catches a freed list still read): a regression here is a
    # segfault, which must fail this test, not the test run.
    import subprocess
    import sys

    env = {**os.environ, "PYTHONMALLOC": "debug"}
    proc = subprocess.run([sys.executable, "-c", _EDGES], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr[-2000:])
