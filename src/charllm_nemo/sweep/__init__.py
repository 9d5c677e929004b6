"""The paper's sweeps as resumable Hydra multiruns (docs/sweeps.md): states from attempts and
SLURM (status.py), planning before submission (plan.py). The sweep directory's manifest and the
job side (one attempt's states) are a training job's own bookkeeping, in the layer below:
charllm_nemo/train/sweep_manifest.py and sweep_job.py (``charllm train`` runs a sweep's job;
the sweep imports train, never the reverse: docs/architecture.md). The Hydra plugins that drive them live in
``hydra_plugins/charllm_sweeps``.

The public API (what a user or a script may import from here): :func:`refresh`,
:func:`status_lines` (status.py); :func:`plan_configuration`, :class:`Verdict` (plan.py); the
manifest (``SweepManifest``, ``load_manifest``, ``find_sweeps``) and ``run_sweep_job`` are
charllm_nemo.train's. Each is imported when first used (``import charllm_nemo.sweep`` imports neither
Hydra nor torch).
"""

from __future__ import annotations

from typing import Any

from charllm_nemo._exports import lazy_attribute

_WHERE = {
    "refresh": "status",
    "status_lines": "status",
    "plan_configuration": "plan",
    "Verdict": "plan",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _WHERE, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
