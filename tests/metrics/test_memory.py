"""Weights, gradients and optimizer state per rank (charllm_nemo.metrics.memory)."""

from __future__ import annotations

import pytest

from charllm_nemo.errors import ConfigError
from charllm_nemo.metrics.flops import ModelShape, parameter_count
from charllm_nemo.metrics.memory import stage_memory
from charllm_nemo.train.presets import model_preset

GPT3 = ModelShape.from_model_config(model_preset("gpt3_175b"))
MIXTRAL = ModelShape.from_model_config(model_preset("mixtral_8x7b"))


def megatron_most_loaded_shard(shape: ModelShape, tp: int, pp: int) -> float:
    """Megatron-LM's ``theoretical_memory_usage.compute_weight_and_optimizer_memory``: parameters
    on the most loaded shard, its formula written out for a dense GPT (norms included)."""
    h, layers, ffn = shape.hidden_size, shape.num_layers, shape.ffn_hidden_size
    ratio_q = shape.query_projection_size / h
    gated = 3 / 2 if shape.swiglu else 1
    in_layers = (
        2
        * layers
        * h
        * h
        * (
            (1 + shape.query_groups / shape.num_attention_heads) * ratio_q
            + (ffn / h) * gated
            + 2 / h
            + 1 / (layers * h)
        )
    )
    embedding = h * shape.vocab_size
    shard = (in_layers / pp + embedding) / tp
    if shape.untie_embeddings and pp == 1:
        shard += embedding / tp
    return shard


@pytest.mark.parametrize(("tp", "pp"), [(8, 8), (8, 16), (4, 8), (8, 1)])
def test_the_most_loaded_stage_matches_megatron_lms_formula(tp: int, pp: int) -> None:
    # GPT-3 175B: Megatron-LM counts the norms too (0.003 % here); the rest is the same sum.
    stages = stage_memory(GPT3, tp=tp, pp=pp, layers_per_virtual_stage=[96 // pp] * pp)
    ours = max(s.parameters for s in stages)
    assert ours == stages[0].parameters
    assert ours == pytest.approx(megatron_most_loaded_shard(GPT3, tp, pp), rel=5e-5)


def test_bytes_per_parameter_are_megatron_lms() -> None:
    # 18 bytes (bf16 weight, fp32 gradient, fp32 master + Adam moments); the distributed
    # optimizer: 6 + 12 / dp; fp32: 16, 8 + 8 / dp.
    kw = dict(tp=8, pp=8, layers_per_virtual_stage=[12] * 8)
    s = stage_memory(GPT3, **kw)[0]
    assert s.total_bytes == 18 * s.parameters
    assert (s.weight_bytes, s.gradient_bytes, s.optimizer_bytes) == (
        2 * s.parameters,
        4 * s.parameters,
        12 * s.parameters,
    )
    d = stage_memory(GPT3, **kw, dp=16, distributed_optimizer=True)[0]
    assert d.total_bytes == pytest.approx((6 + 12 / 16) * d.parameters, abs=16)
    f = stage_memory(GPT3, **kw, precision="fp32")[0]
    assert f.total_bytes == 16 * f.parameters
    fd = stage_memory(GPT3, **kw, precision="fp32", dp=4, distributed_optimizer=True)[0]
    assert fd.total_bytes == pytest.approx((8 + 8 / 4) * fd.parameters, abs=8)


def test_fsdp_shards_weights_and_gradients_too() -> None:
    kw = dict(tp=2, pp=1, layers_per_virtual_stage=[32], ep=4, dp=16, expert_dp=8)
    plain = stage_memory(MIXTRAL, **kw)[0]
    fsdp = stage_memory(MIXTRAL, **kw, fsdp=True)[0]
    assert fsdp.parameters == plain.parameters  # counts before the split
    dense, expert = plain.dense_parameters, plain.expert_parameters
    assert fsdp.weight_bytes == 2 * (-(-dense // 16) + expert // 8)
    assert fsdp.gradient_bytes == 4 * (-(-dense // 16) + expert // 8)
    assert fsdp.optimizer_bytes == 12 * (-(-dense // 16) + expert // 8)
    fsdp2 = stage_memory(MIXTRAL, **kw, fsdp=True, fp32_gradients=False)[0]
    assert fsdp2.gradient_bytes == fsdp2.weight_bytes == fsdp.weight_bytes


def test_experts_split_over_ep_and_tp_the_router_is_replicated() -> None:
    one = stage_memory(MIXTRAL, tp=1, pp=1, layers_per_virtual_stage=[32])[0]
    split = stage_memory(MIXTRAL, tp=2, pp=1, layers_per_virtual_stage=[32], ep=4)[0]
    assert split.expert_parameters * 8 == one.expert_parameters
    router = 32 * MIXTRAL.hidden_size * 8
    assert (split.dense_parameters - router) * 2 == one.dense_parameters - router


@pytest.mark.parametrize("untie", [False, True])
@pytest.mark.parametrize(("tp", "pp", "chunks"), [(1, 1, [32]), (4, 4, [8] * 4), (2, 4, [5, 3] * 4)])
def test_one_replica_holds_the_whole_model_once(untie: bool, tp: int, pp: int, chunks: list[int]) -> None:
    # Summed over the ranks of one model replica, the shards are the model; plus, when tied
    # across stages, the last stage's copy of the embedding.
    shape = ModelShape.from_model_config(model_preset("llama3_8b"))
    shape = ModelShape(**{**{f: getattr(shape, f) for f in shape.__slots__}, "untie_embeddings": untie})
    stages = stage_memory(shape, tp=tp, pp=pp, layers_per_virtual_stage=chunks)
    copy = shape.vocab_size * shape.hidden_size if (pp > 1 and not untie) else 0
    assert sum(s.parameters for s in stages) * tp == parameter_count(shape).total + copy
    assert sum(s.layers for s in stages) == 32


def test_virtual_chunks_map_to_their_stages() -> None:
    # Chunk v of stage i is entry v * pp + i: [5, 3, 5, 3] over pp=2 puts 10 layers on stage 0.
    shape = ModelShape.from_model_config(model_preset("tiny_gpt"))
    shape = ModelShape(**{**{f: getattr(shape, f) for f in shape.__slots__}, "num_layers": 16})
    stages = stage_memory(shape, tp=1, pp=2, layers_per_virtual_stage=[5, 3, 5, 3])
    assert [s.layers for s in stages] == [10, 6]


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"batch\.precision='fp8'"):
        stage_memory(GPT3, tp=8, pp=8, layers_per_virtual_stage=[12] * 8, precision="fp8")
    with pytest.raises(ConfigError, match=r"summing to model\.num_layers=96"):
        stage_memory(GPT3, tp=8, pp=8, layers_per_virtual_stage=[12] * 7 + [11])
    with pytest.raises(ConfigError, match="pp=8"):
        stage_memory(GPT3, tp=8, pp=8, layers_per_virtual_stage=[48, 48])
