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


class Seen:
    """An observer that records the steps it saw and the thread it saw them on."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.threads: set[int] = set()
        self.infos: list[Any] = []
        self.got = threading.Event()
        self.got_info = threading.Event()

    def on_step(self, report: Any) -> None:
        self.steps.append(report.step)
        self.threads.add(threading.get_ident())
        self.got.set()

    def on_rank_info(self, infos: Any) -> None:
        self.infos.append(infos)
        self.got_info.set()

    def close(self, status: str) -> None:
        pass


def test_the_thread_is_woken_once_a_batch_not_once_a_step() -> None:
    # #40: the observer thread (and the alert thread) woke on every report; each wake costs the
    # training thread a GIL hand-over. Now one signal for `batch` reports (no timer runs)
    require("lightning.pytorch")
    from charllm_nemo.integrations._observer_thread import ObserverThread

    seen = Seen()
    obs = ObserverThread([seen], batch=4, max_delay_s=3600.0)
    for step in range(3):
        obs.on_step(_report(step))
    assert obs.wakes == 0 and not seen.got.wait(0.2)  # three waiting: not woken for them
    obs.on_step(_report(3))
    assert obs.wakes == 1 and seen.got.wait(30)
    for step in range(4, 10):
        obs.on_step(_report(step))
    assert obs.wakes == 2  # 10 reports: 2 batches of 4
    obs.on_rank_info([{"rank": 0}])  # passed on at once
    assert obs.wakes == 3
    obs.close("complete")  # the two left are taken at close
    assert seen.steps == list(range(10)) and seen.infos == [[{"rank": 0}]]
    assert threading.get_ident() not in seen.threads


def test_the_alert_checks_run_on_the_observer_thread_first_in_line(tmp_path: Path) -> None:
    require("lightning.pytorch")
    from types import SimpleNamespace

    from charllm_nemo.alerts import AlertsConfig, alert_observer
    from charllm_nemo.integrations._observer_thread import ObserverThread
    from charllm_nemo.integrations.nemo import _observers_off_thread
    from charllm_nemo.steps import StepsFileObserver

    alerter = alert_observer(AlertsConfig(), run_dir=tmp_path)
    on_training_thread, steps_file = Seen(), StepsFileObserver(tmp_path / "steps.jsonl")
    st = SimpleNamespace(observers=[alerter, on_training_thread, steps_file])
    _observers_off_thread(st)
    thread, rest = st.observers[0], st.observers[1:]
    assert isinstance(thread, ObserverThread) and thread.observers == [alerter, steps_file]
    assert rest == [on_training_thread]  # closed after the alerts' last ones reached W&B / loggers
    for step in range(3):
        for obs in st.observers:
            obs.on_step(_report(step))
    for obs in st.observers:
        obs.close("complete")
    assert alerter._thread is None  # no thread of its own: checked on the observer thread
    assert (tmp_path / "steps.jsonl").read_text().count("\n") == 3
