"""Floating-point operations of one training step of a GPT / MoE transformer.

Plain integer arithmetic over the model shape: no framework, no tensors. Every quantity here
is a *count* of floating-point operations (FLOPs), not a rate (FLOP/s); rates live in
``throughput.py``.

Counting conventions (docs/flops.md walks through each term):

* A GEMM of an ``m x k`` by a ``k x n`` matrix is ``2 m k n`` FLOPs (one multiply, one add).
* Training does every GEMM three times: the forward pass, and in the backward pass one GEMM
  for the input gradient and one for the weight gradient. Model FLOPs are 3x the forward.
* Only matrix multiplications are counted. Norms, softmax, activations, residual adds, rotary
  embeddings, dropout and the optimizer are elementwise and left out, as Megatron-LM does.
* Attention scores and context (the two ``s x s`` GEMMs) are counted over the full ``s x s``
  matrix by default, as in Narayanan et al. 2021, Megatron-LM's ``num_floating_point_operations``
  before mid-2025, and NVIDIA's published NeMo performance tables. ``causal_attention_flops=True``
  counts only the unmasked half, as Megatron-LM's main branch does since mid-2025.
* Model FLOPs are what the model needs; hardware FLOPs add what activation recomputation
  runs again (``hardware_flops_per_step``). MFU uses the first, HFU the second.

The per-token terms are exact integers, so a step's FLOPs are ``tokens x per-token FLOPs``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from charllm_nemo.errors import ConfigError
from charllm_nemo.metrics.shape_builders import mcore_fields, megatron_args_fields, nemo_fields

# Forward, input-gradient and weight-gradient GEMMs.
FORWARD_BACKWARD_FACTOR = 3
# A multiply-accumulate is two FLOPs.
FLOPS_PER_MAC = 2

# Megatron-Core's selective-recompute modules (TransformerConfig.recompute_modules) and the
# FLOPs terms each one recomputes. Elementwise modules recompute no GEMM FLOPs.
_SELECTIVE_MODULE_TERMS: dict[str, tuple[str, ...]] = {
    "core_attn": ("attention_core",),
    "mlp": ("mlp",),
    "moe": ("moe_router", "moe_experts", "moe_shared_experts"),
    "shared_experts": ("moe_shared_experts",),
    "moe_act": (),
    "layernorm": (),
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The shape terms that decide a GPT / MoE transformer's FLOPs.

    ``num_query_groups`` None = multi-head attention; ``num_experts`` None = dense MLP in every
    layer. With experts, layer ``i`` is an MoE layer when ``i % moe_layer_freq == 0`` (1 = every
    layer, Megatron-LM's ``--moe-layer-freq`` as an int). ``kv_channels`` None = hidden / heads.
    ``vocab_size`` is taken as given: pass Megatron's padded vocabulary for an exact match.
    ``untie_embeddings`` only affects ``parameter_count``; the FLOPs are the same either way.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    num_query_groups: int | None = None
    kv_channels: int | None = None
    swiglu: bool = False
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_ffn_hidden_size: int | None = None
    moe_layer_freq: int = 1
    causal_attention_flops: bool = False
    untie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "ffn_hidden_size",
            "vocab_size",
            "seq_length",
            "moe_layer_freq",
        ):
            _require_positive_int(f"model.{name}", getattr(self, name))
        for name in (
            "num_query_groups",
            "kv_channels",
            "num_experts",
            "moe_ffn_hidden_size",
            "moe_shared_expert_ffn_hidden_size",
        ):
            value = getattr(self, name)
            if value is not None:
                _require_positive_int(f"model.{name}", value)
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}; pick a head count that "
                f"divides it or set kv_channels explicitly"
            )
        groups = self.query_groups
        if groups > self.num_attention_heads or self.num_attention_heads % groups:
            raise ConfigError(
                f"model.num_query_groups={groups} must divide "
                f"model.num_attention_heads={self.num_attention_heads}; use None for MHA"
            )
        if self.num_experts is not None:
            _require_positive_int("model.moe_router_topk", self.moe_router_topk)
            if self.moe_router_topk > self.num_experts:
                raise ConfigError(
                    f"model.moe_router_topk={self.moe_router_topk} exceeds "
                    f"model.num_experts={self.num_experts}; use topk <= num_experts"
                )

    @classmethod
    def from_model_config(cls, cfg: Any, *, causal_attention_flops: bool = False) -> ModelShape:
        """The shape of ``charllm train``'s ``model`` config (train/config.py ``ModelConfig``, read
        by attribute name: every layer MoE when it has experts)."""
        return cls(
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            num_query_groups=cfg.num_query_groups,
            ffn_hidden_size=cfg.ffn_hidden_size,
            vocab_size=cfg.vocab_size,
            seq_length=cfg.seq_length,
            swiglu=cfg.swiglu,
            num_experts=cfg.num_experts,
            moe_router_topk=cfg.moe_router_topk,
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
            causal_attention_flops=causal_attention_flops,
            untie_embeddings=cfg.untie_embeddings,
        )

    @classmethod
    def from_transformer_config(
        cls, cfg: Any, *, vocab_size: int, seq_length: int, causal_attention_flops: bool = False
    ) -> ModelShape:
        """The shape of a megatron-core ``TransformerConfig``: metrics/shape_builders.py."""
        untie = not getattr(cfg, "share_embeddings_and_output_weights", True)
        return cls(**mcore_fields(cfg, vocab_size, seq_length, untie, causal_attention_flops))

    @classmethod
    def from_nemo_config(
        cls,
        cfg: Any,
        *,
        vocab_size: int | None = None,
        tokenizer: Any = None,
        seq_length: int | None = None,
        causal_attention_flops: bool = False,
    ) -> ModelShape:
        """The shape of a NeMo 2 ``GPTConfig`` (Llama, Mixtral, ...): metrics/shape_builders.py."""
        return cls(**nemo_fields(cfg, vocab_size, tokenizer, seq_length, causal_attention_flops))

    @classmethod
    def from_megatron_args(
        cls, args: Any, *, vocab_size: int | None = None, causal_attention_flops: bool = False
    ) -> ModelShape:
        """The shape of Megatron-LM's parsed arguments: metrics/shape_builders.py."""
        return cls(**megatron_args_fields(args, vocab_size, causal_attention_flops))

    @property
    def query_groups(self) -> int:
        """Key/value head groups (= attention heads for MHA)."""
        return self.num_attention_heads if self.num_query_groups is None else self.num_query_groups

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads if self.kv_channels is None else self.kv_channels

    @property
    def query_projection_size(self) -> int:
        """Width of Q (and of the attention context): heads x head_dim."""
        return self.head_dim * self.num_attention_heads

    @property
    def kv_projection_size(self) -> int:
        """Width of K (= width of V): query groups x head_dim."""
        return self.head_dim * self.query_groups

    @property
    def mlp_matrices(self) -> int:
        """GEMMs per MLP: 3 with SwiGLU (gate, up, down), 2 otherwise (up, down)."""
        return 3 if self.swiglu else 2

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def layer_is_moe(self, layer_index: int) -> bool:
        """Whether 0-based layer ``layer_index`` has routed experts instead of a dense MLP."""
        return self.is_moe and layer_index % self.moe_layer_freq == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(1 for i in range(self.num_layers) if self.layer_is_moe(i))

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.ffn_hidden_size if self.moe_ffn_hidden_size is None else self.moe_ffn_hidden_size


