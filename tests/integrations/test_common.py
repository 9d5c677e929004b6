"""The framework-free part every integration shares (charllm_nemo.integrations._common)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from charllm_nemo.errors import ConfigError
from charllm_nemo.integrations._common import (
    IntegrationOptions,
    LoggersObserver,
    RunFacts,
    loss_of,
    open_step_telemetry,
)
from charllm_nemo.steps import StepReport, StepsFileObserver, WandbObserver
from charllm_nemo.telemetry.config import Placement

BAD = [
    ({"hz": 0}, "hz=0 "),
    ({"hz": "x"}, "hz='x' "),
    ({"hz": -5}, "hz=-5 "),
    ({"hz": float("nan")}, "hz=nan "),
    ({"counter_hz": 0}, "counter_hz=0 "),
    ({"backend": "nvm"}, "backend='nvm' "),
    ({"sampler": "proces"}, "sampler='proces' "),
    ({"windows": ["stepp"]}, "windows has unknown kinds ['stepp']"),
    ({"windows": "step,stepp"}, "windows has unknown kinds ['stepp']"),
    ({"windows": 3}, "windows=3 "),
    ({"log_to": "both"}, "log_to='both' "),
    ({"attention_flops": "half"}, "attention_flops='half' "),
    ({"key_prefix": 3}, "key_prefix=3 "),
    ({"console": "yes"}, "console='yes' "),
    ({"peak_tflops_per_gpu": -1}, "peak_tflops_per_gpu=-1 "),
    ({"peak_tflops_per_gpu": float("inf")}, "peak_tflops_per_gpu=inf "),
    ({"precision": "fp7"}, "precision='fp7' "),
    ({"hzz": 100}, "unknown option hzz;"),
]


def _entry_points() -> list[Any]:
    from charllm_nemo.integrations.bridge import PowerThermalBridgeCallback
    from charllm_nemo.integrations.megatron_lm import MegatronLMTelemetry

    return [PowerThermalBridgeCallback, MegatronLMTelemetry]


@pytest.mark.parametrize(("options", "expected"), BAD, ids=[str(o) for o, _ in BAD])
def test_every_option_is_checked_at_construction_named_as_written(
    options: dict[str, Any], expected: str
) -> None:
    # #34: refused in the constructor (NeMo-Run / Fiddle's build), one line, the keyword as the
    # user wrote it; the NeMo callback takes the same check (tests/integrations/test_nemo_callback.py)
    for cls in _entry_points():
        with pytest.raises(ConfigError) as info:
            cls(**options)
        message = str(info.value)
        assert message.startswith(f"{cls.__name__}: ") and expected in message, message
        assert "\n" not in message and "telemetry." not in message
    with pytest.raises(ConfigError, match=r"^Owner: "):
        IntegrationOptions.from_keywords("Owner", options)


def test_the_config_file_names_the_option_its_own_way() -> None:
    with pytest.raises(ConfigError, match=r"telemetry\.hz=0 .*e\.g\. telemetry\.hz=100"):
        IntegrationOptions(hz=0).validate("telemetry", name=lambda f: f"telemetry.{f}")


def test_an_impossible_out_dir_is_refused_without_making_anything(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for out_dir in (str(a_file), str(a_file / "run"), str(a_file / "{time}")):
        with pytest.raises(ConfigError, match=r"out_dir='"):
            IntegrationOptions.from_keywords("X", {"out_dir": out_dir})
    fine = tmp_path / "new" / "{time}"
    IntegrationOptions.from_keywords("X", {"out_dir": str(fine)})
    assert not (tmp_path / "new").exists()  # checked, not made: the run makes it when it opens


def test_a_windows_string_is_one_kind_or_a_comma_list() -> None:
    assert IntegrationOptions(windows="step").windows == ("step",)
    assert IntegrationOptions(windows="step, phase").windows == ("step", "phase")
    assert IntegrationOptions(windows=["microbatch"]).windows == ("microbatch",)
    for cls in _entry_points():
        assert cls(windows="step").options.windows == ("step",)


def test_the_entry_points_signatures_are_the_one_declaration() -> None:
    import inspect
    from dataclasses import fields

    declared = {f.name: getattr(IntegrationOptions(), f.name) for f in fields(IntegrationOptions)}
    for cls in _entry_points():
        params = inspect.signature(cls).parameters
        options = {
            n: p.default
            for n, p in params.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and n != "on_alert"
        }
        assert options == declared, cls
        assert "self" not in params


def test_the_integrations_take_the_telemetry_defaults() -> None:
    from charllm_nemo.telemetry.config import TelemetryConfig

    tel, opts = TelemetryConfig(), IntegrationOptions()
    for name in ("hz", "counter_hz", "backend", "sampler", "attention_flops", "overwrite", "enabled"):
        assert getattr(opts, name) == getattr(tel, name), name
    assert list(opts.windows) == tel.windows


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


def test_loggers_observer_logs_at_the_trainers_cadence_and_the_last_step_at_close() -> None:
    # every=3 (Lightning's log_every_n_steps): steps s with (s + 1) % 3 == 0, as Lightning logs its
    # own metrics, and the last report at close; an alert is logged whatever the step
    got: list[int] = []
    obs = LoggersObserver(lambda m, s: got.append(s), prefix="charllm/", every=3)
    for s in range(7):
        obs.on_step(StepReport(step=s, loss=1.0, step_time_s=0.1))
    assert got == [2, 5]
    obs.log_alert({"kind": "throttle", "step": 6, "rank": 0})
    obs.close("complete")
    assert got == [2, 5, 6, 6]  # step 6's report, then the alert at its step
    obs.close("complete")
    assert got == [2, 5, 6, 6]  # logged once


def test_wandb_or_trainer_loggers_never_both(tmp_path: Path, wandb_env: dict[str, str]) -> None:
    # log_to="wandb": charllm's W&B sink is an observer (offline here); the trainer's loggers
    # get nothing. #40: the sink was built but never started, so W&B got nothing: read the
    # offline run back and find every step's per-rank and cross-rank keys
    from tests.sinks.wandb_steps import assert_every_step_in_wandb

    opts = IntegrationOptions(
        backend="synthetic", sampler="thread", out_dir=str(tmp_path / "run"), log_to="wandb"
    )
    st, run_dir = open_step_telemetry(opts, Placement(), framework="test", sources={"step": "test"})
    try:
        kinds = [type(o) for o in st.observers]
        assert WandbObserver in kinds and StepsFileObserver in kinds
        assert LoggersObserver not in kinds
        for step in range(3):
            st.begin_step(step)
            time.sleep(0.02)  # a few samples a step at 100 Hz
            st.end_step(loss=1.0 + step)
    finally:
        st.finish("complete")
    assert run_dir == str(tmp_path / "run")
    assert (tmp_path / "run" / "steps.jsonl").read_text().count("\n") == 3
    run = assert_every_step_in_wandb(tmp_path / "run")
    assert run.config["integration"]["framework"] == "test"  # the run's config: the options
    assert run.config["manifest"]["backend"] == "synthetic"


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


def test_a_rate_that_cannot_be_computed_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    # #34: no silent nulls; the integrations refuse peak_tflops_per_gpu=-1 first, this is the
    # last line for a caller who builds the rates by hand
    from charllm_nemo.steps.rates import StepRates

    rates = StepRates(
        model_flops_per_step=1e12, global_batch_size=4, seq_length=8, world_size=1, peak_tflops_per_gpu=-1
    )
    with caplog.at_level("WARNING", logger="charllm_nemo.steps.rates"):
        for step in range(3):
            report = StepReport(step=step, loss=1.0, step_time_s=0.5)
            rates.fill(report)
            assert report.mfu is None
    said = [r for r in caplog.records if r.name == "charllm_nemo.steps.rates"]
    assert len(said) == 1 and "from step 0" in said[0].getMessage()


def test_an_out_dir_the_file_system_refuses_is_refused_at_construction(tmp_path: Path) -> None:
    # #40: as root, os.access says /proc is writable; the run's first folder then failed after
    # the model was built. The check asks the file system (an empty folder made and removed)
    for cls in _entry_points():
        with pytest.raises(
            ConfigError, match=r"out_dir='/proc/charllm-run/\d+-\d+' cannot be written: '/proc' refuses"
        ):
            cls(out_dir="/proc/charllm-run/{time}")  # {time}: made at once
    IntegrationOptions.from_keywords("X", {"out_dir": str(tmp_path / "run")})
    assert list(tmp_path.iterdir()) == []  # the probe left nothing


def test_a_late_error_names_the_keywords_the_user_wrote(tmp_path: Path) -> None:
    # #40: a run directory that already holds a run is found when training starts; the store's
    # message named `charllm train`'s telemetry.out_dir / --out / telemetry.overwrite=true
    from charllm_nemo.errors import StoreError

    opts = IntegrationOptions(
        backend="synthetic", sampler="thread", out_dir=str(tmp_path / "run"), alerts=False
    )
    st, _ = open_step_telemetry(opts, Placement(), framework="nemo", sources={"step": "test"})
    st.finish("complete")
    with pytest.raises(StoreError) as info:
        open_step_telemetry(opts, Placement(), framework="nemo", sources={"step": "test"})
    message = str(info.value)
    assert message.startswith("PowerThermalCallback: ") and "overwrite=True" in message, message
    assert "telemetry." not in message and "--out" not in message and "--overwrite" not in message


def test_mfu_that_cannot_be_computed_on_this_device_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # #40: on a CPU the peak is unknown, so MFU is null on every step: the docs promise a warning
    from charllm_nemo.metrics.flops import ModelShape

    shape = ModelShape(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=256,
        vocab_size=256,
        seq_length=32,
    )
    for peak, said in ((None, 1), (10.0, 0)):
        opts = IntegrationOptions(
            backend="synthetic", sampler="thread", out_dir=str(tmp_path / f"run-{peak}"), alerts=False,
            peak_tflops_per_gpu=peak, steps_file=False,
        )  # fmt: skip
        caplog.clear()
        with caplog.at_level("WARNING"):
            st, _ = open_step_telemetry(
                opts, Placement(), framework="test", sources={"step": "test"},
                run=RunFacts(model=shape, global_batch_size=4, seq_length=32),
            )  # fmt: skip
            for step in range(2):
                st.begin_step(step)
                st.end_step(loss=1.0)
            st.finish("complete")
        warned = [r.getMessage() for r in caplog.records if "no MFU" in r.getMessage()]
        assert len(warned) == said, warned
        if said:
            assert "peak_tflops_per_gpu=" in warned[0] and "CPU" in warned[0]


QUIET = """
import sys
from charllm_nemo.integrations.megatron_lm import MegatronLMTelemetry
if sys.argv[1] == "ours":
    MegatronLMTelemetry(hz=0)
