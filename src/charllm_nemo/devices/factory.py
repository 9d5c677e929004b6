"""Pick a device backend by name, or the first that works (``auto``)."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
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
