"""Build the Megatron-Core GPT (dense or MoE) model, its DDP wrapping and its optimizer.

``TrainConfig`` -> ``TransformerConfig`` (shape, parallel sizes, recompute, overlap flags,
pipeline layout) -> one ``GPTModel`` per virtual pipeline chunk -> mcore
``DistributedDataParallel`` -> ``get_megatron_optimizer`` (Adam; torch's AdamW underneath
without TransformerEngine/Apex) and an ``OptimizerParamScheduler`` (linear warmup, cosine decay).

The pipeline layout (layers per virtual stage) is resolved by config validation
(``validate.validate(cfg).mcore_pipeline_layout()``) and passed in; CPU-only settings come from
``cpu.cpu_transformer_overrides()``. megatron-core is imported inside the functions.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from charllm_nemo.errors import ConfigError
from charllm_nemo.train.config import TrainConfig, for_device


def _dtype(precision: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def transformer_config(
    cfg: TrainConfig,
    *,
    on_cpu: bool,
    timers: Any = None,
    pipeline_layout: list[list[str]] | None = None,
) -> Any:
    """The ``TransformerConfig`` for ``cfg``. ``timers`` becomes ``config.timers`` (the loop's
    phase hooks); ``on_cpu`` applies :func:`cpu.cpu_transformer_overrides`; ``pipeline_layout``
    is mcore's ``pipeline_model_parallel_layout`` (list form) for an uneven pipeline, else None."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, p, o, b = cfg.model, cfg.parallel, cfg.optim, cfg.batch
    dtype = _dtype(b.precision)
    moe = m.num_experts is not None
    vpp = p.vpp if p.vpp and p.vpp > 1 else None
    # Interleaved (VPP) schedules can overlap p2p with compute; plain 1F1B refuses it.
    overlap_p2p = bool(vpp and o.overlap_grad_reduce)
    kw: dict[str, Any] = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu,
        normalization=m.normalization,
        # GPT-3 style models have linear biases; Llama/Mixtral (SwiGLU, MoE) have none. MoE without
        # TransformerEngine also needs it off (an in-place op on a view fails in the expert bias path).
        add_bias_linear=not (m.swiglu or moe),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep,
        sequence_parallel=p.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=b.precision == "bf16",
        fp16=b.precision == "fp16",
        recompute_granularity=o.recompute_granularity,
        recompute_method=o.recompute_method,
        recompute_num_layers=o.recompute_num_layers,
        tp_comm_overlap=o.tp_comm_overlap,
        overlap_p2p_comm=overlap_p2p,
        batch_p2p_comm=not overlap_p2p,  # mcore: overlap_p2p_comm excludes batched p2p
        deallocate_pipeline_outputs=True,
        timers=timers,
    )
    if pipeline_layout is not None and p.pp > 1:
        kw["pipeline_model_parallel_layout"] = pipeline_layout
    if moe:
        kw.update(
            num_moe_experts=m.num_experts,
            moe_router_topk=m.moe_router_topk,
            # Top-1 (Switch-style) takes the softmax over all experts before choosing: a softmax
            # over the one chosen logit is 1 with a zero gradient, which megatron-core refuses.
            # Top-k > 1 keeps Mixtral's softmax over the k chosen logits.
            moe_router_pre_softmax=m.moe_router_topk == 1,
            moe_ffn_hidden_size=m.moe_ffn_hidden_size or m.ffn_hidden_size,
            moe_token_dispatcher_type=m.moe_token_dispatcher,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-2,
            moe_grouped_gemm=grouped_gemm_experts(cfg, on_cpu=on_cpu),
        )
    if on_cpu:
        from charllm_nemo.train.cpu import cpu_transformer_overrides

        kw.update(cpu_transformer_overrides())
    return TransformerConfig(**kw)


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken install raising on import
        return False
    return True


