"""Before a sweep submits anything: each configuration validated for the sweep's world size and
its memory planned (train/plan.py, the dry run's figures). A configuration whose estimated peak
(weights, gradients, optimizer state and activations of its fullest pipeline stage) exceeds the
GPU's memory stays in the matrix as ``out_of_memory_predicted`` and is not submitted; one that
does not validate is ``failed`` with the validation's message, also without a job."""

from __future__ import annotations

from dataclasses import dataclass

from charllm_nemo.errors import ConfigError
from charllm_nemo.metrics.flops import ModelShape, hardware_flops_per_step
from charllm_nemo.metrics.peak import lookup_peak_tflops
from charllm_nemo.train.config import TrainConfig, for_device
from charllm_nemo.train.launch import resolve_device
from charllm_nemo.train.layout import ResolvedLayout
from charllm_nemo.train.plan import plan_stage_activations, plan_stage_memory
from charllm_nemo.train.sweep_manifest import FAILED, OUT_OF_MEMORY_PREDICTED
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
    gpu_hours: float | None = None


@dataclass(frozen=True)
class Throughput:
    """What a GPU-hour estimate assumes: the GPU (a name :func:`lookup_peak_tflops` knows, e.g.
    ``NVIDIA H200 SXM``), the model FLOPs utilization reached (0-1) and the minutes a job
    spends before its first step (scheduling aside: imports, process groups, model build)."""

    device: str
    mfu: float
    startup_min: float


def gpu_hours(cfg: TrainConfig, layout: ResolvedLayout, world: int, assume: Throughput) -> float | None:
    """GPU hours of one configuration: ``train_steps`` steps of its hardware FLOPs (model FLOPs
    plus recomputation, metrics/flops.py) at ``assume.mfu`` of the GPU's datasheet bf16 dense peak
    (metrics/peak.py) on ``world`` GPUs, plus ``assume.startup_min`` on every GPU. None when the
    GPU's peak is not known."""
    peak = lookup_peak_tflops(assume.device, cfg.batch.precision if cfg.batch.precision != "fp32" else "tf32")
    if peak is None or assume.mfu <= 0:
        return None
    o = cfg.optim
    hw = hardware_flops_per_step(
        ModelShape.from_model_config(cfg.model),
        cfg.batch.global_batch_size,
        o.recompute_granularity,
        o.recompute_method,
        o.recompute_num_layers,
        pipeline_parallel=layout.pp,
        virtual_pipeline=layout.vpp,
        pipeline_layout=layout.layers_per_virtual_stage if layout.uneven else None,
    )
    compute_s = cfg.batch.train_steps * hw.total / (peak * 1e12 * assume.mfu)  # summed over GPUs
    return compute_s / 3600 + world * assume.startup_min / 60


def plan_configuration(
    cfg: TrainConfig,
    world: int,
    gpu_memory_gib: float | None,
    implementation: str = "te",
    assume: Throughput | None = None,
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
    hours = gpu_hours(cfg, layout, world, assume) if assume is not None else None
    if gpu_memory_gib is not None and peak_gib > gpu_memory_gib:
        return Verdict(
            OUT_OF_MEMORY_PREDICTED,
            round(peak_gib, 2),
            f"estimated peak {peak_gib:.1f} GiB on pipeline stage {top} (weights, gradients, optimizer "
            f"state {stages[top].total_bytes / GIB:.1f} GiB, activations {acts[top].total_bytes / GIB:.1f} "
            f"GiB; {implementation} layers) > sweep.gpu_memory_gib={gpu_memory_gib:g}",
        )
    return Verdict(None, round(peak_gib, 2), None, hours)
