"""The paper's sweeps as resumable Hydra multiruns (docs/sweeps.md): the sweep directory and
its manifest (manifest.py), states from attempts and SLURM (status.py), planning before
submission (plan.py) and the job side (job.py). The Hydra plugins that drive them live in
``hydra_plugins/charllm_sweeps``.

The public API (what a user or a script may import from here): :class:`SweepManifest`,
:func:`load_manifest`, :func:`find_sweeps` (manifest.py); :func:`refresh`, :func:`status_lines`
(status.py); :func:`plan_configuration`, :class:`Verdict` (plan.py); :func:`run_sweep_job`
(job.py). Each is imported when first used (``import charllm_nemo.sweep`` imports neither
Hydra nor torch).
"""

from __future__ import annotations

from typing import Any

from charllm_nemo._exports import lazy_attribute

_WHERE = {
    "SweepManifest": "manifest",
    "load_manifest": "manifest",
    "find_sweeps": "manifest",
    "refresh": "status",
    "status_lines": "status",
    "plan_configuration": "plan",
    "Verdict": "plan",
    "run_sweep_job": "job",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _WHERE, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
