"""Typed configuration of a training run (what the Hydra recipes in conf/ fill in).

Plain dataclasses, so they serve both as Hydra structured configs and as the argument of the
framework-free validation (train/validate.py), which runs before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from charllm_nemo.alerts.config import AlertsConfig
from charllm_nemo.sinks.config import LoggerConfig
from charllm_nemo.telemetry.config import TelemetryConfig

__all__ = [
    "BatchConfig",
    "DataConfig",
    "LaunchConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TelemetryConfig",  # telemetry/config.py's, re-exported: Hydra's structured config keeps its path
    "TrainConfig",
    "for_device",
]


@dataclass
class ModelConfig:
    """Transformer shape. ``num_query_groups`` None = multi-head attention (no GQA)."""

    name: str = "tiny_gpt"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    ffn_hidden_size: int = 256
    vocab_size: int = 1024
    seq_length: int = 64
    max_position_embeddings: int | None = None  # None = seq_length
    swiglu: bool = False
    position_embedding: str = "rope"  # "rope" | "learned_absolute"
    normalization: str = "LayerNorm"  # "LayerNorm" | "RMSNorm"
    untie_embeddings: bool = False
    # MoE; num_experts None = dense
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None  # None = ffn_hidden_size
    moe_token_dispatcher: str = "allgather"


@dataclass
class ParallelConfig:
    """Parallel layout. ``dp`` None = derived: world_size / (tp * pp * cp); EP is carved
    out of DP (Megatron-Core's expert-data-parallel layout), so ep must divide dp * cp... see
    validate.py for the exact rules."""

    name: str = "single"
    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual pipeline chunks per stage
    cp: int = 1
    ep: int = 1
    dp: int | None = None
    sequence_parallel: bool = False
    fsdp: bool = False
    # Which FSDP megatron-core 0.16 should use when fsdp=true: "megatron_fsdp" (Megatron-FSDP,
    # DistributedDataParallelConfig(use_megatron_fsdp=True)) or "torch_fsdp2" (PyTorch FSDP2 via
    # TorchFullyShardedDataParallel: no PP, no EP). See validate.py.
    fsdp_impl: str = "megatron_fsdp"
    # Uneven pipeline layouts: explicit layers per stage, or "alternating" (+1/-1 per stage).
    pipeline_layout: list[int] | None = None
    pipeline_layout_scheme: str | None = None  # None | "alternating"


@dataclass
class OptimConfig:
    """Optimizer, activation recomputation and compute-communication overlap."""

    name: str = "base"  # "base" | "comm_overlap" | "recompute" | "recompute_comm_overlap"
    lr: float = 1.0e-4
    min_lr: float = 1.0e-5
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    clip_grad: float = 1.0
    warmup_steps: int = 0
    recompute_granularity: str | None = None  # None | "full" | "selective"
    recompute_method: str | None = None  # None | "block" | "uniform"
    recompute_num_layers: int | None = None
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False
    # None = auto: on for GPU runs (NeMo's recipes train every variant with it), off on CPU
    # (megatron-core 0.16's needs CUDA tensors) and with torch FSDP2 (which shards the optimizer).
    use_distributed_optimizer: bool | None = None


@dataclass
class BatchConfig:
    micro_batch_size: int = 1
    global_batch_size: int = 4
    train_steps: int = 5
    precision: str = "auto"  # "auto" (bf16 on GPU, fp32 on CPU) | "fp32" | "bf16" | "fp16"


@dataclass
class DataConfig:
    """``path`` None = Megatron-Core's mock GPT dataset; else the prefix of .bin/.idx files."""

    path: str | None = None
    seed: int = 1234


@dataclass
class LaunchConfig:
    launcher: str = "local"  # "local" | "slurm" | "none" (already inside torchrun/srun)
    nproc: int = 1
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    # None = auto: launcher=local, a port the OS gives free; slurm, one derived from the job and
    # step ids (every node agrees; jobs sharing a node differ); MASTER_PORT in the environment wins.
    master_port: int | None = None
    dry_run: bool = False  # validate and print the plan (layout, FLOPs, memory per rank); start nothing
    # The accelerator the dry run's energy estimate assumes: a platform of the fitted table
    # (metrics/energy_calibration.json, e.g. "NVIDIA H200"); None: the synthetic device on CPU.
    platform: str | None = None


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    data: DataConfig = field(default_factory=DataConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    logger: LoggerConfig = field(default_factory=lambda: LoggerConfig(name="console"))
    alerts: AlertsConfig = field(default_factory=AlertsConfig)  # live alerts on rank 0 (docs/alerts.md)
    extra: dict[str, Any] = field(default_factory=dict)


AUTO_PRECISION = {"cuda": "bf16", "cpu": "fp32"}
"""What ``batch.precision=auto`` trains in on each device: bf16 on GPUs (what every published
large-model run uses), fp32 on CPU (megatron-core's mixed-precision optimizer needs CUDA)."""


def for_device(cfg: TrainConfig, device: str) -> TrainConfig:
    """``cfg`` with the settings that depend on the device (``cpu`` | ``cuda``) resolved:
    ``batch.precision=auto`` (:data:`AUTO_PRECISION`) and ``optim.use_distributed_optimizer``
    None (on for a GPU run, unless PyTorch FSDP2 shards the optimizer itself). A copy, or
    ``cfg`` itself when both are explicit."""
    batch, optim, p = cfg.batch, cfg.optim, cfg.parallel
    if batch.precision == "auto":
        batch = replace(batch, precision=AUTO_PRECISION.get(device, "fp32"))
    if optim.use_distributed_optimizer is None:
        torch_fsdp2 = p.fsdp and p.fsdp_impl == "torch_fsdp2"
        optim = replace(optim, use_distributed_optimizer=device == "cuda" and not torch_fsdp2)
    if batch is cfg.batch and optim is cfg.optim:
        return cfg
    return replace(cfg, batch=batch, optim=optim)
