"""The framework-free per-step telemetry API (docs/integrations.md, "The step-telemetry API").

What a training loop or an integration imports:

* :class:`StepTelemetry`: one per rank; ``timers(inner)`` for Megatron-Core's ``config.timers``,
  ``begin_step`` / ``phase`` / ``end_step`` / ``finish``; made with :class:`StepOptions` and
  :class:`RateInputs` (or ready :class:`StepRates`).
* :class:`StepReport`: one step over all ranks, as rank 0's observers receive it.
* Observers: :class:`Observer` (the protocol), :class:`ConsoleObserver`,
  :class:`StepsFileObserver`, :class:`WandbObserver`, :class:`FunctionObserver`.
* :class:`StepRates`: throughput / MFU constants of a run (from a
  :class:`~charllm_nemo.metrics.flops.ModelShape`).

The rank's telemetry session comes from :func:`charllm_nemo.telemetry.config.open_session`,
its placement from :class:`charllm_nemo.telemetry.config.Placement`. Nothing here imports
``charllm_nemo.train`` or a training framework at import time.
"""

from charllm_nemo.steps.marks import StepMarker, StepTiming
from charllm_nemo.steps.observers import (
    STEPS_FILE,
    ConsoleObserver,
    FunctionObserver,
    Observer,
    StepsFileObserver,
    WandbObserver,
    format_report,
)
from charllm_nemo.steps.options import RateInputs, StepOptions
from charllm_nemo.steps.rates import StepRates
from charllm_nemo.steps.report import StepReport
from charllm_nemo.steps.telemetry import StepOutcome, StepTelemetry
from charllm_nemo.steps.timers import TimersAdapter

__all__ = [
    "STEPS_FILE",
    "ConsoleObserver",
    "FunctionObserver",
    "Observer",
    "RateInputs",
    "StepMarker",
    "StepOptions",
    "StepOutcome",
    "StepRates",
    "StepReport",
    "StepTelemetry",
    "StepTiming",
    "StepsFileObserver",
    "TimersAdapter",
    "WandbObserver",
    "format_report",
]
