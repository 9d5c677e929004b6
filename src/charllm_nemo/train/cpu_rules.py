"""What a CPU (gloo) run of megatron-core cannot do, for config validation: the rules of
train/cpu.py's CPU support, apart from its patches so that validating (a dry run, the launcher)
imports no torch (~2 s of a dry run's ~3 s on a quiet 2-core VM)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from charllm_nemo.train.config import TrainConfig


def cpu_unsupported(cfg: TrainConfig) -> list[str]:
    """What ``cfg`` asks for that a CPU (gloo) run cannot do: one message per problem, each naming
    the field, the value and a fix. Empty = fine on CPU. Framework-free (no torch.distributed,
    no mcore import). Each rule was seen failing on CPU with megatron-core 0.16.1, except FSDP
    (Megatron-FSDP stops earlier there, on the missing ``einops`` package)."""
    problems: list[str] = []
    p, o, m, b = cfg.parallel, cfg.optim, cfg.model, cfg.batch
    if p.sequence_parallel:
        problems.append(
            "parallel.sequence_parallel=true needs TransformerEngine or Apex (GPU only); set "
            "parallel.sequence_parallel=false on CPU"
        )
    if o.tp_comm_overlap:
        problems.append(
            "optim.tp_comm_overlap=true needs TransformerEngine userbuffers (GPU only); set "
            "optim.tp_comm_overlap=false on CPU (optim=base or optim=recompute)"
        )
    if p.cp > 1:
        problems.append(
            f"parallel.cp={p.cp}: context parallelism needs TransformerEngine attention (GPU only); "
            "set parallel.cp=1 on CPU"
        )
    if p.fsdp:
        problems.append(
            f"parallel.fsdp=true ({p.fsdp_impl}) is GPU only in this trainer (megatron-core's FSDP "
            "buffers and streams are CUDA's); set parallel.fsdp=false on CPU"
        )
    if o.use_distributed_optimizer or o.overlap_param_gather:
        problems.append(
            "optim.use_distributed_optimizer / optim.overlap_param_gather: megatron-core 0.16's "
            "DistributedOptimizer accepts only torch.cuda tensors; set both to false on CPU "
            "(optim=base or optim=recompute)"
        )
    if b.precision in ("bf16", "fp16"):  # (an unknown value is the enumerated check's)
        problems.append(
            f"batch.precision={b.precision}: megatron-core 0.16's mixed-precision optimizer "
            "accepts only torch.cuda tensors (and fp16's loss scaler lives on CUDA); set "
            "batch.precision=fp32 on CPU"
        )
    if m.num_experts is not None and m.moe_token_dispatcher != "allgather":
        problems.append(
            f"model.moe_token_dispatcher={m.moe_token_dispatcher!r}: only 'allgather' works on CPU "
            "(alltoall creates CUDA streams, flex needs DeepEP); set model.moe_token_dispatcher=allgather"
        )
    return problems
