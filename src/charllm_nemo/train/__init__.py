"""The Megatron-Core trainer that ``charllm train`` and the Hydra recipes in conf/ drive.

The public API (what a user or a script may import from here; docs/config.md,
docs/training-internals.md):

* :class:`TrainConfig` and its parts :class:`ModelConfig`, :class:`ParallelConfig`,
  :class:`OptimConfig`, :class:`BatchConfig`, :class:`DataConfig`, :class:`LaunchConfig`
  (config.py): a run's typed configuration.
* :func:`model_preset`, :func:`parallel_preset`, :func:`optim_preset` (presets.py): the paper's
  named models, layouts and optimizer variants.
* :class:`ConfigProblems` (validate.py), :class:`ResolvedLayout` (layout.py): what
  ``charllm_nemo.train.validate.validate(cfg)`` raises or returns, a config checked before any
  process group exists (the function is not re-exported here: its name is its module's).
* :func:`describe_plan` (plan.py): what a valid config would run (``dry_run=true``).
* :func:`load`, :func:`run`, :func:`main` (app.py): compose conf/ with overrides, and launch.
* :func:`run_rank`, :class:`RankResult` (loop.py): one rank's training loop.
* :class:`StepProfiler` (profile.py): PyTorch profiler traces of chosen steps.
* :class:`SweepManifest`, :func:`load_manifest`, :func:`find_sweeps` (sweep_manifest.py),
  :func:`run_sweep_job` (sweep_job.py): a sweep directory's manifest and one job of a sweep
  (below charllm_nemo.sweep, which plans and drives the sweeps).

Imported lazily: ``import charllm_nemo.train`` imports none of torch, megatron, hydra or wandb;
each name imports its module when first used (config.py, validate.py and presets.py need none).
"""

from __future__ import annotations

from typing import Any

from charllm_nemo._exports import lazy_attribute

_WHERE = {
    "TrainConfig": "config",
    "ModelConfig": "config",
    "ParallelConfig": "config",
    "OptimConfig": "config",
    "BatchConfig": "config",
    "DataConfig": "config",
    "LaunchConfig": "config",
    "model_preset": "presets",
    "parallel_preset": "presets",
    "optim_preset": "presets",
    "ConfigProblems": "validate",
    "ResolvedLayout": "layout",
    "describe_plan": "plan",
    "load": "app",
    "run": "app",
    "main": "app",
    "run_rank": "loop",
    "RankResult": "loop",
    "StepProfiler": "profile",
    "SweepManifest": "sweep_manifest",
    "load_manifest": "sweep_manifest",
    "find_sweeps": "sweep_manifest",
    "run_sweep_job": "sweep_job",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _WHERE, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
