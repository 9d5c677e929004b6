"""Named presets: the paper's models with their real shapes, parallel layouts and optim variants.

The same values live in ``conf/{model,parallel,optim}/<name>.yaml`` for the Hydra application
(tests/train/test_presets.py checks that each yaml equals its preset). Python code that wants a
preset without Hydra (validation, FLOPs tests, notebooks) takes it from here.

Shapes are the published ones: GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers, d_model 12288,
96 heads, d_ff = 4 d_model, 2048 context, learned absolute positions); Llama-3 8B / 70B (Meta's
model cards: GQA with 8 KV heads, SwiGLU, RMSNorm, RoPE, 128256-token vocabulary, untied output);
Mixtral 8x7B / 8x22B (Mistral: 8 experts, top-2 routing, SwiGLU experts, GQA with 8 KV heads).
Sequence lengths are the training lengths the paper (and NeMo's recipes) use; the models' own
context windows are kept in ``max_position_embeddings``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

from charllm_nemo.errors import ConfigError
from charllm_nemo.train.config import ModelConfig, OptimConfig, ParallelConfig

# A config whose shape or layout was set by hand rather than taken from a preset.
CUSTOM = "custom"


def _models() -> dict[str, ModelConfig]:
    # Fields shared by the Llama-3 and Mixtral families; each preset overrides the shape.
    llama = ModelConfig(
        swiglu=True, position_embedding="rope", normalization="RMSNorm", untie_embeddings=True
    )
    mixtral = replace(llama, num_experts=8, moe_router_topk=2, moe_token_dispatcher="alltoall")
    models = [
        ModelConfig(
            name="gpt3_175b",
            num_layers=96,
            hidden_size=12288,
            num_attention_heads=96,
            num_query_groups=None,
            ffn_hidden_size=49152,
            vocab_size=51200,  # GPT-2 BPE (50257) padded to a multiple of 1024, as Megatron-LM does
            seq_length=2048,
            max_position_embeddings=2048,
            swiglu=False,  # GeLU MLP
            position_embedding="learned_absolute",
            normalization="LayerNorm",
            untie_embeddings=False,  # GPT-3 ties input and output embeddings
        ),
        replace(
            llama,
            name="llama3_70b",
            num_layers=80,
            hidden_size=8192,
            num_attention_heads=64,
            num_query_groups=8,
            ffn_hidden_size=28672,
            vocab_size=128256,
            seq_length=8192,
            max_position_embeddings=8192,
        ),
        replace(
            llama,
            name="llama3_8b",
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_query_groups=8,
            ffn_hidden_size=14336,
            vocab_size=128256,
            seq_length=8192,
            max_position_embeddings=8192,
        ),
        replace(
            mixtral,
            name="mixtral_8x7b",
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_query_groups=8,
            ffn_hidden_size=14336,
            moe_ffn_hidden_size=14336,
            vocab_size=32000,
            seq_length=4096,
            max_position_embeddings=32768,  # the model's context window; training uses 4096
        ),
        replace(
            mixtral,
            name="mixtral_8x22b",
            num_layers=56,
            hidden_size=6144,
            num_attention_heads=48,
            num_query_groups=8,
            ffn_hidden_size=16384,
            moe_ffn_hidden_size=16384,
            vocab_size=32768,
            # Mixtral 8x22B's window is 64K tokens; the paper and NeMo's recipe train at 4096.
            seq_length=4096,
            max_position_embeddings=65536,
        ),
        # CPU-sized stand-ins, tens of ms per step on one core. tiny_gpt is a GPT-3 in miniature
        # (GeLU, LayerNorm, learned positions); tiny_moe a Mixtral in miniature (GQA, SwiGLU,
        # RMSNorm, RoPE, top-2 of 4 experts) with the only dispatcher that runs on CPU.
        ModelConfig(
            name="tiny_gpt",
            num_layers=4,
            hidden_size=64,
            num_attention_heads=4,
            num_query_groups=None,
            ffn_hidden_size=256,
            vocab_size=1024,
            seq_length=64,
            max_position_embeddings=64,
            swiglu=False,
            position_embedding="learned_absolute",
            normalization="LayerNorm",
            untie_embeddings=False,
        ),
        ModelConfig(
            name="tiny_moe",
            num_layers=4,
            hidden_size=64,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=256,
            moe_ffn_hidden_size=256,
            vocab_size=1024,
            seq_length=64,
            max_position_embeddings=64,
            swiglu=True,
            position_embedding="rope",
            normalization="RMSNorm",
            untie_embeddings=True,
            num_experts=4,
            moe_router_topk=2,
            moe_token_dispatcher="allgather",
        ),
    ]
    return {m.name: m for m in models}


def _parallels() -> dict[str, ParallelConfig]:
    P = ParallelConfig
    layouts = [
        # Small layouts: each runs on 1-4 CPU ranks with tiny_gpt / tiny_moe.
        P(name="single"),
        P(name="tp2", tp=2),
        P(name="tp2_sp", tp=2, sequence_parallel=True),  # GPU (TransformerEngine) only
        P(name="pp2", pp=2),
        P(name="pp2_vpp2", pp=2, vpp=2),  # interleaved 1F1B: 2 model chunks per stage
        P(name="pp2_uneven", pp=2, pipeline_layout=[3, 1]),  # explicit layers per stage
        P(name="pp2_alternating", pp=2, pipeline_layout_scheme="alternating"),
        P(name="pp4", pp=4),
        P(name="cp2", cp=2),  # GPU (TransformerEngine attention) only
        P(name="ep2", ep=2),
        P(name="dp2", dp=2),
        P(name="tp2pp2", tp=2, pp=2),
        P(name="tp2ep2", tp=2, ep=2, sequence_parallel=True),  # MoE with TP needs SP: GPU only
        P(name="fsdp", fsdp=True),  # Megatron-FSDP over the data-parallel ranks (GPU only)
        P(name="fsdp_torch", fsdp=True, fsdp_impl="torch_fsdp2"),  # PyTorch FSDP2 (GPU only)
        # Paper-scale layouts (the world size sets DP: e.g. GPT-3 175B TP8 PP8 on 1024 GPUs is
        # DP16). NeMo's published recipes are the source of the _vpp variants.
        P(name="gpt3_175b_tp8pp8", tp=8, pp=8),
        P(name="gpt3_175b_tp8pp16", tp=8, pp=16),
        P(name="gpt3_175b_tp4pp8_vpp6", tp=4, pp=8, vpp=6, sequence_parallel=True),
        P(name="gpt3_175b_tp8pp8_alternating", tp=8, pp=8, pipeline_layout_scheme="alternating"),
        P(name="llama3_70b_tp4pp4", tp=4, pp=4),
        P(name="llama3_70b_tp8pp4", tp=8, pp=4),
        P(name="llama3_70b_tp4pp4_vpp5_cp2", tp=4, pp=4, vpp=5, cp=2, sequence_parallel=True),
        # One layer fewer on the first and last stage, which also hold the embedding and the
        # output layer + loss.
        P(name="llama3_70b_tp4pp4_uneven", tp=4, pp=4, pipeline_layout=[19, 21, 21, 19]),
        P(name="llama3_8b_tp1pp1", tp=1, pp=1),
        P(name="llama3_8b_tp2", tp=2),
        P(name="llama3_8b_cp2", cp=2),
        P(name="mixtral_8x7b_pp4ep8_vpp8", pp=4, ep=8, vpp=8),
        P(name="mixtral_8x7b_tp2pp4ep4", tp=2, pp=4, ep=4, sequence_parallel=True),
        P(name="mixtral_8x22b_tp2pp8ep8", tp=2, pp=8, ep=8, sequence_parallel=True),
        P(
            name="mixtral_8x22b_tp2pp8ep8_alternating",
            tp=2,
            pp=8,
            ep=8,
            sequence_parallel=True,
            pipeline_layout_scheme="alternating",
        ),
    ]
    return {p.name: p for p in layouts}


def _optims() -> dict[str, OptimConfig]:
    # The four variants the paper sweeps. "comm overlap" overlaps the data-parallel gradient
    # reduce-scatter and parameter all-gather with compute (distributed optimizer);
    # "recompute" is full activation recomputation, one layer per checkpointed unit.
    # TP communication overlap needs TransformerEngine, TP>1 and sequence parallelism, so it is
    # left off here: add optim.tp_comm_overlap=true on a GPU layout that has them.
    base = OptimConfig(name="base")
    overlap = replace(
        base,
        name="comm_overlap",
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        use_distributed_optimizer=True,
    )
    recompute = replace(
        base,
        name="recompute",
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    )
    both = replace(
        overlap,
        name="recompute_comm_overlap",
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    )
    variants = [base, overlap, recompute, both]
    return {o.name: o for o in variants}


MODEL_PRESETS: Mapping[str, ModelConfig] = MappingProxyType(_models())
PARALLEL_PRESETS: Mapping[str, ParallelConfig] = MappingProxyType(_parallels())
OPTIM_PRESETS: Mapping[str, OptimConfig] = MappingProxyType(_optims())

# The paper's optimization variants, in the order its figures use.
OPTIM_VARIANTS: tuple[str, ...] = ("base", "comm_overlap", "recompute", "recompute_comm_overlap")

# Models too big for anything but a GPU cluster, and the CPU stand-ins.
PAPER_MODELS: tuple[str, ...] = ("gpt3_175b", "llama3_70b", "llama3_8b", "mixtral_8x7b", "mixtral_8x22b")
TINY_MODELS: tuple[str, ...] = ("tiny_gpt", "tiny_moe")


def _get(kind: str, table: Mapping[str, object], name: str) -> object:
    try:
        return copy.deepcopy(table[name])
    except KeyError:
        raise ConfigError(f"{kind}={name!r} is not a known preset; use one of {sorted(table)}") from None


def model_preset(name: str) -> ModelConfig:
    """A fresh copy of the named model preset; ConfigError (listing the names) if unknown."""
    m = _get("model", MODEL_PRESETS, name)
    assert isinstance(m, ModelConfig)
    return m


def parallel_preset(name: str) -> ParallelConfig:
    """A fresh copy of the named parallel layout; ConfigError (listing the names) if unknown."""
    p = _get("parallel", PARALLEL_PRESETS, name)
    assert isinstance(p, ParallelConfig)
    return p


def optim_preset(name: str) -> OptimConfig:
    """A fresh copy of the named optim variant; ConfigError (listing the names) if unknown."""
    o = _get("optim", OPTIM_PRESETS, name)
    assert isinstance(o, OptimConfig)
    return o