@dataclass(frozen=True, slots=True)
class FlopsBreakdown:
    """FLOPs of one step split by term, each summed over all layers and all ``tokens``.

    For ``model_flops_per_step`` every term is forward + backward (3x the forward GEMMs); the
    ``recompute`` part of ``HardwareFlops`` holds forward-only FLOPs. Units: FLOPs (counts).
    """

    tokens: int
    attention_qkv: int = 0
    attention_core: int = 0
    attention_out: int = 0
    mlp: int = 0
    moe_router: int = 0
    moe_experts: int = 0
    moe_shared_experts: int = 0
    logits: int = 0

    @property
    def total(self) -> int:
        """All terms, FLOPs."""
        return sum(getattr(self, name) for name in _TERM_NAMES)

    @property
    def attention(self) -> int:
        """QKV projections + scores/context + output projection, FLOPs."""
        return self.attention_qkv + self.attention_core + self.attention_out

    @property
    def moe(self) -> int:
        """Router + routed experts + shared experts, FLOPs."""
        return self.moe_router + self.moe_experts + self.moe_shared_experts

    @property
    def dense_weight_flops(self) -> int:
        """Everything except the ``s x s`` attention core: the GEMMs against weights, FLOPs.

        Equals ``2 x factor x active GEMM weights x tokens`` (factor 3 for training): "6 N D".
        """
        return self.total - self.attention_core

    @property
    def per_token(self) -> float:
        """FLOPs per token."""
        return self.total / self.tokens

    def terms(self) -> dict[str, int]:
        """Term name -> FLOPs, in a fixed order (for logging and reports)."""
        return {name: getattr(self, name) for name in _TERM_NAMES}


