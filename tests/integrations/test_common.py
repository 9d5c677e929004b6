"""The framework-free part every integration shares (charllm_nemo.integrations._common)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from charllm_nemo.errors import ConfigError
from charllm_nemo.integrations._common import (
    IntegrationOptions,
    LoggersObserver,
    loss_of,
    open_step_telemetry,
)
from charllm_nemo.steps import StepReport, StepsFileObserver, WandbObserver
from charllm_nemo.telemetry.config import Placement


@pytest.mark.parametrize(
    ("field", "value"), [("log_to", "both"), ("attention_flops", "half"), ("key_prefix", 3)]
)
def test_options_name_the_owner_field_and_the_choices(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"PowerThermalCallback.{field}="):
        IntegrationOptions(**{field: value}).validate("PowerThermalCallback")


def test_loss_of_what_frameworks_return() -> None:
    assert loss_of(torch.tensor(2.5)) == 2.5
    assert loss_of({"loss": torch.tensor(1.0)}) == 1.0
    assert loss_of({"lm loss": torch.tensor([0.5])}) == 0.5  # Bridge / Megatron-LM's loss_dict
    assert loss_of({"reduced_train_loss": 3}) == 3.0
    assert loss_of(None) is None and loss_of({"other": 1.0}) is None
    assert loss_of(torch.ones(3)) is None  # not a scalar: no loss invented


def test_loggers_observer_gives_numbers_under_the_prefix_at_the_reports_step() -> None:
    got: list[tuple[dict[str, float], int]] = []
    obs = LoggersObserver(lambda m, s: got.append((m, s)), prefix="charllm/")
    obs.on_step(StepReport(step=7, loss=1.5, step_time_s=0.25, energy_j=100.0, mfu_attention="causal"))
    ((metrics, step),) = got
    assert step == 7
    assert metrics["charllm/energy_j"] == 100.0 and metrics["charllm/loss"] == 1.5
    assert "charllm/step" not in metrics and "charllm/mfu_attention" not in metrics  # not numbers
    assert all(v is not None for v in metrics.values())


def test_wandb_or_trainer_loggers_never_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # log_to="wandb": charllm's W&B sink is an observer (offline here); the trainer's loggers get nothing
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    opts = IntegrationOptions(
        backend="synthetic", sampler="thread", out_dir=str(tmp_path / "run"), log_to="wandb"
    )
    st, run_dir = open_step_telemetry(opts, Placement(), framework="test", sources={"step": "test"})
    try:
        kinds = [type(o) for o in st.observers]
        assert WandbObserver in kinds and StepsFileObserver in kinds
        assert LoggersObserver not in kinds
        st.begin_step(0)
        st.end_step(loss=1.0)
    finally:
        st.finish("complete")
    assert run_dir == str(tmp_path / "run")
    assert (tmp_path / "run" / "steps.jsonl").read_text().count("\n") == 1


def test_alerts_reach_the_trainer_loggers_and_the_users_function(tmp_path: Path) -> None:
    from charllm_nemo.alerts import AlertObserver

    got: list[tuple[dict[str, float], int]] = []
    mine: list[dict[str, Any]] = []
    opts = IntegrationOptions(backend="synthetic", sampler="thread", out_dir=str(tmp_path / "run"))
    st, _ = open_step_telemetry(
        opts, Placement(), framework="test", sources={"step": "test"},
        observers=[LoggersObserver(lambda m, s: got.append((m, s)))], on_alert=mine.append,
    )  # fmt: skip
    try:
        (alerter,) = [o for o in st.observers if isinstance(o, AlertObserver)]
        assert st.marker.sum_phases  # alerts on: every rank sums its phases
        alerter._deliver({"kind": "straggler", "step": 3, "rank": 1, "message": "m"})
    finally:
        st.finish("complete")
    assert ({"charllm/alerts/straggler": 1.0}, 3) in got
    assert [a["kind"] for a in mine] == ["straggler"]
    off = IntegrationOptions(
        backend="synthetic", sampler="thread", out_dir=str(tmp_path / "off"), alerts=False
    )
    st, _ = open_step_telemetry(off, Placement(), framework="test", sources={"step": "test"})
    st.finish("complete")
    assert not any(isinstance(o, AlertObserver) for o in st.observers) and not st.marker.sum_phases


def test_an_alert_from_the_alert_thread_reaches_the_loggers_from_the_training_thread() -> None:
    import threading

    calls: list[tuple[dict[str, float], int, str]] = []
    obs = LoggersObserver(lambda m, s: calls.append((m, s, threading.current_thread().name)))
    alerting = threading.Thread(
        target=obs.log_alert, args=({"kind": "throttle_onset", "step": 4, "rank": 2},), name="charllm-alerts"
    )
    alerting.start()
    alerting.join()
    assert calls == []  # not from the alert thread
    obs.on_step(StepReport(step=5, loss=1.0, step_time_s=0.1))
    me = threading.current_thread().name
    assert calls[0] == ({"charllm/alerts/throttle_onset": 2.0}, 4, me)
    assert calls[1][1] == 5 and calls[1][2] == me
    obs.log_alert({"kind": "straggler", "step": 6, "rank": None})
    obs.close("complete")  # what is left goes at close
    assert calls[-1] == ({"charllm/alerts/straggler": -1.0}, 6, me)
