"""#44: the path from a config to a running step telemetry takes typed option objects, not
their fields one by one, and the integrations open it one way (integrations/_common.py
``open_step_telemetry``)."""

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

SRC = Path(__file__).resolve().parents[2] / "src" / "charllm_nemo"

PATH_CLASSES = (
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
"""The objects a config becomes on the way to a running step telemetry (the option records
themselves, TelemetryConfig / LoggerConfig / AlertsConfig / StepOptions, are the typed configs:
one field per option)."""


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
        assert not calls & {"StepTelemetry", "open_session", "TelemetrySession"}, name
    # and only open_step_telemetry makes one among the integrations
    makers = [p.name for p in (SRC / "integrations").glob("*.py") if "StepTelemetry" in _calls(p)]
    assert makers == ["_common.py"]
