"""What a rank's ``manifest.json`` says when its session opens (docs/store.md, "manifest.json"):
who the rank is, where it runs, what it samples and how, the clocks, the versions and the run's
configuration, with secrets redacted. The session (telemetry/session.py) makes it once, with
:func:`session_manifest`; the store (telemetry/store.py) writes it and adds the counts at close.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
import time
from typing import Any

import charllm_nemo
from charllm_nemo.devices.base import Backend
from charllm_nemo.redact import redact_secrets
from charllm_nemo.telemetry.clock import clock_at_start
from charllm_nemo.telemetry.session_options import Placement

ENV_KEYS: tuple[str, ...] = (
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_JOB_NODELIST",
    "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
)
"""The launcher's and the device runtime's variables the manifest keeps (``env``), those set."""


def package_versions() -> dict[str, str | None]:
    """Python's and the packages' versions that shape a run (None: not installed)."""
    from importlib import metadata

    out: dict[str, str | None] = {
        "python": platform.python_version(),
        "charllm-nemo": charllm_nemo.__version__,
    }
    for dist in (
        "numpy",
        "pyarrow",
        "nvidia-ml-py",
        "amdsmi",
        "torch",
        "megatron-core",
        "nemo-toolkit",
        "wandb",
    ):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def session_manifest(
    *,
    placement: Placement,
    backend: Backend,
    hz: float,
    sampler_mode: str,
    counter_rate: dict[str, Any],
    collector_sched: dict[str, str] | None,
    config: dict[str, Any] | None,
) -> dict[str, Any]:
    """The manifest of a session opening now: ``placement`` (who), ``backend`` (its devices and
    the metrics each supports), the sampling rate, the sampler mode, the counters' read rate and
    the collector's policy (process mode), and ``config``. Redacted once, here: every rewrite of
    the manifest (close, a lost telemetry process, a kill) starts from this dict, so none holds a
    token or password of the config or argv."""
    manifest = {
        "kind": "charllm-nemo telemetry",
        "rank": placement.rank,
        "local_rank": placement.local_rank,
        "world_size": placement.world_size,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "argv": list(sys.argv),
        "backend": backend.name,
        "synthetic": backend.name == "synthetic",
        "sampling_hz": hz,
        "sampler_mode": sampler_mode,
        "counter_reads": counter_rate,
        "collector_sched": collector_sched,
        "devices": [d.identity.to_dict() for d in backend.devices],
        "supported_metrics": {str(d.identity.index): d.supported_metrics() for d in backend.devices},
        "started_wall_ns": time.time_ns(),
        "started_mono_ns": time.monotonic_ns(),
        "clock": clock_at_start(),
        "versions": package_versions(),
        "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
        "config": config or {},
    }
    return redact_secrets(manifest)  # type: ignore[no-any-return]
