"""The seam between the step API and a rank's telemetry session: what StepTelemetry uses of it,
as a Protocol that mypy checks the real session against."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from charllm_nemo.devices.base import Backend
    from charllm_nemo.telemetry.sample_loop import SamplerHealth
    from charllm_nemo.telemetry.session import TelemetrySession
    from charllm_nemo.telemetry.windows import WindowRecorder


class StepSession(Protocol):
    """What the step API uses of a rank's telemetry session (telemetry/session.py
    ``TelemetrySession``; mypy checks the real one against it, tests/steps)."""

    @property
    def rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def hz(self) -> float: ...
    @property
    def counter_every(self) -> int: ...
    @property
    def sampler_mode(self) -> str: ...
    @property
    def windows(self) -> WindowRecorder: ...
    @property
    def backend(self) -> Backend: ...
    @property
    def health(self) -> SamplerHealth: ...

    def request_figures(
        self, t_begin_mono_ns: int, t_end_mono_ns: int, figures: Collection[str] | None = None, batch: int = 1
    ) -> None: ...

    def step_figures(
        self,
        t_begin_mono_ns: int,
        t_end_mono_ns: int,
        wait_s: float = 0.0,
        figures: Collection[str] | None = None,
    ) -> list[dict[str, Any]] | None: ...

    def close(self, status: str = "complete") -> str: ...


if TYPE_CHECKING:

    def _the_session_is_a_step_session(session: TelemetrySession) -> StepSession:
        return session  # mypy: the real session keeps the seam this module uses
