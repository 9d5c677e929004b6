"""Weights, gradients and optimizer state per rank: the memory a parallel layout decides.

Plain integer arithmetic over the model shape and the layout, like ``flops.py``: no framework.
It answers, before a job is queued, how many parameters each pipeline stage's ranks hold and
how many bytes their weights, gradients and Adam state take, the way Megatron-Core allocates
them (``train/model.py`` builds the same setup):

* the layers of pipeline stage ``i`` are those of its model chunks (``v * pp + i`` for each
  virtual chunk ``v``); the input embedding sits on the first stage, the output layer on the
  last (a separate copy of the embedding there when tied and ``pp > 1``, as Megatron-Core keeps
  one; with ``pp == 1`` a tied output layer adds nothing);
* attention, dense MLPs, shared experts and the embeddings are split over ``tp``; routed experts
  over ``ep`` and (expert TP = TP) ``tp``; the router is replicated;
* bytes per parameter: the weight in the training precision (2 for bf16 / fp16, 4 for fp32),
  its gradient in fp32 (4: Megatron-Core's DDP reduces 16-bit gradients in fp32, which
  ``train/model.py`` asks for), Adam's two fp32 moments (8) and, for 16-bit weights, an fp32
  master copy (4). So 18 bytes for bf16 and 16 for fp32, Megatron-LM's figures;
* the distributed optimizer splits the optimizer state (master copy and moments) over the data
  parallel ranks of each parameter (``dp`` for dense ones, ``expert_dp`` for experts): bf16 pays
  6 + 12 / dp bytes, as in Megatron-LM's ``theoretical_memory_usage.py``; FSDP (either flavour,
  fully sharded) splits weights and gradients too, and PyTorch FSDP2 reduces gradients in the
  training precision (``fp32_gradients=False``).

Counted: the GEMM weights and embeddings of ``flops.parameter_count`` (norms and biases, well
under 0.1 % of a large model, are left out). Not counted: activations (they depend on the
schedule, recomputation and sequence parallelism), communication buffers, the CUDA context and
the allocator's fragmentation: the figures are a lower bound of what a rank needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from charllm_nemo.errors import ConfigError
from charllm_nemo.metrics.flops import ModelShape, layer_weights

WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes of one weight in each training precision."""
GRADIENT_BYTES = 4
"""Gradients are kept and reduced in fp32."""
ADAM_BYTES = 8
"""Adam's first and second moments, fp32 each."""
MASTER_BYTES = 4
"""The fp32 master copy the optimizer updates when the weights are 16-bit."""


def _shard(count: int, ways: int) -> int:
    """One rank's share of ``count`` elements split ``ways`` ways (padded up, as Megatron-Core's
    buffers are)."""
    return -(-count // ways)


@dataclass(frozen=True, slots=True)
class StageMemory:
    """What one rank of pipeline stage ``stage`` holds.

    ``dense_parameters`` are replicated over the data-parallel ranks, ``expert_parameters`` over
    the expert-data-parallel ranks (both counts before any FSDP split, so that they add up to the
    model). Bytes are after the distributed optimizer's or FSDP's split.
    """

    stage: int
    layers: int
    dense_parameters: int
    expert_parameters: int
    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int

    @property
    def parameters(self) -> int:
        return self.dense_parameters + self.expert_parameters

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes


def stage_memory(
    shape: ModelShape,
    *,
    tp: int,
    pp: int,
    layers_per_virtual_stage: Sequence[int],
    ep: int = 1,
    dp: int = 1,
    expert_dp: int | None = None,
    precision: str = "bf16",
    distributed_optimizer: bool = False,
    fsdp: bool = False,
    fp32_gradients: bool = True,
) -> list[StageMemory]:
    """One :class:`StageMemory` per pipeline stage (the ranks of a stage hold the same amounts).

    ``layers_per_virtual_stage`` lists the model chunks in layer order, ``pp * vpp`` of them
    (``ResolvedLayout.layers_per_virtual_stage``). ``expert_dp`` None = ``dp``.
    ``fp32_gradients`` False: gradients in the training precision (PyTorch FSDP2's reduction).
    """
    if precision not in WEIGHT_BYTES:
        raise ConfigError(f"batch.precision={precision!r} is not one of {sorted(WEIGHT_BYTES)}")
    chunks = list(layers_per_virtual_stage)
    if not chunks or len(chunks) % pp or sum(chunks) != shape.num_layers:
        raise ConfigError(
            f"layers_per_virtual_stage={chunks} must list pp * vpp chunks (pp={pp}) summing to "
            f"model.num_layers={shape.num_layers}"
        )
    expert_dp = dp if expert_dp is None else expert_dp
    weight = WEIGHT_BYTES[precision]
    gradient = GRADIENT_BYTES if fp32_gradients else weight
    optimizer = ADAM_BYTES + (MASTER_BYTES if weight < 4 else 0)
    embedding = _shard(shape.vocab_size * shape.hidden_size, tp)
    # The output layer on the last stage: its own weights when untied, Megatron-Core's copy of
    # the embedding when tied across stages; nothing extra when tied on a single stage.
    output = embedding if (shape.untie_embeddings or pp > 1) else 0
    starts = [sum(chunks[:c]) for c in range(len(chunks))]
    result = []
    for stage in range(pp):
        dense = expert = layers = 0
        for c in range(stage, len(chunks), pp):
            for index in range(starts[c], starts[c] + chunks[c]):
                w = layer_weights(shape, index)
                dense += _shard(w.sharded, tp) + w.router
                expert += _shard(_shard(w.experts, ep), tp)
            layers += chunks[c]
        if stage == 0:
            dense += embedding
        if stage == pp - 1:
            dense += output
        # The elements one rank stores per kind of state, after FSDP's / the optimizer's split.
        held = (_shard(dense, dp) + _shard(expert, expert_dp)) if fsdp else dense + expert
        opt = (_shard(dense, dp) + _shard(expert, expert_dp)) if (fsdp or distributed_optimizer) else held
        result.append(
            StageMemory(
                stage=stage,
                layers=layers,
                dense_parameters=dense,
                expert_parameters=expert,
                weight_bytes=held * weight,
                gradient_bytes=held * gradient,
                optimizer_bytes=opt * optimizer,
            )
        )
    return result
