"""AsyncSink never blocks the caller: a hanging or raising backend costs drops and errors,
counted and reported, never a stalled or failed training step."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from charllm_nemo.sinks.base import AsyncSink, Sink
from tests.deadline import deadline


class Recording:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def start(self, config: dict[str, Any], manifest: dict[str, Any]) -> None:
        self.calls.append(("start", config))

    def log_step(self, step: int, metrics: Any) -> None:
        self.calls.append(("log_step", (step, dict(metrics))))

    def log_windows_table(self, rows: list[dict[str, Any]]) -> None:
        self.calls.append(("table", len(rows)))

    def finish(self, run_dir: Path | None) -> None:
        self.calls.append(("finish", run_dir))


class Hanging(Recording):
    """log_step hangs until released (a W&B call stuck on a dead network)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def log_step(self, step: int, metrics: Any) -> None:
        self.entered.set()
        self.release.wait()


class Raising(Recording):
    def log_step(self, step: int, metrics: Any) -> None:
        raise ConnectionError("W&B unreachable")


def test_a_backend_gets_every_call_in_order_and_the_report_says_so(tmp_path):
    backend = Recording()
    sink = AsyncSink(backend, queue_size=64)
    assert isinstance(sink, Sink) and isinstance(backend, Sink)
    sink.start({"a": 1}, {})
    for s in range(10):
        sink.log_step(s, {"x": float(s)})
    sink.log_windows_table([{"r": 1}])
    sink.finish(tmp_path, timeout_s=5)
    assert [c[0] for c in backend.calls] == ["start", *["log_step"] * 10, "table", "finish"]
    assert [c[1][0] for c in backend.calls if c[0] == "log_step"] == list(range(10))
    assert backend.calls[-1] == ("finish", tmp_path)
    r = sink.report
    assert (r.logged, r.dropped, r.errors, r.abandoned, r.finished, r.timed_out) == (13, 0, 0, 0, True, False)


def test_the_caller_copies_the_metrics_so_later_changes_do_not_leak(tmp_path):
    backend = Recording()
    sink = AsyncSink(backend)
    m = {"x": 1.0}
    sink.log_step(0, m)
    m["x"] = 2.0
    sink.finish(None, timeout_s=5)
    assert backend.calls[0] == ("log_step", (0, {"x": 1.0}))


def test_a_hanging_backend_drops_instead_of_blocking_and_finish_keeps_its_deadline(caplog):
    backend = Hanging()
    sink = AsyncSink(backend, queue_size=8, name="hang")
    sink.start({}, {})
    sink.log_step(0, {"x": 0.0})
    assert backend.entered.wait(2.0)  # the worker is now stuck inside log_step
    n = 2000
    t0 = time.perf_counter()
    worst = 0.0
    with caplog.at_level(logging.WARNING, logger="charllm_nemo.sinks"):
        for s in range(1, n + 1):
            c0 = time.perf_counter()
            sink.log_step(s, {"x": float(s)})
            worst = max(worst, time.perf_counter() - c0)
        elapsed = time.perf_counter() - t0
        t1 = time.perf_counter()
        sink.finish(None, timeout_s=0.3)
        finish_s = time.perf_counter() - t1
    r = sink.report
    # A put each: microseconds, never a wait (a wait on the stuck call would never end at all);
    # the bounds only keep a preempted put on a loaded machine from deciding the verdict.
    assert elapsed < deadline(1.0) and worst < deadline(0.3)
    assert r.dropped == n - 8  # 8 fit in the queue behind the stuck call
    assert r.timed_out and not r.finished
    assert r.abandoned == 8 + 1  # the 8 queued behind the stuck call, and that call
    assert finish_s < 1.0
    assert sum("dropping new items" in m for m in caplog.messages) == 1  # said once
    assert any("timed out" in m and "dropped" in m for m in caplog.messages)
    backend.release.set()


def test_a_raising_backend_is_counted_and_logged_once_and_the_rest_still_runs(caplog):
    backend = Raising()
    sink = AsyncSink(backend, queue_size=64)
    with caplog.at_level(logging.WARNING, logger="charllm_nemo.sinks"):
        sink.start({}, {})
        for s in range(20):
            sink.log_step(s, {"x": 1.0})  # never raises here
        sink.finish(None, timeout_s=5)
    r = sink.report
    assert (r.errors, r.logged, r.finished) == (20, 2, True)  # start and finish still ran
    assert sum("raised ConnectionError" in m for m in caplog.messages) == 1
    assert backend.calls[-1] == ("finish", None)


