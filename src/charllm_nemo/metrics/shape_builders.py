"""The fields of a :class:`~charllm_nemo.metrics.flops.ModelShape` from a framework's model
config, read by attribute name (duck-typed: nothing here imports a framework). Each function
returns ModelShape's keyword arguments; ``ModelShape.from_transformer_config``,
``from_nemo_config`` and ``from_megatron_args`` build the shape from them, so this module sits
below flops.py (it imports nothing of it: no import cycle, tests/test_layers.py).

* megatron-core's ``TransformerConfig`` (:func:`mcore_fields`), which holds neither the
  vocabulary nor the sequence length;
* NeMo 2's ``GPTConfig`` family (``llm.Llama3Config8B``, ``llm.MixtralConfig8x7B``, ...:
  TransformerConfig's names plus ``seq_length``, ``vocab_size``, ``make_vocab_size_divisible_by``;
  checked against nemo-toolkit 2.7.3's ``nemo/collections/llm/gpt/model/{base,llama,mixtral}.py``);
* Megatron-LM's parsed arguments (``--num-layers`` is ``args.num_layers``, ...).

Gated linear units (``gated_linear_unit`` / ``--swiglu``: SwiGLU, GeGLU) count three MLP GEMMs
whatever the activation.
"""

from __future__ import annotations

from typing import Any

from charllm_nemo.errors import ConfigError


def ffn_hidden_size(cfg: Any) -> int:
    """A config's MLP width; megatron-core and Megatron-LM default it to 4 x hidden when unset."""
    ffn = getattr(cfg, "ffn_hidden_size", None)
    return int(ffn) if ffn is not None else 4 * int(cfg.hidden_size)


def moe_layer_freq(value: Any, name: str) -> int:
    """megatron-core's ``moe_layer_freq`` as ModelShape's int: an int N (every N-th layer, from
    layer 0) as it is; a per-layer list of 1 (MoE) / 0 (dense) when it is that pattern."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)) and value and all(v in (0, 1) for v in value):
        for k in range(1, len(value) + 1):
            if all(v == (1 if i % k == 0 else 0) for i, v in enumerate(value)):
                return k
    raise ConfigError(
        f"{name}={value!r}: only every N-th layer being MoE (an int, or a 1/0 list of that pattern) is "
        "counted; build the ModelShape yourself for other layouts"
    )


def mcore_fields(
    cfg: Any, vocab_size: int, seq_length: int, untie: bool, causal_attention_flops: bool
) -> dict[str, Any]:
    """A shape's fields from megatron-core's TransformerConfig attribute names: ``num_layers``,
    ``hidden_size``, ``num_attention_heads``, ``num_query_groups``, ``kv_channels``,
    ``ffn_hidden_size``, ``gated_linear_unit``, ``num_moe_experts``, ``moe_router_topk``,
    ``moe_ffn_hidden_size``, ``moe_shared_expert_intermediate_size``, ``moe_layer_freq``."""
    experts = getattr(cfg, "num_moe_experts", None)
    return dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=getattr(cfg, "num_query_groups", None),
        kv_channels=getattr(cfg, "kv_channels", None),
        ffn_hidden_size=ffn_hidden_size(cfg),
        vocab_size=int(vocab_size),
        seq_length=int(seq_length),
        swiglu=bool(getattr(cfg, "gated_linear_unit", False)),
        num_experts=experts,
        moe_router_topk=int(getattr(cfg, "moe_router_topk", 2) or 2),
        moe_ffn_hidden_size=getattr(cfg, "moe_ffn_hidden_size", None) if experts else None,
        moe_shared_expert_ffn_hidden_size=(
            getattr(cfg, "moe_shared_expert_intermediate_size", None) if experts else None
        ),
        moe_layer_freq=moe_layer_freq(getattr(cfg, "moe_layer_freq", 1), "moe_layer_freq"),
        causal_attention_flops=causal_attention_flops,
        untie_embeddings=untie,
    )


def nemo_fields(
    cfg: Any,
    vocab_size: int | None,
    tokenizer: Any,
    seq_length: int | None,
    causal_attention_flops: bool,
) -> dict[str, Any]:
    """A NeMo 2 ``GPTConfig``'s shape fields. The vocabulary as NeMo 2.7.3's
    ``GPTConfig.configure_model`` picks it: ``vocab_size`` given here, else ``cfg.vocab_size``,
    else the ``tokenizer``'s padded to a multiple of ``make_vocab_size_divisible_by x
    tensor_model_parallel_size`` (``nemo.lightning.base.get_vocab_size``). ``seq_length``
    None: ``cfg.seq_length``."""
    vocab = vocab_size if vocab_size is not None else getattr(cfg, "vocab_size", None)
    if vocab is None and tokenizer is not None:
        multiple = int(getattr(cfg, "make_vocab_size_divisible_by", 128)) * int(
            getattr(cfg, "tensor_model_parallel_size", 1) or 1
        )
        vocab = -(-int(tokenizer.vocab_size) // multiple) * multiple
    if vocab is None:
        raise ConfigError(
            "the NeMo config has no vocab_size and no tokenizer was given; pass vocab_size= (the padded "
            "vocabulary) or tokenizer= to ModelShape.from_nemo_config"
        )
    untie = not getattr(cfg, "share_embeddings_and_output_weights", True)
    seq = seq_length if seq_length is not None else cfg.seq_length
    return mcore_fields(cfg, int(vocab), int(seq), untie, causal_attention_flops)


def megatron_args_fields(args: Any, vocab_size: int | None, causal_attention_flops: bool) -> dict[str, Any]:
    """Megatron-LM's ``args``' shape fields. The vocabulary: ``vocab_size`` given here, else
    ``args.padded_vocab_size`` (set once Megatron-LM built its tokenizer), else
    ``args.vocab_size``. ``--group-query-attention`` makes ``--num-query-groups`` count;
    ``--swiglu`` is three MLP GEMMs; ``--num-experts`` with ``--moe-router-topk``,
    ``--moe-ffn-hidden-size``, ``--moe-shared-expert-intermediate-size`` and ``--moe-layer-freq``
    describe the MoE layers; ``--untie-embeddings-and-output-weights`` only changes the
    parameter count."""
    vocab = vocab_size
    for name in ("padded_vocab_size", "vocab_size"):
        if vocab is None:
            vocab = getattr(args, name, None)
    if vocab is None:
        raise ConfigError(
            "Megatron-LM's args have no padded_vocab_size yet (the tokenizer is built later) and no "
            "vocab_size; pass vocab_size= to ModelShape.from_megatron_args"
        )
    experts = getattr(args, "num_experts", None)
    gqa = bool(getattr(args, "group_query_attention", False))
    return dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=getattr(args, "num_query_groups", None) if gqa else None,
        kv_channels=getattr(args, "kv_channels", None),
        ffn_hidden_size=ffn_hidden_size(args),
        vocab_size=int(vocab),
        seq_length=args.seq_length,
        swiglu=bool(getattr(args, "swiglu", False)),
        num_experts=experts,
        moe_router_topk=int(getattr(args, "moe_router_topk", 2) or 2),
        moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None) if experts else None,
        moe_shared_expert_ffn_hidden_size=(
            getattr(args, "moe_shared_expert_intermediate_size", None) if experts else None
        ),
        moe_layer_freq=moe_layer_freq(getattr(args, "moe_layer_freq", 1), "--moe-layer-freq"),
        causal_attention_flops=causal_attention_flops,
        untie_embeddings=bool(getattr(args, "untie_embeddings_and_output_weights", False)),
    )
