"""ObserverThread + ThreadedLoggersObserver: the training thread queues step reports;
TensorBoard gets them from the observer thread, any other logger from the training thread at
flush / close; order kept, nothing lost, a stuck logger bounded."""

from __future__ import annotations

import glob
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.conftest import require


class Recording:
    """A logger that is not known to be thread-safe: records (thread, step, metrics)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((threading.get_ident(), int(step or 0), dict(metrics)))


def _report(step: int) -> Any:
    from charllm_nemo.steps.report import StepReport

    return StepReport(step=step, loss=1.0 / (step + 1), step_time_s=0.01 * (step + 1), energy_j=2.0 * step)


def test_tensorboard_from_the_thread_others_at_flush_in_order(tmp_path: Path) -> None:
    require("lightning.pytorch")
    require("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from charllm_nemo.integrations._observer_thread import ObserverThread, ThreadedLoggersObserver

    tb = TensorBoardLogger(save_dir=str(tmp_path), name="tb")
    other = Recording()
    loggers = ThreadedLoggersObserver([tb, other], "charllm/")
    assert loggers.direct == [tb] and loggers.handed_over == [other]
    obs = ObserverThread([loggers])
    for step in range(5):
        obs.on_step(_report(step))
    assert other.calls == []  # never called from on_step: only where the training thread hands over
    loggers.log_alert({"kind": "straggler", "rank": 3, "step": 4})
    for step in range(5, 8):
        obs.on_step(_report(step))
    obs.close("complete")
    me = threading.get_ident()
    assert {t for t, _s, _m in other.calls} == {me}
    steps = [s for _t, s, m in other.calls if "charllm/step_time_s" in m]
    assert steps == list(range(8))
    by_step = {s: m for _t, s, m in other.calls if "charllm/step_time_s" in m}
    assert by_step[3]["charllm/energy_j"] == pytest.approx(6.0)
    assert any(m == {"charllm/alerts/straggler": 3.0} and s == 4 for _t, s, m in other.calls)
    tb.finalize("success")
    (events,) = glob.glob(str(tmp_path / "tb" / "**" / "events.out.tfevents.*"), recursive=True)
    acc = EventAccumulator(events)
    acc.Reload()
    assert [e.step for e in acc.Scalars("charllm/step_time_s")] == list(range(8))
    assert [e.step for e in acc.Scalars("charllm/alerts/straggler")] == [4]


def test_a_stuck_logger_drops_beyond_the_bound_and_close_waits_for_the_rest() -> None:
    require("lightning.pytorch")
    from charllm_nemo.integrations._observer_thread import ObserverThread, ThreadedLoggersObserver

    release = threading.Event()
    seen: list[int] = []

    class Stuck:
        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            release.wait(30)
            seen.append(int(step or 0))

    loggers = ThreadedLoggersObserver([], "charllm/")
    loggers.direct = [Stuck()]
    obs = ObserverThread([loggers], max_queued=3)
    for step in range(10):
        obs.on_step(_report(step))
    # the thread holds at most one report; the queue at most 3; the rest are counted as dropped
    assert 6 <= obs.dropped <= 7
    release.set()
    obs.close("complete")
    assert seen == sorted(seen) and len(seen) == 10 - obs.dropped