def test_after_a_failed_start_the_backend_is_left_alone():
    class NoStart(Recording):
        def start(self, config: dict[str, Any], manifest: dict[str, Any]) -> None:
            raise RuntimeError("wandb.init failed")

    backend = NoStart()
    sink = AsyncSink(backend)
    sink.start({}, {})
    for s in range(5):
        sink.log_step(s, {})
    sink.finish(None, timeout_s=5)
    r = sink.report
    assert backend.calls == []
    assert (r.errors, r.skipped, r.finished) == (1, 5, False)


def test_a_hanging_finish_returns_on_time_and_calls_after_finish_are_dropped():
    class SlowFinish(Recording):
        def finish(self, run_dir: Path | None) -> None:
            time.sleep(30)

    sink = AsyncSink(SlowFinish())
    t0 = time.perf_counter()
    sink.finish(None, timeout_s=0.2)
    assert time.perf_counter() - t0 < deadline(1.0)  # far below the 30 s finish
    assert sink.report.timed_out
    sink.log_step(1, {})
    sink.finish(None)  # idempotent: returns at once
    assert sink.report.dropped == 0  # the report is the one made at finish
    assert sink.dropped == 1


def test_log_figures_builds_the_keys_on_the_sink_thread():
    from charllm_nemo.sinks.keys import STEP_KEY, pack_step_figures

    built_on: list[str] = []

    def keys(step: int, summary: Any, gathered: Any) -> dict[str, float | int]:
        built_on.append(threading.current_thread().name)
        if step == 2:
            raise ValueError("a bad vector")
        return {STEP_KEY: step, "train/loss": summary["loss"], "n": len(gathered)}

    backend = Recording()
    sink = AsyncSink(backend, step_keys=keys, name="t")
    vec = pack_step_figures({"energy_j": 1.0})
    for s in range(4):
        sink.log_figures(s, {"loss": 0.5}, [vec, vec])
    sink.finish(None, timeout_s=5)
    assert built_on == ["charllm-sink-t"] * 4
    logged = [c[1] for c in backend.calls if c[0] == "log_step"]
    assert logged == [(s, {STEP_KEY: s, "train/loss": 0.5, "n": 2}) for s in (0, 1, 3)]
    assert sink.report.errors == 1


def test_the_default_keys_of_log_figures_are_step_metrics():
    from charllm_nemo.sinks.keys import pack_step_figures, step_metrics, unpack_gathered

    backend = Recording()
    sink = AsyncSink(backend)
    gathered = [pack_step_figures({"energy_j": 2.0, "power_avg_w": 20.0})]
    sink.log_figures(5, {"loss": 1.5, "step_time_s": 0.1}, gathered)
    sink.finish(None, timeout_s=5)
    want = step_metrics(5, summary={"loss": 1.5, "step_time_s": 0.1}, per_rank=unpack_gathered(gathered))
    assert backend.calls == [("log_step", (5, want)), ("finish", None)]


def test_the_thread_takes_its_queue_in_batches_not_a_wake_a_step(tmp_path):
    # #40: the sink thread woke at every put (every step); now it rests batch_s between batches,
    # and finish cuts the rest short: 30 steps put within the rest are taken in one more wake
    backend = Recording()
    sink = AsyncSink(backend, queue_size=64, batch_s=600.0)
    sink.start({"a": 1}, {})  # wakes the thread: the first batch
    end = time.monotonic() + deadline(30)
    while not backend.calls and time.monotonic() < end:
        time.sleep(0.01)
    for s in range(30):
        sink.log_step(s, {"x": float(s)})
    assert backend.calls == [("start", {"a": 1})]  # resting: nothing taken yet
    sink.finish(tmp_path, timeout_s=60)
    assert not sink.report.timed_out  # finish did not wait out the rest (600 s)
    assert [c[1][0] for c in backend.calls if c[0] == "log_step"] == list(range(30))
    assert backend.calls[-1][0] == "finish" and sink.report.logged == 32
    assert sink.wakes == 2