def initialize_tp_comm_overlap(cfg: TrainConfig) -> None:
    """TransformerEngine's userbuffers for ``optim.tp_comm_overlap`` (GPU), which frameworks set
    up themselves and megatron-core does not: after the model-parallel groups, before the model,
    as Megatron-LM's ``_initialize_tp_communicators`` does (one buffer shape, the sequence of a
    microbatch over CP by the hidden size; TE's default overlap settings; NCCL bootstrap). A
    TransformerEngine without it is a ConfigError naming the way out."""
    import inspect

    import torch

    way_out = "install TransformerEngine >= 1.9 on the GPU nodes, or set optim.tp_comm_overlap=false"
    try:
        from transformer_engine.pytorch.module import base as te_base
    except Exception as exc:
        raise ConfigError(
            f"optim.tp_comm_overlap=true needs TransformerEngine's userbuffers ({exc}); {way_out}"
        ) from None
    initialize_ub = getattr(te_base, "initialize_ub", None)
    if initialize_ub is None:
        raise ConfigError(
            f"optim.tp_comm_overlap=true: this TransformerEngine has no initialize_ub; {way_out}"
        )
    m, b, p = cfg.model, cfg.batch, cfg.parallel
    kwargs: dict[str, Any] = {
        "shape": [m.seq_length * b.micro_batch_size // p.cp, m.hidden_size],
        "tp_size": p.tp,
        "use_fp8": False,
        "dtype": torch.float16 if b.precision == "fp16" else torch.bfloat16,
        "bootstrap_backend": "nccl",
    }
    accepted = inspect.signature(initialize_ub).parameters
    if "bootstrap_backend" not in accepted:  # TE < 1.9 bootstraps through MPI only
        raise ConfigError(
            "optim.tp_comm_overlap=true: this TransformerEngine bootstraps userbuffers over MPI "
            f"only; {way_out}"
        )
    initialize_ub(**{k: v for k, v in kwargs.items() if k in accepted})


def grouped_gemm_experts(cfg: TrainConfig, *, on_cpu: bool) -> bool:
    """Whether an MoE model's experts run as one grouped GEMM (TransformerEngine's
    ``TEGroupedMLP``, what NeMo's and Megatron-LM's Mixtral recipes use) rather than one GEMM per
    expert (``SequentialMLP``): on a GPU whose TransformerEngine has grouped linear layers."""
    if on_cpu or cfg.model.num_experts is None or not _have_te():
        return False
    try:
        from megatron.core.extensions.transformer_engine import TEColumnParallelGroupedLinear
    except Exception:
        return False
    return TEColumnParallelGroupedLinear is not None


def uses_transformer_engine(on_cpu: bool) -> bool:
    """Whether the model is built from TransformerEngine layers (a GPU with TE installed)."""
    return not on_cpu and _have_te()


def layers_built(on_cpu: bool) -> str:
    """``te`` or ``local``: the layers this rank builds, as the activation estimate names them
    (charllm_nemo.metrics.activations)."""
    return "te" if uses_transformer_engine(on_cpu) else "local"


def layer_spec(cfg: TrainConfig, *, on_cpu: bool) -> Any:
    """TransformerEngine layer spec on a GPU with TE installed, else mcore's local spec. A GPU
    run that needs TE and does not have it is a ConfigError here, on every rank, before the
    model (megatron-core would fail later: its local attention asserts cp == 1, its torch norms
    refuse sequence parallelism)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if uses_transformer_engine(on_cpu):
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=cfg.model.num_experts, moe_grouped_gemm=grouped_gemm_experts(cfg, on_cpu=on_cpu)
        )
    p = cfg.parallel
    apex_norms = importlib.util.find_spec("apex") is not None  # the local spec's norms then allow SP
    needs = [
        field
        for field, on in (
            ("parallel.cp>1", p.cp > 1),
            ("parallel.sequence_parallel", p.sequence_parallel and not apex_norms),
        )
        if on
    ]
    if not on_cpu and needs:
        raise ConfigError(
            f"{' and '.join(needs)} need TransformerEngine on GPU (megatron-core's local attention "
            "supports cp=1 only, its torch norms no sequence parallelism), and it does not import here: "
            "install transformer-engine on the GPU nodes, or set parallel.cp=1 / "
            "parallel.sequence_parallel=false"
        )
    return specs.get_gpt_layer_local_spec(
        num_experts=cfg.model.num_experts, normalization=cfg.model.normalization
    )


@dataclass
class ModelBundle:
    """What the loop needs: model chunks (DDP-wrapped), their config, optimizer and scheduler."""

    chunks: list[Any]
    config: Any
    optimizer: Any
    scheduler: Any
    num_parameters: int = 0
    # The 2-D ones: GEMM weights and embeddings (what charllm_nemo.metrics.memory counts, plus
    # learned position embeddings), without norms and biases.
    num_matrix_parameters: int = 0


def build_gpt_chunks(cfg: TrainConfig, config: Any, *, on_cpu: bool) -> list[Any]:
    """One ``GPTModel`` per virtual pipeline chunk held by this rank (unwrapped)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    m = cfg.model
    spec = layer_spec(cfg, on_cpu=on_cpu)
    vpp = config.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for vp_stage in range(vpp):
        vps = vp_stage if vpp > 1 else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=m.vocab_size,
            max_sequence_length=m.max_position_embeddings or m.seq_length,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vps),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vps),
            share_embeddings_and_output_weights=not m.untie_embeddings,
            position_embedding_type=m.position_embedding,
            vp_stage=vps,
        )
        for param in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if not on_cpu:
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    if config.bf16 or config.fp16:
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(config, c) for c in chunks]
    return chunks


