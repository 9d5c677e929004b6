"""#44: the path from a config to a running step telemetry takes typed option objects, not
their fields one by one; the integrations open it one way (integrations/_common.py
``open_step_telemetry``), and that and the trainer make it through one function
(steps/open.py ``build_step_telemetry``)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from charllm_nemo.alerts.observer import AlertObserver
from charllm_nemo.integrations._common import LoggersObserver
from charllm_nemo.integrations._observer_thread import ObserverThread, ThreadedLoggersObserver
from charllm_nemo.sinks.base import AsyncSink
from charllm_nemo.sinks.wandb import WandbSink
from charllm_nemo.steps import ConsoleObserver, StepsFileObserver, StepTelemetry, WandbObserver
from charllm_nemo.steps.marks import StepMarker
from charllm_nemo.telemetry.engine import ThreadEngine
from charllm_nemo.telemetry.process.parent import ProcessSampler
from charllm_nemo.telemetry.session import TelemetrySession
from charllm_nemo.telemetry.session_options import Placement, ProcessOptions, SessionOptions, StoreOptions

SRC = Path(__file__).resolve().parents[2] / "src" / "charllm_nemo"

PATH_CLASSES = (
    TelemetrySession,
    SessionOptions,
    StoreOptions,
    ProcessOptions,
    Placement,
    ThreadEngine,
    ProcessSampler,
    StepTelemetry,
    StepMarker,
    WandbSink,
    AsyncSink,
    WandbObserver,
    StepsFileObserver,
    ConsoleObserver,
    LoggersObserver,
    ThreadedLoggersObserver,
    ObserverThread,
    AlertObserver,
)
"""The objects a config becomes on the way to a running step telemetry, the session's typed
options among them (the config records themselves, TelemetryConfig / LoggerConfig / AlertsConfig
/ StepOptions, are the typed configs: one field per option)."""


def test_no_constructor_on_the_path_takes_more_than_8_parameters() -> None:
    wide = {c.__name__: n for c in PATH_CLASSES if (n := len(inspect.signature(c).parameters)) > 8}
    assert wide == {}


def _calls(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


def test_every_integration_opens_its_step_telemetry_through_open_step_telemetry() -> None:
    for name in ("nemo.py", "bridge.py", "megatron_lm.py"):  # nemo.py: NeMo 2 and plain Lightning
        calls = _calls(SRC / "integrations" / name)
        assert "open_step_telemetry" in calls, name
        assert not calls & {"StepTelemetry", "open_session", "TelemetrySession", "build_step_telemetry"}, name


def test_the_trainer_and_the_integrations_build_step_telemetry_through_one_function() -> None:
    # integrations/_common.py's open_step_telemetry and the trainer call steps/open.py's
    # build_step_telemetry (train and integrations are one layer: it sits below both) ...
    for path in (SRC / "integrations" / "_common.py", SRC / "train" / "loop.py"):
        calls = _calls(path)
        assert "build_step_telemetry" in calls, path.name
    # ... and no module of src/ but that one constructs a StepTelemetry
    makers = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if "StepTelemetry" in _calls(p))
    assert makers == ["steps/open.py"]


def test_the_config_becomes_session_options_in_one_place() -> None:
    # telemetry/config.py session_options is the one maker from a config; cli.py's
    # `charllm telemetry` builds its own from its flags (no config); the session makes the
    # defaults when given none; nothing else in src/ does.
    makers = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if "SessionOptions" in _calls(p))
    assert makers == ["cli.py", "telemetry/config.py", "telemetry/session.py"]
    sessions = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if "TelemetrySession" in _calls(p))
    assert sessions == ["cli.py", "telemetry/config.py"]
