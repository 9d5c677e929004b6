"""ModelShape from a megatron-core TransformerConfig, a NeMo 2 GPTConfig, Megatron-LM's args;
and the attention convention against NeMo 2.7.3's own formula."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from charllm_nemo.errors import ConfigError
from charllm_nemo.metrics.flops import ModelShape, model_flops_per_step

LLAMA3_8B = ModelShape(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                       ffn_hidden_size=14336, vocab_size=128256, seq_length=8192, swiglu=True,
                       untie_embeddings=True)  # fmt: skip


def _nemo_llama3_flops(gbs: int, causal_self_attn: bool = True) -> float:
    """nemo-toolkit 2.7.3's ``nemo/utils/flops_formulas.py::llama3`` for Llama-3 8B (its
    ``LLM_VOCAB_SIZE_MAP['llama3']`` = 128256), written out: it sets ``causal_self_attn = True``."""
    sl, layers, hs, ffn, heads, groups, vocab = 8192, 32, 4096, 14336, 32, 8, 128256
    return (
        gbs * sl * layers * hs * hs
        * (12 + (12 * groups / heads) + (18 * ffn / hs) + (12 * sl / hs) * (0.5 if causal_self_attn else 1)
           + (6 * vocab / (layers * hs)))
    )  # fmt: skip


def test_causal_attention_counts_what_nemo_counts_for_llama3_8b_and_full_is_12_percent_more() -> None:
    causal = ModelShape(**{**_fields(LLAMA3_8B), "causal_attention_flops": True})
    assert model_flops_per_step(causal, 128).total == _nemo_llama3_flops(128)
    assert model_flops_per_step(LLAMA3_8B, 128).total == _nemo_llama3_flops(128, causal_self_attn=False)
    ratio = model_flops_per_step(LLAMA3_8B, 1).total / model_flops_per_step(causal, 1).total
    assert ratio == pytest.approx(1.1252, abs=1e-4)  # "up to ~12 %" (issue #25)


def _fields(shape: ModelShape) -> dict[str, object]:
    from dataclasses import fields

    return {f.name: getattr(shape, f.name) for f in fields(shape)}


def test_a_real_megatron_core_transformer_config_gives_the_shape() -> None:
    tc = pytest.importorskip("megatron.core.transformer")
    import torch.nn.functional as F

    cfg = tc.TransformerConfig(
        num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
        gated_linear_unit=True, activation_func=F.silu, use_cpu_initialization=True,
    )  # fmt: skip
    shape = ModelShape.from_transformer_config(cfg, vocab_size=128256, seq_length=8192)
    assert shape.kv_channels == 128 and shape.swiglu and shape.num_experts is None
    assert model_flops_per_step(shape, 4).total == model_flops_per_step(LLAMA3_8B, 4).total
    moe = tc.TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, num_moe_experts=8,
        moe_router_topk=2, moe_ffn_hidden_size=128, moe_layer_freq=[1, 0, 1, 0], use_cpu_initialization=True,
        add_bias_linear=False,
    )  # fmt: skip
    s = ModelShape.from_transformer_config(moe, vocab_size=1024, seq_length=64)
    assert (s.num_experts, s.moe_router_topk, s.expert_ffn_hidden_size, s.moe_layer_freq) == (8, 2, 128, 2)
    assert s.num_moe_layers == 2 and not s.swiglu and s.num_query_groups == 4


def test_nemo_configs_are_read_by_name_with_the_vocabulary_nemo_pads() -> None:
    # NeMo 2.7.3's Llama3Config8B / MixtralConfig8x7B fields (nemo/collections/llm/gpt/model/).
    llama = SimpleNamespace(
        num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8,
        kv_channels=None, seq_length=8192, gated_linear_unit=True, num_moe_experts=None, moe_router_topk=2,
        vocab_size=None, make_vocab_size_divisible_by=128, tensor_model_parallel_size=2,
        share_embeddings_and_output_weights=False, moe_layer_freq=1,
    )  # fmt: skip
    shape = ModelShape.from_nemo_config(
        llama, tokenizer=SimpleNamespace(vocab_size=128000), causal_attention_flops=True
    )
    assert shape.vocab_size == 128000 and shape.untie_embeddings  # 128000 is a multiple of 256
    padded = ModelShape.from_nemo_config(llama, tokenizer=SimpleNamespace(vocab_size=128001))
    assert padded.vocab_size == 128256  # next multiple of 128 x TP=2
    assert ModelShape.from_nemo_config(llama, vocab_size=128256).vocab_size == 128256
    with pytest.raises(ConfigError, match="pass vocab_size="):
        ModelShape.from_nemo_config(llama)
    mixtral = SimpleNamespace(**{**vars(llama), "num_moe_experts": 8, "seq_length": 4096, "vocab_size": 32000,
                                 "moe_ffn_hidden_size": None})  # fmt: skip
    m = ModelShape.from_nemo_config(mixtral)
    assert (m.num_experts, m.moe_router_topk, m.expert_ffn_hidden_size, m.seq_length) == (8, 2, 14336, 4096)


def test_megatron_lm_args_give_the_shape() -> None:
    p = argparse.ArgumentParser()
    for flag in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                 "--num-query-groups", "--seq-length", "--num-experts", "--moe-router-topk",
                 "--moe-ffn-hidden-size"):  # fmt: skip
        p.add_argument(flag, type=int)
    for flag in ("--swiglu", "--group-query-attention", "--untie-embeddings-and-output-weights"):
        p.add_argument(flag, action="store_true")
    args = p.parse_args(
        [
            "--num-layers",
            "32",
            "--hidden-size",
            "4096",
            "--ffn-hidden-size",
            "14336",
            "--num-attention-heads",
            "32",
            "--group-query-attention",
            "--num-query-groups",
            "8",
            "--seq-length",
            "8192",
            "--swiglu",
            "--untie-embeddings-and-output-weights",
        ]
    )
    with pytest.raises(ConfigError, match="padded_vocab_size"):
        ModelShape.from_megatron_args(args)
    args.padded_vocab_size = 128256  # Megatron-LM sets it once the tokenizer is built
    assert ModelShape.from_megatron_args(args) == LLAMA3_8B
    args.group_query_attention = False  # --num-query-groups counts only with GQA on
    assert ModelShape.from_megatron_args(args).num_query_groups is None
    args.moe_layer_freq = [1, 1, 0]
    with pytest.raises(ConfigError, match="--moe-layer-freq"):
        ModelShape.from_megatron_args(args)


def test_metrics_imports_nothing_from_train() -> None:
    import ast
    from pathlib import Path

    import charllm_nemo.metrics as metrics

    for path in Path(metrics.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("charllm_nemo.train"), (path.name, node.module)