def _wrap_data_parallel(cfg: TrainConfig, config: Any, chunks: list[Any]) -> list[Any]:
    """mcore DDP around each chunk (Megatron-LM's ``get_model``), or one of the FSDPs."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    o, p = cfg.optim, cfg.parallel
    megatron_fsdp = p.fsdp and p.fsdp_impl == "megatron_fsdp"
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.batch.precision != "fp32",
        overlap_grad_reduce=o.overlap_grad_reduce,
        overlap_param_gather=o.overlap_param_gather,
        # Megatron-FSDP shards optimizer state too: it needs the distributed optimizer.
        use_distributed_optimizer=o.use_distributed_optimizer or megatron_fsdp,
        use_megatron_fsdp=megatron_fsdp,
        data_parallel_sharding_strategy="optim_grads_params" if megatron_fsdp else "no_shard",
    )
    if p.fsdp and p.fsdp_impl == "torch_fsdp2":
        from megatron.core.distributed.torch_fully_sharded_data_parallel import (
            TorchFullyShardedDataParallel,
        )

        return [TorchFullyShardedDataParallel(config, ddp_config, c) for c in chunks]
    wrapper: Any = DistributedDataParallel
    if megatron_fsdp:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        wrapper = FullyShardedDataParallel
    # Megatron-LM: buckets only on the first chunk, so later chunks' grads reduce at once.
    return [
        wrapper(config=config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]


def build_optimizer(cfg: TrainConfig, chunks: list[Any]) -> tuple[Any, Any]:
    """mcore's optimizer (Adam; torch AdamW without TE/Apex) over the wrapped chunks and an
    ``OptimizerParamScheduler`` with linear warmup then cosine decay to ``optim.min_lr``."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o, b = cfg.optim, cfg.batch
    megatron_fsdp = cfg.parallel.fsdp and cfg.parallel.fsdp_impl == "megatron_fsdp"
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        clip_grad=o.clip_grad,
        bf16=b.precision == "bf16",
        fp16=b.precision == "fp16",
        params_dtype=_dtype(b.precision),
        use_distributed_optimizer=o.use_distributed_optimizer or megatron_fsdp,
        overlap_param_gather=o.overlap_param_gather,
    )
    # No gloo groups (init_distributed creates none): mcore uses them only to save and load the
    # distributed optimizer's state, and this trainer writes no checkpoints.
    optimizer = get_megatron_optimizer(opt_config, chunks, use_gloo_process_groups=False)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if o.warmup_steps else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=max(b.train_steps, o.warmup_steps + 1),
        lr_decay_style="cosine",
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=max(b.train_steps, 1),
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def build_model(
    cfg: TrainConfig,
    *,
    on_cpu: bool,
    timers: Any = None,
    pipeline_layout: list[list[str]] | None = None,
) -> ModelBundle:
    """Model chunks wrapped for data parallelism, optimizer and LR scheduler, wired into the
    config (``no_sync_func``, ``param_sync_func``, ``finalize_model_grads_func``,
    ``grad_scale_func``) as Megatron-LM's ``training.py`` does. Needs ``parallel_state``
    initialized (see ``dist.init_distributed``). The device-dependent settings (``config.for_device``)
    are resolved here too, for callers that build without ``run_rank``."""
    from megatron.core.distributed import finalize_model_grads

    cfg = for_device(cfg, "cpu" if on_cpu else "cuda")
    o = cfg.optim
    config = transformer_config(cfg, on_cpu=on_cpu, timers=timers, pipeline_layout=pipeline_layout)
    chunks = build_gpt_chunks(cfg, config, on_cpu=on_cpu)
    params = [p for c in chunks for p in c.parameters()]
    num_parameters = sum(p.numel() for p in params)
    num_matrix_parameters = sum(p.numel() for p in params if p.dim() >= 2)
    wrapped = _wrap_data_parallel(cfg, config, chunks)
    optimizer, scheduler = build_optimizer(cfg, wrapped)

    config.grad_scale_func = optimizer.scale_loss if cfg.batch.precision == "fp16" else None
    config.finalize_model_grads_func = finalize_model_grads
    if o.overlap_grad_reduce:
        no_sync = [c.no_sync for c in wrapped]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    if o.overlap_param_gather and o.use_distributed_optimizer:
        param_sync = [c.start_param_sync for c in wrapped]
        config.param_sync_func = param_sync[0] if len(param_sync) == 1 else param_sync
    return ModelBundle(wrapped, config, optimizer, scheduler, num_parameters, num_matrix_parameters)