_TERM_NAMES: tuple[str, ...] = tuple(f.name for f in fields(FlopsBreakdown) if f.name != "tokens")


@dataclass(frozen=True, slots=True)
class HardwareFlops:
    """Model FLOPs plus the forward FLOPs that activation recomputation runs again.

    ``recompute`` holds forward-only FLOPs (one extra forward of what is recomputed);
    ``recomputed_layers`` counts layers recomputed in full (0 for selective or none).
    Units: FLOPs (counts) per step.
    """

    model: FlopsBreakdown
    recompute: FlopsBreakdown
    recomputed_layers: int = 0

    @property
    def total(self) -> int:
        """Hardware FLOPs per step: model + recompute."""
        return self.model.total + self.recompute.total

    @property
    def recompute_overhead(self) -> float:
        """hardware / model FLOPs (1.0 = no recomputation)."""
        return self.total / self.model.total


@dataclass(frozen=True, slots=True)
class ParameterCount:
    """GEMM weights plus token embeddings (norms, biases and position embeddings excluded).

    ``*_active`` counts the weights one token passes through: top-k routed experts, not all.
    ``output`` is the untied output layer (0 when it shares the input ``embedding``).
    """

    layers_total: int
    layers_active: int
    embedding: int
    output: int

    @property
    def total(self) -> int:
        """All parameters."""
        return self.layers_total + self.embedding + self.output

    @property
    def active(self) -> int:
        """Parameters used per token."""
        return self.layers_active + self.embedding + self.output


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")


def _layer_forward_macs_per_token(shape: ModelShape, moe_layer: bool) -> dict[str, int]:
    """Multiply-accumulates per token of one layer's forward pass, by term."""
    h = shape.hidden_size
    q = shape.query_projection_size
    kv = shape.kv_projection_size
    s = shape.seq_length
    # Q K^T and (softmax) V each cost q * s MACs per token over the full s x s matrix;
    # a causal mask leaves half of it: q * s in all.
    core = q * s if shape.causal_attention_flops else 2 * q * s
    macs = {
        "attention_qkv": h * (q + 2 * kv),
        "attention_core": core,
        "attention_out": q * h,
    }
    m = shape.mlp_matrices
    if moe_layer:
        assert shape.num_experts is not None
        macs["moe_router"] = h * shape.num_experts
        macs["moe_experts"] = shape.moe_router_topk * m * h * shape.expert_ffn_hidden_size
        shared = shape.moe_shared_expert_ffn_hidden_size or 0
        macs["moe_shared_experts"] = m * h * shared
    else:
        macs["mlp"] = m * h * shape.ffn_hidden_size
    return macs


def _forward_flops(
    shape: ModelShape,
    tokens: int,
    layers: Iterable[int],
    terms: Sequence[str] | None = None,
    logits: bool = True,
) -> FlopsBreakdown:
    """Forward FLOPs of the given layers (0-based indices) over ``tokens`` tokens."""
    sums = dict.fromkeys(_TERM_NAMES, 0)
    per_kind: dict[bool, dict[str, int]] = {}
    for index in layers:
        kind = shape.layer_is_moe(index)
        if kind not in per_kind:
            per_kind[kind] = _layer_forward_macs_per_token(shape, kind)
        for name, macs in per_kind[kind].items():
            sums[name] += macs
    if logits:
        sums["logits"] = shape.hidden_size * shape.vocab_size
    if terms is not None:
        sums = {name: (value if name in terms else 0) for name, value in sums.items()}
    return FlopsBreakdown(tokens=tokens, **{k: FLOPS_PER_MAC * v * tokens for k, v in sums.items()})


def _scaled(b: FlopsBreakdown, factor: int) -> FlopsBreakdown:
    return FlopsBreakdown(tokens=b.tokens, **{k: v * factor for k, v in b.terms().items()})


def _tokens(shape: ModelShape, global_batch_size: int) -> int:
    _require_positive_int("global_batch_size", global_batch_size)
    return global_batch_size * shape.seq_length


