"""The one function that makes a rank's :class:`~charllm_nemo.steps.StepTelemetry` from its
typed options: the trainer (train/loop.py) and every integration (integrations/_common.py's
``open_step_telemetry``) open their step telemetry through it, so the alerts' wiring (the alert
observer first on rank 0; phase sums and rank facts on every rank) is declared once.

It lives here, below both (tests/test_layers.py: ``train`` and ``integrations`` are one layer and
may not import each other). The alert observer and a W&B sink come from higher layers
(charllm_nemo.alerts, charllm_nemo.sinks), so the caller hands in how to make the alert observer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from charllm_nemo.steps.observers import Observer
from charllm_nemo.steps.options import RateInputs, StepOptions
from charllm_nemo.steps.rates import StepRates
from charllm_nemo.steps.session import StepSession
from charllm_nemo.steps.telemetry import StepTelemetry

if TYPE_CHECKING:
    from charllm_nemo.telemetry.config import Placement
    from charllm_nemo.telemetry.windows import WindowRecorder

Alerter = Callable[[Sequence[Observer]], Observer | None]
"""Makes rank 0's alert observer, given the rank's other observers (where it finds the W&B sink
and the framework loggers it reports to); None when it installs nothing."""


def build_step_telemetry(
    session: StepSession | None,
    placement: Placement,
    options: StepOptions,
    *,
    rates: StepRates | RateInputs | None = None,
    observers: Sequence[Observer] = (),
    alerter: Alerter | None = None,
    group: Any = None,
    recorder: WindowRecorder | None = None,
) -> StepTelemetry:
    """This rank's StepTelemetry. ``observers``: rank 0's (steps.jsonl, console, W&B, ...).
    ``alerter``: None for alerts off; else every rank sums its phases by group and sends its
    facts once (``phase_times`` / ``rank_info``), and on rank 0 the observer it makes comes
    first (closed first: its last queued alerts reach the others still open)."""
    obs = list(observers)
    if alerter is not None:
        options = replace(options, phase_times=True, rank_info=True)
        if placement.rank == 0:
            alert_obs = alerter(obs)
            if alert_obs is not None:
                obs.insert(0, alert_obs)
    return StepTelemetry(
        session, placement, options=options, rates=rates, observers=obs, group=group, recorder=recorder
    )
