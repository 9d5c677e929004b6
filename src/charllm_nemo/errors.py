"""The package's own exceptions.

Setup errors carry a message a person can act on: what was wrong, the value, and a way out.
Nothing in the sampling loop raises these into the training process.
"""

from __future__ import annotations


class CharllmError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(CharllmError, ValueError):
    """A configuration value is invalid; the message names the field and a valid alternative."""


class BackendUnavailable(CharllmError):
    """A device backend cannot be used on this machine (library missing, no driver, no device)."""


class DeviceLost(CharllmError):
    """A device stopped answering during sampling (e.g. NVML_ERROR_GPU_IS_LOST).

    Raised by ``Device.read()`` only; the sampler catches it, logs one line and stops.
    """


class StoreError(CharllmError):
    """A run directory cannot be written or read (unwritable path, not a run directory)."""


class DiskFull(StoreError):
    """The disk (or quota) holding a run directory is full: ENOSPC / EDQUOT on a write.

    The store raises it from one write; a :class:`~charllm_nemo.telemetry.store.SegmentWriter`
    catches it, logs one line and stops writing segments (``disk_full``), and the session ends
    with status ``disk_full``.
    """