def model_flops_per_step(shape: ModelShape, global_batch_size: int) -> FlopsBreakdown:
    """Model FLOPs of one training step (forward + backward) over ``global_batch_size`` sequences.

    Each term is 3x its forward GEMMs. With ``causal_attention_flops=False`` (the default) the
    total equals Megatron-LM's ``num_floating_point_operations`` as released up to mid-2025;
    with True it equals the current one (dense or MoE, no MTP/MLA; the router is extra).
    Units: FLOPs per step.
    """
    tokens = _tokens(shape, global_batch_size)
    forward = _forward_flops(shape, tokens, range(shape.num_layers))
    return _scaled(forward, FORWARD_BACKWARD_FACTOR)


def model_flops_per_token(shape: ModelShape) -> int:
    """Model FLOPs (forward + backward) per trained token. Units: FLOPs per token."""
    return model_flops_per_step(shape, 1).total // shape.seq_length


def _chunk_layers(
    shape: ModelShape,
    pipeline_parallel: int,
    virtual_pipeline: int | None,
    pipeline_layout: Sequence[int] | None,
) -> list[range]:
    """Consecutive layer ranges of the model chunks, in model order."""
    _require_positive_int("parallel.pp", pipeline_parallel)
    if virtual_pipeline is not None:
        _require_positive_int("parallel.vpp", virtual_pipeline)
    chunks = pipeline_parallel * (virtual_pipeline or 1)
    if pipeline_layout is not None:
        sizes = list(pipeline_layout)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes):
            raise ConfigError(f"pipeline_layout={sizes} must hold non-negative layer counts")
        if sum(sizes) != shape.num_layers:
            raise ConfigError(
                f"pipeline_layout={sizes} sums to {sum(sizes)} layers, "
                f"model.num_layers={shape.num_layers}; make the counts add up"
            )
    else:
        if shape.num_layers % chunks:
            raise ConfigError(
                f"model.num_layers={shape.num_layers} is not divisible by pp x vpp={chunks}; "
                f"pass pipeline_layout with the layers of each (virtual) stage"
            )
        sizes = [shape.num_layers // chunks] * chunks
    ranges, start = [], 0
    for n in sizes:
        ranges.append(range(start, start + n))
        start += n
    return ranges


def recomputed_layer_indices(
    shape: ModelShape,
    recompute_method: str | None,
    recompute_num_layers: int | None,
    *,
    pipeline_parallel: int = 1,
    virtual_pipeline: int | None = None,
    pipeline_layout: Sequence[int] | None = None,
) -> list[int]:
    """Layers whose whole forward is rerun under full recomputation (Megatron-Core semantics).

    ``uniform``: every layer (groups of ``recompute_num_layers`` are checkpointed, all rerun).
    ``block``: the first ``recompute_num_layers`` layers of each pipeline (virtual) chunk.
    """
    if recompute_method == "uniform":
        if recompute_num_layers is not None:
            _require_positive_int("optim.recompute_num_layers", recompute_num_layers)
        return list(range(shape.num_layers))
    if recompute_method == "block":
        if recompute_num_layers is None:
            raise ConfigError(
                "optim.recompute_method='block' needs optim.recompute_num_layers "
                "(layers recomputed per pipeline stage); set it, e.g. 1"
            )
        if (
            isinstance(recompute_num_layers, bool)
            or not isinstance(recompute_num_layers, int)
            or recompute_num_layers < 0
        ):
            raise ConfigError(
                f"optim.recompute_num_layers={recompute_num_layers!r} must be a non-negative integer"
            )
        chunks = _chunk_layers(shape, pipeline_parallel, virtual_pipeline, pipeline_layout)
        return [i for chunk in chunks for i in chunk[:recompute_num_layers]]
    raise ConfigError(
        f"optim.recompute_method={recompute_method!r} is not one of 'uniform', 'block'; "
        f"full recomputation needs one of them"
    )


def hardware_flops_per_step(
    shape: ModelShape,
    global_batch_size: int,
    recompute_granularity: str | None = None,
    recompute_method: str | None = None,
    recompute_num_layers: int | None = None,
    *,
    recompute_modules: Sequence[str] = ("core_attn",),
    pipeline_parallel: int = 1,
    virtual_pipeline: int | None = None,
    pipeline_layout: Sequence[int] | None = None,
) -> HardwareFlops:
    """Model FLOPs plus the FLOPs activation recomputation adds, reported separately.

    * ``None``: no recomputation, hardware = model.
    * ``"full"``: one extra forward of each recomputed layer (all of its GEMMs, attention core
      included; never the logits, which sit outside the transformer block). With every layer
      recomputed the layers cost 4/3 of their model FLOPs.
    * ``"selective"``: one extra forward of ``recompute_modules`` in every layer; the default
      ``("core_attn",)`` reruns only the ``s x s`` scores/context GEMMs.

    ``pipeline_parallel``, ``virtual_pipeline`` and ``pipeline_layout`` (layers per model chunk,
    in model order) only matter for ``recompute_method="block"``. FlashAttention's own rerun of
    QK^T inside its backward kernel is not counted (no framework counts it).
    Units: FLOPs per step.
    """
    model = model_flops_per_step(shape, global_batch_size)
    tokens = model.tokens
    if recompute_granularity is None:
        return HardwareFlops(model=model, recompute=FlopsBreakdown(tokens=tokens))
    if recompute_granularity == "full":
        layers = recomputed_layer_indices(
            shape,
            recompute_method,
            recompute_num_layers,
            pipeline_parallel=pipeline_parallel,
            virtual_pipeline=virtual_pipeline,
            pipeline_layout=pipeline_layout,
        )
        recompute = _forward_flops(shape, tokens, layers, logits=False)
        return HardwareFlops(model=model, recompute=recompute, recomputed_layers=len(layers))
    if recompute_granularity == "selective":
        terms: set[str] = set()
        for module in recompute_modules:
            if module not in _SELECTIVE_MODULE_TERMS:
                raise ConfigError(
                    f"recompute_modules entry {module!r} is unknown; "
                    f"use any of {sorted(_SELECTIVE_MODULE_TERMS)}"
                )
            terms.update(_SELECTIVE_MODULE_TERMS[module])
        recompute = _forward_flops(shape, tokens, range(shape.num_layers), terms=sorted(terms), logits=False)
        return HardwareFlops(model=model, recompute=recompute)
    raise ConfigError(
        f"optim.recompute_granularity={recompute_granularity!r} is not one of None, 'full', 'selective'"
    )


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One transformer layer's GEMM weights by how the parallel layout splits them.

    ``sharded``: attention (QKV and output projections), the dense MLP and shared experts, split
    over tensor parallelism. ``router``: the MoE router, replicated on every rank. ``experts``:
    all routed experts together, split over expert parallelism and (expert TP = TP) tensor
    parallelism; ``expert`` is one of them.
    """

    sharded: int
    router: int = 0
    experts: int = 0
    expert: int = 0

    @property
    def total(self) -> int:
        return self.sharded + self.router + self.experts


def layer_weights(shape: ModelShape, layer_index: int) -> LayerWeights:
    """The GEMM weights of 0-based layer ``layer_index`` (norms and biases excluded)."""
    moe_layer = shape.layer_is_moe(layer_index)
    macs = _layer_forward_macs_per_token(shape, moe_layer)
    sharded = macs["attention_qkv"] + macs["attention_out"] + macs.get("mlp", 0)
    if not moe_layer:
        return LayerWeights(sharded=sharded)
    assert shape.num_experts is not None
    expert = shape.mlp_matrices * shape.hidden_size * shape.expert_ffn_hidden_size
    return LayerWeights(
        sharded=sharded + macs["moe_shared_experts"],
        router=macs["moe_router"],
        experts=shape.num_experts * expert,
        expert=expert,
    )


def parameter_count(shape: ModelShape) -> ParameterCount:
    """Weights of the GEMMs counted in the FLOPs, plus the input (and untied output) embedding.

    Built from the same per-layer terms as the FLOPs, so that
    ``model.dense_weight_flops == 6 x (layers_active + vocab x hidden) x tokens`` holds exactly
    (the logits GEMM uses vocab x hidden weights, shared with the embedding when tied).
    """
    total = active = 0
    for index in range(shape.num_layers):
        w = layer_weights(shape, index)
        total += w.total
        active += w.sharded + w.router + shape.moe_router_topk * w.expert
    embedding = shape.vocab_size * shape.hidden_size
    output = embedding if shape.untie_embeddings else 0
    return ParameterCount(layers_total=total, layers_active=active, embedding=embedding, output=output)
