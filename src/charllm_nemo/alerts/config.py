"""The ``alerts`` config group (conf/alerts/*.yaml): what rank 0 watches for, and where it says so.

Framework-free; :func:`alerts_problems` checks every field (each message names
``alerts.<field>``, the value and a fix). docs/alerts.md lists every alert and threshold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from charllm_nemo.devices.contract import LIMITING_REASONS


@dataclass
class AlertsConfig:
    """Live alerts on rank 0 (docs/alerts.md). Shares are fractions (0.05 = 5 %), times in s,
    temperatures in °C, counts in steps.

    Where they go: ``console`` (rank 0's stderr), ``file`` (``alerts.jsonl`` in the run
    directory), ``wandb`` (``wandb.alert`` and ``alerts/*`` keys, when a W&B sink runs),
    ``hook`` (``"package.module:function"``, called with each alert's dict; integrations also
    take a callable). Rate limit: an alert of one kind for one rank (or node) again only after
    ``repeat_after_steps`` steps, and at most ``max_per_step`` alerts a step."""

    enabled: bool = True
    console: bool = True
    file: bool = True
    wandb: bool = True
    hook: str | None = None
    # throttle onset / end
    throttle_reasons: list[str] = field(
        default_factory=lambda: ["hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"]
    )
    throttle_min_share: float = 0.05  # share of the step under an alerting reason that counts
    throttle_end_steps: int = 2  # steps below it that end a throttle episode
    baseline_steps: int = 8  # the rank's recent unthrottled steps its cost is measured against
    # stragglers
    straggler_threshold: float = 0.15  # a rank's time above its peers' median by this share
    straggler_steps: int = 3  # ... for this many steps in a row
    straggler_min_s: float = 0.002  # ... and by at least this many seconds
    warmup_steps: int = 2  # steps not judged for stragglers (first-step compiles, caches)
    host_pressure: float = 0.1  # share of a step the host's CPUs held a rank that says host contention
    # thermal imbalance (per node), power
    thermal_imbalance_c: float = 15.0  # hottest minus coolest rank of a node
    power_over_limit: float = 0.05  # a rank's average power above its limit by this share
    sampler_missed: int = 10  # a rank's sampler missed at least this many deadlines since the last step
    # the job's power as the grid sees it (alerts/grid.py); null: not watched
    power_swing_limit_w: float | None = None  # job swing (sum of the ranks' peak - trough in a step)
    power_ramp_limit_w_s: float | None = None  # job ramp (sum of the ranks' steepest rise or fall)
    power_limit_steps: int = 3  # ... reached in this many ...
    power_limit_window: int = 5  # ... of the last this many steps
    # rate limit
    repeat_after_steps: int = 100
    max_per_step: int = 8


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def alerts_problems(cfg: AlertsConfig) -> list[str]:
    """Every problem of ``cfg``, one message each; empty when valid."""
    out: list[str] = []
    for name in ("enabled", "console", "file", "wandb"):
        if not isinstance(getattr(cfg, name), bool):
            out.append(f"alerts.{name}={getattr(cfg, name)!r} must be true or false")
    hook = cfg.hook
    if hook is not None and (not isinstance(hook, str) or hook.count(":") != 1 or not all(hook.split(":"))):
        out.append(f"alerts.hook={hook!r} must be null or 'package.module:function'")
    reasons = cfg.throttle_reasons
    if not isinstance(reasons, (list, tuple)) or any(r not in LIMITING_REASONS for r in reasons):
        out.append(f"alerts.throttle_reasons={reasons!r} must be a list of {list(LIMITING_REASONS)}")
    for name, lo, hi in (
        ("throttle_min_share", 0.0, 1.0),
        ("straggler_threshold", 0.0, 10.0),
        ("straggler_min_s", 0.0, 3600.0),
        ("host_pressure", 0.0, 1.0),
        ("thermal_imbalance_c", 0.0, 200.0),
        ("power_over_limit", 0.0, 10.0),
    ):
        v = getattr(cfg, name)
        if not _num(v) or not lo <= v <= hi:
            out.append(f"alerts.{name}={v!r} must be a number in [{lo:g}, {hi:g}]")
    for name in ("power_swing_limit_w", "power_ramp_limit_w_s"):
        v = getattr(cfg, name)
        if v is not None and (not _num(v) or not 0 < v <= 1e12):
            out.append(f"alerts.{name}={v!r} must be null (not watched) or a number > 0")
    k, n = cfg.power_limit_steps, cfg.power_limit_window
    if _int(k) and _int(n) and k > n >= 1:
        out.append(f"alerts.power_limit_steps={k} must be <= alerts.power_limit_window={n}")
    for name, lo in (
        ("power_limit_steps", 1),
        ("power_limit_window", 1),
        ("throttle_end_steps", 1),
        ("baseline_steps", 1),
        ("straggler_steps", 1),
        ("warmup_steps", 0),
        ("repeat_after_steps", 1),
        ("sampler_missed", 1),
        ("max_per_step", 1),
    ):
        v = getattr(cfg, name)
        if not _int(v) or v < lo:
            out.append(f"alerts.{name}={v!r} must be an integer >= {lo}")
    return out
