"""Power-smoothing and workload-power-profile state of one NVIDIA GPU, read once at open for the
manifest (``identity.extra["power_state"]``).

Both are newer NVML features (power smoothing: GB200/GB300-class boards; workload power profiles:
Blackwell, driver 570+). Every item is read on its own and recorded either as its value or as
``"unavailable: <why>"`` (the binding or the driver lacks the entry point, the device answers
NOT_SUPPORTED, ...), so a manifest says what the driver said rather than leaving a key out.
Nothing here is called while sampling.
"""

from __future__ import annotations

import ctypes
from typing import Any

from charllm_nemo.devices.nvml_sources import (
    FIELD_RC,
    FIELD_STRIDE,
    FIELD_VALUE,
    FIELD_VT,
    NVML_SUCCESS,
    FieldBatch,
    decode,
    error_name,
    resolve,
)

# nvml.h field ids, used when the installed binding predates the name.
SMOOTHING_FIELDS: dict[str, tuple[str, int]] = {
    "enabled": ("NVML_FI_PWR_SMOOTHING_ENABLED", 251),
    "privilege_level": ("NVML_FI_PWR_SMOOTHING_PRIV_LVL", 252),
    "applied_tmp_ceiling": ("NVML_FI_PWR_SMOOTHING_APPLIED_TMP_CEIL", 254),
    "applied_tmp_floor": ("NVML_FI_PWR_SMOOTHING_APPLIED_TMP_FLOOR", 255),
    "active_preset_profile": ("NVML_FI_PWR_SMOOTHING_ACTIVE_PRESET_PROFILE", 264),
}
_PROFILES_FN = "nvmlDeviceWorkloadPowerProfileGetCurrentProfiles"
_PROFILES_VERSION = 0x1000064  # nvmlWorkloadPowerProfileCurrentProfiles_v1: 100 bytes, version 1
_PROFILE_PREFIX = "NVML_POWER_PROFILE_"


class _CurrentProfiles(ctypes.Structure):
    """nvmlWorkloadPowerProfileCurrentProfiles_v1_t: three 255-bit masks of profile ids."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("perfProfilesMask", ctypes.c_uint * 8),
        ("requestedProfilesMask", ctypes.c_uint * 8),
        ("enforcedProfilesMask", ctypes.c_uint * 8),
    ]


def _unavailable(why: str) -> str:
    return f"unavailable: {why}"


def smoothing_state(p: Any, handle: Any) -> dict[str, Any]:
    """Each power-smoothing field's value, or why it is unavailable."""
    field_fn = resolve(p, "nvmlDeviceGetFieldValues")
    if field_fn is None:
        return {k: _unavailable("nvmlDeviceGetFieldValues not in this driver") for k in SMOOTHING_FIELDS}
    ids = [int(getattr(p, name, default)) for name, default in SMOOTHING_FIELDS.values()]
    rc, raw = FieldBatch([(i, 0) for i in ids]).fetch(field_fn, handle)
    out: dict[str, Any] = {}
    for k, key in enumerate(SMOOTHING_FIELDS):
        b = FIELD_STRIDE * k
        frc = rc if rc != NVML_SUCCESS else raw[b + FIELD_RC]
        value = decode(raw[b + FIELD_VT], raw[b + FIELD_VALUE]) if frc == NVML_SUCCESS else None
        out[key] = (
            value if value is not None else _unavailable(error_name(p, frc) if frc else "unknown valueType")
        )
    return out


def _profile_names(p: Any) -> dict[int, str]:
    names = {}
    for attr in dir(p):
        value = getattr(p, attr)
        if attr.startswith(_PROFILE_PREFIX) and isinstance(value, int) and attr != f"{_PROFILE_PREFIX}MAX":
            names[value] = attr.removeprefix(_PROFILE_PREFIX).lower()
    return names


def _mask_ids(words: Any) -> list[int]:
    return [32 * w + bit for w in range(8) for bit in range(32) if int(words[w]) >> bit & 1]


def workload_profiles(p: Any, handle: Any) -> dict[str, Any] | str:
    """The requested and enforced workload power profiles (names, or ``profile_<id>`` for an id
    the binding does not name), or why they are unavailable."""
    fn = resolve(p, _PROFILES_FN)
    if fn is None:
        return _unavailable(f"{_PROFILES_FN} not in this driver")
    buf = _CurrentProfiles(version=_PROFILES_VERSION)
    rc = int(fn(handle, ctypes.byref(buf)))
    if rc != NVML_SUCCESS:
        return _unavailable(error_name(p, rc))
    names = _profile_names(p)

    def named(words: Any) -> list[str]:
        return [names.get(i, f"profile_{i}") for i in _mask_ids(words)]

    return {"requested": named(buf.requestedProfilesMask), "enforced": named(buf.enforcedProfilesMask)}


def power_state(p: Any, handle: Any) -> dict[str, Any]:
    """What goes into the manifest: ``{"smoothing": {...}, "workload_profiles": {...} | str}``."""
    return {"smoothing": smoothing_state(p, handle), "workload_profiles": workload_profiles(p, handle)}
