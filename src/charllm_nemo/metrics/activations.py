"""Activation memory per rank: what the forward passes in flight keep for their backward.

Plain arithmetic over the model shape, the layout and the schedule, like ``memory.py`` (which
counts weights, gradients and optimizer state): no framework. Together they estimate a rank's
peak before anything is allocated.

**What is counted**: the tensors autograd saves for the backward pass of one microbatch (per
layer, and on the last stage for the output layer and the loss), times the microbatches a pipeline stage
holds at once under Megatron-Core's schedules, plus the gradient of the logits, which exists
on top of them when the last stage starts its backward (:attr:`StageActivations.loss_grad_bytes`).

**How each layer is implemented decides the figure**, so two implementations are modelled:

* ``local``: Megatron-Core's local layer spec (what ``train/model.py`` builds on CPU, or on a GPU
  without TransformerEngine): unfused attention that materialises the ``s x s`` scores (the
  softmax output is kept in fp32, and in 16-bit training also its 16-bit copy), PyTorch norms
  (RMSNorm keeps two fp32 copies of its input), the GLU written out in Python (its SiLU output,
  ``x_linear + offset`` and the FC2 input are separate tensors), query, key and value copied
  where rotary embeddings or the key/value expansion of GQA make new tensors. Each term was read
  off the saved tensors of megatron-core 0.16.1 on torch 2.13 (``autograd.graph.
  saved_tensors_hooks``), and ``tests/metrics/test_activations.py`` checks the sum against the
  same hooks on models built by ``train/model.py``, in one process and over a step of two ranks
  (PP, PP x VPP, TP, EP).
* ``te``: TransformerEngine layers (flash attention: no ``s x s`` term; fused norms and GLU).
  For MHA without rotary embeddings Korthikanti et al.'s accounting ("Reducing Activation
  Recomputation in Large Transformer Models", 2022) without dropout masks (``train/model.py``
  trains without dropout), plus megatron-core's own copies of query and key. Not yet checked
  against a run.

Parallelism: tensor parallelism splits the heads and the FFN (the norms' inputs and the inputs
of the column-parallel GEMMs are replicated unless ``sequence_parallel``, which splits them too);
context parallelism splits the sequence; routed experts get, on average, ``topk`` tokens per
token of the rank (balanced routing). Recomputation: ``full`` keeps a checkpointed layer's input
only (``uniform``: one input per group of ``recompute_num_layers`` layers; ``block``: the first
``recompute_num_layers`` layers of each model chunk); ``selective`` (core attention) keeps
query, key and value instead of the scores.

Not counted: dropout masks (dropout is off), per-token statistics (norms' mean / rstd, the
loss's per-token values: under 1/hidden of a layer), communication buffers, the CUDA context
and the allocator's fragmentation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from charllm_nemo.errors import ConfigError
from charllm_nemo.metrics.flops import ModelShape, recomputed_layer_indices
from charllm_nemo.metrics.memory import WEIGHT_BYTES

FP32 = 4
IMPLEMENTATIONS = ("local", "te")


@dataclass(frozen=True, slots=True)
class ActivationSetup:
    """Everything besides the shape that decides what one microbatch keeps.

    ``normalization``: ``LayerNorm`` or ``RMSNorm``; ``rope``: rotary position embeddings;
    ``implementation``: ``local`` or ``te`` (module doc); ``recompute_granularity``: None,
    ``full`` or ``selective``."""

    micro_batch_size: int
    precision: str = "bf16"
    normalization: str = "LayerNorm"
    rope: bool = False
    implementation: str = "local"
    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None

    def __post_init__(self) -> None:
        if self.precision not in WEIGHT_BYTES:
            raise ConfigError(f"batch.precision={self.precision!r} is not one of {sorted(WEIGHT_BYTES)}")
        if self.implementation not in IMPLEMENTATIONS:
            raise ConfigError(f"implementation={self.implementation!r} is not one of {IMPLEMENTATIONS}")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ConfigError(
                f"optim.recompute_granularity={self.recompute_granularity!r} is not one of "
                "null, 'full', 'selective'"
            )


@dataclass(frozen=True, slots=True)
class StageActivations:
    """One rank of pipeline stage ``stage``: ``in_flight`` microbatches (per model chunk, summed
    over its chunks) held at the schedule's peak, the bytes they keep for the backward, and
    ``loss_grad_bytes`` (the logits' gradient, last stage only) on top at the start of a
    backward."""

    stage: int
    in_flight: int
    saved_bytes: int
    loss_grad_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.saved_bytes + self.loss_grad_bytes


def _norm_bytes(setup: ActivationSetup, tokens_h: int, e: int) -> int:
    """A norm's saved input (the replicated hidden states of ``tokens_h`` elements)."""
    if setup.implementation == "local" and setup.normalization == "RMSNorm":
        return 2 * FP32 * tokens_h  # torch's RMSNorm computes in fp32 and keeps two copies
    return e * tokens_h


def layer_activation_bytes(shape: ModelShape, layer_index: int, setup: ActivationSetup) -> int:
    """Bytes one microbatch keeps for the backward of layer ``layer_index`` on one rank, with
    the layer not recomputed in full (selective recomputation applies)."""
    e = WEIGHT_BYTES[setup.precision]
    t, local = setup.tp, setup.implementation == "local"
    tokens = setup.micro_batch_size * shape.seq_length // setup.cp  # tokens of this rank's sequence
    seq = shape.seq_length // setup.cp
    rep = t if setup.sequence_parallel else 1  # the split of the replicated hidden states
    h, hq, hkv = shape.hidden_size, shape.query_projection_size, shape.kv_projection_size
    heads = shape.num_attention_heads // t
    hidden = tokens * h // rep  # elements of a replicated [s, b, h] tensor on this rank
    qkv_storage = e * tokens * (hq + 2 * hkv) // t  # the QKV GEMM's output
    selective = setup.recompute_granularity == "selective"

    # Attention: the input norm, the QKV GEMM's input, what the core attention keeps, the
    # output projection's input (the context).
    total = _norm_bytes(setup, hidden, e) + e * hidden + e * tokens * hq // t
    # Megatron-Core splits the QKV output into views, but with GQA the query is reshaped into a
    # copy; rotary embeddings copy query and key; the unfused attention repeats key and value
    # per head (new tensors of the query's width) inside the core attention.
    gqa = shape.query_groups < shape.num_attention_heads
    new_q = setup.rope or gqa
    # The core attention's inputs: q and k where copied, v a view of the QKV output.
    core_inputs = e * tokens * ((hq if new_q else 0) + (hkv if setup.rope else 0)) // t + qkv_storage
    if not local:  # flash attention keeps its inputs, its output and the softmax statistics
        total += core_inputs + FP32 * heads * tokens
    elif selective:  # the checkpointed core attention keeps its inputs
        total += core_inputs
    else:
        new = (new_q, setup.rope or gqa, gqa)
        total += e * tokens * hq * sum(new) // t
        if not all(new):
            total += qkv_storage
        scores = heads * seq * seq * setup.micro_batch_size
        total += FP32 * scores + (e * scores if e < FP32 else 0)  # fp32 softmax, its 16-bit copy

    # MLP (dense or MoE): the input norm, then the GEMMs' inputs and the activation's.
    total += _norm_bytes(setup, hidden, e)
    glu_terms = (5 if local else 3) if shape.swiglu else 2  # in units of [tokens, ffn]
    if shape.layer_is_moe(layer_index):
        routed = shape.moe_router_topk * tokens
        f = shape.expert_ffn_hidden_size // t
        total += e * hidden  # the router's input
        total += FP32 * tokens * (shape.num_experts or 0)  # the routing scores
        total += e * routed * h  # the tokens permuted to the experts (FC1's input)
        total += e * routed * f * (glu_terms + (1 if local else 0))  # + the routing-prob product
        if shape.moe_shared_expert_ffn_hidden_size:
            total += e * tokens * (shape.moe_shared_expert_ffn_hidden_size // t) * glu_terms
    else:
        total += e * hidden + e * tokens * (shape.ffn_hidden_size // t) * glu_terms
    return total


def _held_inputs(chunk: Sequence[int], setup: ActivationSetup) -> tuple[int, int]:
    """(layers kept whole, checkpointed inputs) of a model chunk holding layers ``chunk``."""
    if setup.recompute_granularity != "full":
        return len(chunk), 0
    n = setup.recompute_num_layers
    if setup.recompute_method == "uniform":
        group = n or 1
        return 0, -(-len(chunk) // group)
    recomputed = min(n or 0, len(chunk))
    return len(chunk) - recomputed, recomputed


def in_flight_microbatches(stage: int, pp: int, num_microbatches: int, vpp: int | None = None) -> int:
    """Microbatches (per model chunk) whose activations pipeline stage ``stage`` holds at its
    peak under Megatron-Core's schedules: the warm-up forwards plus one (1F1B: ``pp - stage``;
    interleaved: ``2 * (pp - stage - 1) + (vpp - 1) * pp + 1``), at most every microbatch."""
    chunks = vpp or 1
    total = num_microbatches * chunks
    if pp == 1:
        return 1
    warmup = pp - stage - 1 if vpp is None else 2 * (pp - stage - 1) + (chunks - 1) * pp
    return min(warmup + 1, total)


def stage_activations(
    shape: ModelShape,
    setup: ActivationSetup,
    *,
    pp: int,
    layers_per_virtual_stage: Sequence[int],
    num_microbatches: int,
    vocab_size: int | None = None,
) -> list[StageActivations]:
    """One :class:`StageActivations` per pipeline stage. ``layers_per_virtual_stage`` lists the
    model chunks in layer order (``pp * vpp`` of them, chunk ``v`` of stage ``i`` at ``v * pp +
    i``); ``num_microbatches`` per step and data-parallel rank. ``vocab_size``: the logits'
    width (None: ``shape.vocab_size``)."""
    chunks = list(layers_per_virtual_stage)
    if not chunks or len(chunks) % pp or sum(chunks) != shape.num_layers:
        raise ConfigError(
            f"layers_per_virtual_stage={chunks} must list pp * vpp chunks (pp={pp}) summing to "
            f"model.num_layers={shape.num_layers}"
        )
    if setup.recompute_granularity == "full":
        # validates the method and the number of layers, as the FLOPs do
        recomputed_layer_indices(shape, setup.recompute_method, setup.recompute_num_layers)
    vpp = len(chunks) // pp
    e = WEIGHT_BYTES[setup.precision]
    tokens = setup.micro_batch_size * shape.seq_length // setup.cp
    hidden = tokens * shape.hidden_size // (setup.tp if setup.sequence_parallel else 1)
    logits = FP32 * tokens * (vocab_size or shape.vocab_size) // setup.tp
    starts = [sum(chunks[:c]) for c in range(len(chunks))]
    result = []
    for stage in range(pp):
        mine = range(stage, len(chunks), pp)
        per_chunk = []
        for c in mine:
            layers = range(starts[c], starts[c] + chunks[c])
            whole, inputs = _held_inputs(layers, setup)
            kept = layers[len(layers) - whole :] if whole else range(0)
            per_chunk.append(sum(layer_activation_bytes(shape, i, setup) for i in kept) + inputs * e * hidden)
        held = in_flight_microbatches(stage, pp, num_microbatches, vpp if vpp > 1 else None)
        # Interleaved: the microbatches in flight are spread over the stage's chunks.
        saved = held * sum(per_chunk) // len(per_chunk)
        last = stage == pp - 1
        if last:  # the final norm, the output layer's input and the loss's fp32 softmax
            saved += _norm_bytes(setup, hidden, e) + e * hidden + logits
        result.append(StageActivations(stage, held, saved, logits if last else 0))
    return result