from charllm_nemo.errors import ConfigError
raise ConfigError("hz=0 from elsewhere")  # not an integration's: the hook leaves it alone
"""


@pytest.mark.parametrize("case", ["ours", "ours-traceback", "other"])
def test_a_refused_option_left_uncaught_prints_its_message_alone(tmp_path: Path, case: str) -> None:
    # #40: a bad option printed ~100 lines of framework frames above its one line
    import os
    import subprocess
    import sys

    env = dict(os.environ, CHARLLM_TRACEBACK="1" if case == "ours-traceback" else "0")
    proc = subprocess.run(
        [sys.executable, "-c", QUIET, case.split("-")[0]], capture_output=True, text=True, env=env,
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    if case == "ours":
        # the message alone (its wording is the range check's, sample_loop.hz_problem), then the hint
        assert len(lines) == 2, proc.stderr
        assert lines[0].startswith(
            "ConfigError: MegatronLMTelemetry: hz=0 is not a sampling rate; use a rate in [1, 1000] Hz"
        ), proc.stderr
        assert lines[1] == "(CHARLLM_TRACEBACK=1 shows the traceback)", proc.stderr
    else:  # asked for, or not one of ours: the traceback as Python prints it
        assert lines[0] == "Traceback (most recent call last):", proc.stderr


def test_the_integrations_judge_tensor_expert_context_layouts_as_coupled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # #41: in tp/ep/cp layouts the collectives sit inside the phases, so the alerts must not
    # compare ranks by time alone; the integrations read that from megatron-core's parallel state
    import sys
    from types import SimpleNamespace

    from charllm_nemo.integrations._common import collectives_in_phases

    def state(tp: int, cp: int, ep: int, ready: bool = True) -> SimpleNamespace:
        return SimpleNamespace(
            model_parallel_is_initialized=lambda: ready,
            get_tensor_model_parallel_world_size=lambda: tp,
            get_context_parallel_world_size=lambda: cp,
            get_expert_model_parallel_world_size=lambda: ep,
        )

    monkeypatch.delitem(sys.modules, "megatron.core.parallel_state", raising=False)
    assert collectives_in_phases() is False  # no megatron-core loaded: data parallel as before
    for sizes, want in [((1, 1, 1), False), ((2, 1, 1), True), ((1, 2, 1), True), ((1, 1, 2), True)]:
        monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", state(*sizes))
        assert collectives_in_phases() is want, sizes
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", state(2, 1, 1, ready=False))
    assert collectives_in_phases() is False
