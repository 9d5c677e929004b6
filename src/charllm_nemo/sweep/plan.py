"""Before a sweep submits anything: each configuration validated for the sweep's world size and
its memory planned (train/plan.py, the dry run's figures). A configuration whose estimated peak
(weights, gradients, optimizer state and activations of its fullest pipeline stage) exceeds the
GPU's memory stays in the matrix as ``out_of_memory_predicted`` and is not submitted; one that
does not validate is ``failed`` with the validation's message, also without a job."""

from __future__ import annotations

from dataclasses import dataclass

from charllm_nemo.errors import ConfigError
from charllm_nemo.sweep.manifest import FAILED, OUT_OF_MEMORY_PREDICTED
from charllm_nemo.train.config import TrainConfig, for_device
from charllm_nemo.train.launch import resolve_device
from charllm_nemo.train.plan import plan_stage_activations, plan_stage_memory
from charllm_nemo.train.validate import validate

GIB = 2**30


@dataclass(frozen=True)
class Verdict:
    """What planning says of one configuration: ``state`` None (submit it), ``failed`` or
    ``out_of_memory_predicted``; the estimated peak of its fullest stage in GiB (None when it did
    not validate) and why."""

    state: str | None
    peak_gib: float | None
    reason: str | None


def plan_configuration(
    cfg: TrainConfig, world: int, gpu_memory_gib: float | None, implementation: str = "te"
) -> Verdict:
    """Validate ``cfg`` for ``world`` ranks and compare its planned peak per rank with
    ``gpu_memory_gib`` (None: no limit, e.g. CPU mirrors). ``implementation``: the layers the
    GPU nodes build (``te``: TransformerEngine, flash attention; ``local``: unfused attention
    keeps the s x s scores), which decides the activation estimate."""
    cfg.launch.device = resolve_device(cfg.launch.device)
    cfg = for_device(cfg, cfg.launch.device)
    try:
        layout = validate(cfg, world_size=world, device=cfg.launch.device)
    except ConfigError as exc:
        return Verdict(FAILED, None, f"does not validate for {world} ranks: {exc}"[:500])
    stages = plan_stage_memory(cfg, layout)
    acts = plan_stage_activations(cfg, layout, implementation)
    peaks = [s.total_bytes + a.total_bytes for s, a in zip(stages, acts, strict=True)]
    top = max(range(len(peaks)), key=peaks.__getitem__)
    peak_gib = peaks[top] / GIB
    if gpu_memory_gib is not None and peak_gib > gpu_memory_gib:
        return Verdict(
            OUT_OF_MEMORY_PREDICTED,
            round(peak_gib, 2),
            f"estimated peak {peak_gib:.1f} GiB on pipeline stage {top} (weights, gradients, optimizer "
            f"state {stages[top].total_bytes / GIB:.1f} GiB, activations {acts[top].total_bytes / GIB:.1f} "
            f"GiB; {implementation} layers) > sweep.gpu_memory_gib={gpu_memory_gib:g}",
        )
    return Verdict(None, round(peak_gib, 2), None)
