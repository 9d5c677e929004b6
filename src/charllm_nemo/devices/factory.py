"""Pick a device backend by name, or the first that works (``auto``)."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from charllm_nemo.devices.base import Backend
from charllm_nemo.errors import BackendUnavailable, ConfigError

log = logging.getLogger("charllm_nemo.devices")

# name -> module that exposes open_backend(indices=None, **options)
_MODULES: dict[str, str] = {
    "nvml": "charllm_nemo.devices.nvml",
    "amdsmi": "charllm_nemo.devices.amdsmi",
    "synthetic": "charllm_nemo.devices.synthetic",
}
BACKEND_NAMES: tuple[str, ...] = ("auto", *_MODULES)


def _open(name: str, indices: Sequence[int] | None, options: dict[str, Any]) -> Backend:
    module = importlib.import_module(_MODULES[name])
    backend: Backend = module.open_backend(indices, **options)
    return backend


@dataclass(frozen=True)
class ProcessPlan:
    """How a backend opened in a telemetry process takes what the training process knows:
    ``options`` (picklable) go to its ``open_backend`` there; ``shared_activity``, when not None,
    is the backend's own word for how the level the training process publishes (through its
    ActivityInput's ``on_change``) is read there; ``observe_parent``: the devices model the
    training process (its CPU use, its memory), so they are told its pid."""

    options: dict[str, Any] = field(default_factory=dict)
    shared_activity: str | None = None
    observe_parent: bool = False


def process_plan(name: str, options: dict[str, Any]) -> ProcessPlan:
    """The :class:`ProcessPlan` of backend ``name`` (not ``auto``: the one the training process
    opened) with ``options``: the backend module's ``process_plan(options)`` where it has one,
    else the options as they are. Raises ConfigError for options that cannot cross."""
    hook = getattr(importlib.import_module(_MODULES[name]), "process_plan", None)
    if hook is None:
        return ProcessPlan(dict(options))
    plan: ProcessPlan = hook(dict(options))
    return plan


def open_in_process(
    name: str,
    indices: Sequence[int] | None,
    plan: ProcessPlan,
    *,
    parent_pid: int,
    published_level: Callable[[], float],
) -> Backend:
    """Open backend ``name`` in a telemetry process by ``plan``: ``parent_pid`` is the training
    process, ``published_level()`` the level its ActivityInput last published (NaN: none yet).
    The backend module's ``process_activity(mode, published_level, parent_pid)`` turns a plan's
    ``shared_activity`` into its options."""
    options = dict(plan.options)
    if plan.observe_parent:
        options["observe_pid"] = parent_pid
    if plan.shared_activity is not None:
        module = importlib.import_module(_MODULES[name])
        options.update(module.process_activity(plan.shared_activity, published_level, parent_pid))
    return open_backend(name, indices, **options)


def open_backend(name: str = "auto", indices: Sequence[int] | None = None, **options: Any) -> Backend:
    """Open a backend: ``nvml``, ``amdsmi``, ``synthetic``, or ``auto``.

    ``auto`` tries NVML, then AMD SMI, then falls back to the synthetic model with a loud
    warning. ``indices`` selects devices by host index (None = all). ``options`` go to the
    backend (e.g. ``count=`` and ``activity=`` for synthetic).
    """
    if name not in BACKEND_NAMES:
        raise ConfigError(
            f"telemetry.backend={name!r} is not a known backend; use one of {', '.join(BACKEND_NAMES)}"
        )
    if name != "auto":
        backend = _open(name, indices, options)
        if name == "synthetic":
            _warn_synthetic()
        return backend
    reasons = []
    for candidate in ("nvml", "amdsmi"):
        try:
            return _open(candidate, indices, {})
        except BackendUnavailable as exc:
            reasons.append(f"{candidate}: {exc}")
    log.warning("no GPU telemetry backend is usable (%s)", "; ".join(reasons))
    backend = _open("synthetic", indices, options)
    _warn_synthetic()
    return backend


def _warn_synthetic() -> None:
    msg = (
        "charllm-nemo is using the SYNTHETIC device: power, temperature and clocks come from a "
        "model, not from hardware. Every sample and the manifest say 'synthetic'."
    )
    log.warning(msg)
