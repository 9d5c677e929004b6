"""FLOPs per step against published formulas and published NVIDIA / Megatron-LM numbers."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from charllm_nemo.errors import ConfigError
from charllm_nemo.metrics.flops import (
    FlopsBreakdown,
    ModelShape,
    hardware_flops_per_step,
    model_flops_per_step,
    model_flops_per_token,
    parameter_count,
    recomputed_layer_indices,
)
from charllm_nemo.metrics.throughput import step_throughput
from charllm_nemo.train.config import ModelConfig

GPT3_175B = ModelShape(
    num_layers=96,
    hidden_size=12288,
    num_attention_heads=96,
    ffn_hidden_size=49152,
    vocab_size=51200,
    seq_length=2048,
)
LLAMA3_70B = ModelShape(
    num_layers=80,
    hidden_size=8192,
    num_attention_heads=64,
    num_query_groups=8,
    ffn_hidden_size=28672,
    vocab_size=128256,
    seq_length=8192,
    swiglu=True,
    untie_embeddings=True,
)
MIXTRAL_8X7B = ModelShape(
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_query_groups=8,
    ffn_hidden_size=14336,
    vocab_size=32000,
    seq_length=4096,
    swiglu=True,
    num_experts=8,
    moe_router_topk=2,
    untie_embeddings=True,
)


def causal(shape: ModelShape) -> ModelShape:
    return replace(shape, causal_attention_flops=True)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# --- Reference formulas, written out independently of the package, the way Megatron-LM does.


def narayanan_2021_flops(B: int, s: int, l: int, h: int, V: int) -> float:  # noqa: E741
    """Narayanan et al. 2021 (arXiv 2104.04473), appendix: FLOPs per iteration of a GPT model
    with full activation recomputation, 96 B s l h^2 (1 + s / 6h + V / 16 l h)."""
    return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


def megatron_flops_2024(args: SimpleNamespace, batch_size: int) -> float:
    """Megatron-LM ``num_floating_point_operations`` as in its 2024 releases (core_r0.x):
    12 B s l h^2 [(1 + g/n + s/h) q/h + (f/h) k (3/2 if SwiGLU) + V / (2 l h)], no router,
    full s x s attention, every layer's MLP routed to k experts of width ffn_hidden_size."""
    q_ratio = args.kv_channels * args.num_attention_heads / args.hidden_size
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    routed = 1 if args.num_experts is None else args.moe_router_topk
    gated = 3 / 2 if args.swiglu else 1
    return float(
        12
        * batch_size
        * args.seq_length
        * args.num_layers
        * args.hidden_size**2
        * (
            (1 + groups / args.num_attention_heads + args.seq_length / args.hidden_size) * q_ratio
            + (args.ffn_hidden_size / args.hidden_size) * routed * gated
            + args.padded_vocab_size / (2 * args.num_layers * args.hidden_size)
        )
    )


def megatron_flops_2025(args: SimpleNamespace, batch_size: int) -> float:
    """Megatron-LM main's ``transformer_flops`` (standard attention, no MTP/MLA/latent MoE):
    3 x 2 x [MLP GEMMs + qkv proj + causal half of QK^T and PV + out proj + logits]."""
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    if args.num_experts is None:
        dense_layers, moe_layers, topk = args.num_layers, 0, 0
    else:
        moe_layers = sum(1 for i in range(args.num_layers) if i % args.moe_layer_freq == 0)
        dense_layers, topk = args.num_layers - moe_layers, args.moe_router_topk
    moe_ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    ffn_gemms = 3 if args.swiglu else 2
    q = args.kv_channels * args.num_attention_heads
    kv = args.kv_channels * groups
    attn = 3 * 2 * (args.hidden_size * (q + kv + kv) + q * args.seq_length / 2 * 2 + q * args.hidden_size)
    mlp = (
        3
        * 2
        * args.hidden_size
        * (args.ffn_hidden_size * ffn_gemms * dense_layers + moe_ffn * topk * ffn_gemms * moe_layers)
    )
    logit = 3 * 2 * args.hidden_size * args.padded_vocab_size
    return float(batch_size * args.seq_length * (mlp + attn * args.num_layers + logit))


def megatron_args(shape: ModelShape) -> SimpleNamespace:
    return SimpleNamespace(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        kv_channels=shape.hidden_size // shape.num_attention_heads,
        group_query_attention=shape.num_query_groups is not None,
        num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_hidden_size,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
        num_experts=shape.num_experts,
        moe_router_topk=shape.moe_router_topk,
        moe_layer_freq=shape.moe_layer_freq,
        swiglu=shape.swiglu,
        seq_length=shape.seq_length,
        padded_vocab_size=shape.vocab_size,
    )


# --- GPT-3 175B


def test_gpt3_full_recompute_is_narayanan_formula() -> None:
    # Narayanan et al. count every layer 4x (forward, recomputed forward, 2x backward) and the
    # logits 3x: exactly the hardware FLOPs of full recomputation of all 96 layers.
    hw = hardware_flops_per_step(GPT3_175B, 1536, "full", "uniform", 1)
    assert hw.recomputed_layers == 96
    assert rel(hw.total, narayanan_2021_flops(1536, 2048, 96, 12288, 51200)) < 1e-12


def test_gpt3_megatron_readme_example_138_tflops_on_1024_a100() -> None:
    """Megatron-LM README, "GPT-3 Example" (examples/gpt3/train_gpt3_175b_distributed.sh,
    TP 8 x PP 16, activation checkpointing): "With full global batch size of 1536 on 1024 A100
    GPUs, each iteration takes around 32 seconds resulting in 138 teraFLOPs per GPU which is
    44% of the theoretical peak FLOPs." 138 TFLOP/s are hardware FLOPs (full recomputation)."""
    hw = hardware_flops_per_step(GPT3_175B, 1536, "full", "uniform", 1)
    rates = step_throughput(32.0, 1536, 2048, hw.model.total, hw.total, 1024, peak_tflops_per_gpu=312.0)
    assert rel(rates.hardware_tflops_per_gpu, 138.0) < 0.01
    assert rates.hfu is not None and abs(rates.hfu - 0.44) < 0.01
    # Without the recompute the same step is 3/4 of the layer FLOPs: ~103 model TFLOP/s per GPU.
    assert rates.model_tflops_per_gpu == pytest.approx(103.3, abs=0.1)


def test_gpt3_nemo_published_flops_per_token() -> None:
    """NeMo Framework performance summary (docs.nvidia.com/nemo-framework/user-guide/...
    performance_summary), GPT3-175B, seq 2048, FP8: 24.12 table 716 tokens/s/GPU at
    771 model TFLOP/s/GPU; 25.02 DGX-B200 1600 at 1722; 25.02 DGX-H100 866 at 932.
    TFLOP/s per token/s is the model FLOPs per token, whatever the GPU."""
    ours = model_flops_per_token(GPT3_175B)
    for tokens_per_s, tflops in ((716, 771), (1600, 1722), (866, 932)):
        assert rel(ours, tflops * 1e12 / tokens_per_s) < 0.01


def test_gpt3_six_n_d_matches_weight_gemms() -> None:
    # The "6 N D" rule of thumb is the GEMMs against weights; attention's s^2 part comes on top.
    model = model_flops_per_step(GPT3_175B, 1536)
    tokens = 1536 * 2048
    assert rel(model.dense_weight_flops, 6 * 175e9 * tokens) < 0.02
    params = parameter_count(GPT3_175B)
    assert params.total == params.active  # dense
    assert rel(params.total, 175e9) < 0.01
    assert model.dense_weight_flops == 6 * params.total * tokens  # tied embeddings: V h once
    assert rel(model.attention_core / model.total, 2048 / (6 * 12288 + 2048)) < 0.01


def test_gpt3_matches_megatron_2024_formula() -> None:
    ours = model_flops_per_step(GPT3_175B, 1536).total
    assert rel(ours, megatron_flops_2024(megatron_args(GPT3_175B), 1536)) < 1e-9


# --- Llama-3 70B


@pytest.mark.parametrize("batch", [1, 128])
def test_llama3_70b_matches_megatron_formulas(batch: int) -> None:
    args = megatron_args(LLAMA3_70B)
    assert rel(model_flops_per_step(LLAMA3_70B, batch).total, megatron_flops_2024(args, batch)) < 1e-9
    assert rel(model_flops_per_step(causal(LLAMA3_70B), batch).total, megatron_flops_2025(args, batch)) < 1e-9


def test_llama3_70b_nemo_published_flops_per_token() -> None:
    """NeMo Framework performance summary, LLAMA3-70B pre-training, 64 GPUs, GBS 128, seq 8192,
    FP8: 24.12 table 1524 tokens/s/GPU at 734 model TFLOP/s/GPU; 25.02 DGX-B200 3062 at 1474;
    25.04 DGX-GB200 4035 at 1943. NeMo counts the full s x s attention (the causal count is
    ~7 % lower and does not fit)."""
    ours = model_flops_per_token(LLAMA3_70B)
    halved = model_flops_per_token(causal(LLAMA3_70B))
    for tokens_per_s, tflops in ((1524, 734), (3062, 1474), (4035, 1943)):
        published = tflops * 1e12 / tokens_per_s
        assert rel(ours, published) < 0.01
        assert rel(halved, published) > 0.05


def test_llama3_70b_parameter_count() -> None:
    params = parameter_count(LLAMA3_70B)
    assert rel(params.total, 70.55e9) < 0.005  # Meta's model card: 70B (70.55B in the checkpoint)


# --- Mixtral 8x7B


def test_mixtral_parameter_counts() -> None:
    # Mistral AI: 46.7B parameters in total, 12.9B used per token.
    params = parameter_count(MIXTRAL_8X7B)
    assert rel(params.total, 46.7e9) < 0.005
    assert rel(params.active, 12.9e9) < 0.005


def test_mixtral_six_active_params_per_token() -> None:
    model = model_flops_per_step(MIXTRAL_8X7B, 256)
    tokens = 256 * 4096
    params = parameter_count(MIXTRAL_8X7B)
    assert rel(model.dense_weight_flops, 6 * 12.9e9 * tokens) < 0.02
    # Exactly: every active GEMM weight does 2 FLOPs per token, 3 times. The input embedding
    # is a lookup (no FLOPs); the logits GEMM has vocab x hidden weights.
    assert model.dense_weight_flops == 6 * (params.layers_active + params.output) * tokens


def test_mixtral_matches_megatron_formulas_plus_router() -> None:
    model = model_flops_per_step(MIXTRAL_8X7B, 256)
    args = megatron_args(MIXTRAL_8X7B)
    assert model.moe_router == 3 * 2 * 4096 * 8 * 32 * 256 * 4096
    assert rel(model.total - model.moe_router, megatron_flops_2024(args, 256)) < 1e-9
    halved = model_flops_per_step(causal(MIXTRAL_8X7B), 256)
    assert rel(halved.total - halved.moe_router, megatron_flops_2025(args, 256)) < 1e-9


def test_mixtral_nemo_published_flops_per_token() -> None:
    """NeMo Framework performance summary, Mixtral-8x7B, 64 GPUs, GBS 256, seq 4096, EP 8, FP8:
    25.02 DGX-B200 15457 tokens/s/GPU at 1282 model TFLOP/s/GPU; 25.04 DGX-GB200 19275 at 1598."""
    ours = model_flops_per_token(MIXTRAL_8X7B)
    for tokens_per_s, tflops in ((15457, 1282), (19275, 1598)):
        assert rel(ours, tflops * 1e12 / tokens_per_s) < 0.01


# --- The terms, by hand


def test_terms_of_a_tiny_model_by_hand() -> None:
    # 1 layer, h=4, 2 heads (head dim 2), MHA, plain GeLU MLP f=8, V=10, s=3, one sequence.
    shape = ModelShape(
        num_layers=1, hidden_size=4, num_attention_heads=2, ffn_hidden_size=8, vocab_size=10, seq_length=3
    )
    b = model_flops_per_step(shape, 1)
    t = 3  # tokens
    assert b.attention_qkv == 3 * 2 * t * 4 * (4 + 4 + 4)
    assert b.attention_core == 3 * 2 * t * (4 * 3 + 4 * 3)  # QK^T and PV, full 3 x 3
    assert b.attention_out == 3 * 2 * t * 4 * 4
    assert b.mlp == 3 * 2 * t * (4 * 8 + 8 * 4)
    assert b.logits == 3 * 2 * t * 4 * 10
    assert b.moe == 0
    assert b.total == sum(b.terms().values())
    assert b.per_token == b.total / 3
    assert model_flops_per_token(shape) * 3 == b.total


def test_gqa_shrinks_only_kv_projections() -> None:
    mha = model_flops_per_step(ModelShape(2, 64, 8, 256, 100, 16), 2)
    gqa = model_flops_per_step(ModelShape(2, 64, 8, 256, 100, 16, num_query_groups=2), 2)
    explicit_mha = model_flops_per_step(ModelShape(2, 64, 8, 256, 100, 16, num_query_groups=8), 2)
    assert explicit_mha == mha
    tokens = 2 * 16
    # Q stays 64 wide, K and V go from 64 to 16 wide each.
    assert mha.attention_qkv - gqa.attention_qkv == 3 * 2 * tokens * 64 * (2 * 64 - 2 * 16) * 2
    assert (mha.attention_core, mha.attention_out, mha.mlp) == (
        gqa.attention_core,
        gqa.attention_out,
        gqa.mlp,
    )


def test_swiglu_has_three_mlp_matrices() -> None:
    gelu = model_flops_per_step(ModelShape(2, 64, 8, 256, 100, 16), 1)
    swiglu = model_flops_per_step(ModelShape(2, 64, 8, 256, 100, 16, swiglu=True), 1)
    assert swiglu.mlp * 2 == gelu.mlp * 3


def test_causal_counting_halves_only_the_attention_core() -> None:
    full = model_flops_per_step(LLAMA3_70B, 4)
    half = model_flops_per_step(causal(LLAMA3_70B), 4)
    assert half.attention_core * 2 == full.attention_core
    assert full.total - half.total == half.attention_core


def test_moe_routed_experts_times_topk_plus_router() -> None:
    dense = ModelShape(4, 64, 8, 256, 100, 16, swiglu=True)
    moe = ModelShape(
        4,
        64,
        8,
        256,
        100,
        16,
        swiglu=True,
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=128,
        moe_shared_expert_ffn_hidden_size=64,
    )
    d, m = model_flops_per_step(dense, 1), model_flops_per_step(moe, 1)
    assert m.mlp == 0
    assert m.moe_experts == d.mlp * 2 * 128 // 256
    assert m.moe_shared_experts == d.mlp * 64 // 256
    assert m.moe_router == 3 * 2 * 16 * 64 * 8 * 4
    assert m.attention == d.attention


def test_moe_layer_freq_mixes_dense_and_moe_layers() -> None:
    shape = ModelShape(4, 64, 8, 256, 100, 16, num_experts=4, moe_router_topk=1, moe_layer_freq=2)
    assert [shape.layer_is_moe(i) for i in range(4)] == [True, False, True, False]
    b = model_flops_per_step(shape, 1)
    per_layer_mlp = 3 * 2 * 16 * 2 * 64 * 256
    assert b.mlp == 2 * per_layer_mlp
    assert b.moe_experts == 2 * per_layer_mlp


# --- Recomputation


def test_full_recompute_of_all_layers_adds_one_forward_of_the_layers() -> None:
    for shape in (GPT3_175B, LLAMA3_70B, MIXTRAL_8X7B):
        hw = hardware_flops_per_step(shape, 8, "full", "uniform", 1)
        layers = hw.model.total - hw.model.logits
        assert hw.recompute.logits == 0
        assert 3 * hw.recompute.total == layers  # layers: 3x -> 4x
        assert hw.total - hw.model.logits == layers * 4 // 3
        assert hw.recompute_overhead == pytest.approx(1 + layers / 3 / hw.model.total)


def test_selective_recompute_adds_only_the_attention_core() -> None:
    hw = hardware_flops_per_step(LLAMA3_70B, 8, "selective")
    assert 3 * hw.recompute.attention_core == hw.model.attention_core
    assert hw.recompute.total == hw.recompute.attention_core
    assert hw.recomputed_layers == 0


def test_selective_recompute_modules() -> None:
    hw = hardware_flops_per_step(MIXTRAL_8X7B, 2, "selective", recompute_modules=("moe", "layernorm"))
    assert hw.recompute.attention_core == 0
    assert 3 * hw.recompute.moe == hw.model.moe
    with pytest.raises(ConfigError, match="recompute_modules"):
        hardware_flops_per_step(MIXTRAL_8X7B, 2, "selective", recompute_modules=("attention",))


def test_no_recompute_is_model_flops() -> None:
    hw = hardware_flops_per_step(LLAMA3_70B, 8)
    assert hw.total == model_flops_per_step(LLAMA3_70B, 8).total
    assert hw.recompute == FlopsBreakdown(tokens=8 * 8192)
    assert hw.recompute_overhead == 1.0


def test_block_recompute_counts_layers_per_pipeline_chunk() -> None:
    # 96 layers, PP 4: 24 layers per stage; the first 2 of each stage are recomputed.
    assert recomputed_layer_indices(GPT3_175B, "block", 2, pipeline_parallel=4) == [
        0,
        1,
        24,
        25,
        48,
        49,
        72,
        73,
    ]
    hw = hardware_flops_per_step(GPT3_175B, 8, "full", "block", 2, pipeline_parallel=4)
    one_layer = hardware_flops_per_step(GPT3_175B, 8, "full", "block", 1).recompute.total
    assert hw.recomputed_layers == 8 and hw.recompute.total == 8 * one_layer
    # Interleaved: PP 4 x VPP 2 = 8 chunks of 12 layers.
    assert len(recomputed_layer_indices(GPT3_175B, "block", 3, pipeline_parallel=4, virtual_pipeline=2)) == 24
    # Explicit uneven layout; more layers asked than a chunk has = the whole chunk.
    assert recomputed_layer_indices(
        ModelShape(5, 64, 8, 256, 100, 16), "block", 2, pipeline_layout=[1, 4]
    ) == [0, 1, 2]


def test_recompute_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="recompute_num_layers"):
        hardware_flops_per_step(GPT3_175B, 8, "full", "block")
    with pytest.raises(ConfigError, match="recompute_method"):
        hardware_flops_per_step(GPT3_175B, 8, "full")
    with pytest.raises(ConfigError, match="recompute_granularity"):
        hardware_flops_per_step(GPT3_175B, 8, "partial")
    with pytest.raises(ConfigError, match=r"pp x vpp"):
        hardware_flops_per_step(GPT3_175B, 8, "full", "block", 1, pipeline_parallel=5)
    with pytest.raises(ConfigError, match="pipeline_layout"):
        hardware_flops_per_step(GPT3_175B, 8, "full", "block", 1, pipeline_layout=[40, 40])


# --- Shape


def test_from_model_config() -> None:
    cfg = ModelConfig(
        num_layers=3,
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=512,
        vocab_size=1000,
        seq_length=32,
        swiglu=True,
        num_experts=4,
        moe_router_topk=1,
        moe_ffn_hidden_size=256,
        untie_embeddings=True,
    )
    shape = ModelShape.from_model_config(cfg)
    assert (shape.num_layers, shape.hidden_size, shape.num_attention_heads, shape.query_groups) == (
        3,
        128,
        4,
        2,
    )
    assert (shape.ffn_hidden_size, shape.vocab_size, shape.seq_length, shape.swiglu) == (512, 1000, 32, True)
    assert (shape.num_experts, shape.moe_router_topk, shape.expert_ffn_hidden_size) == (4, 1, 256)
    assert shape.untie_embeddings and not shape.causal_attention_flops
    assert ModelShape.from_model_config(cfg, causal_attention_flops=True).causal_attention_flops
    dense = ModelShape.from_model_config(ModelConfig())
    assert not dense.is_moe and dense.query_groups == dense.num_attention_heads
    assert model_flops_per_step(dense, 4).moe == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_layers": 0}, "model.num_layers"),
        ({"hidden_size": 66}, "model.hidden_size"),
        ({"num_query_groups": 3}, "model.num_query_groups"),
        ({"num_experts": 2, "moe_router_topk": 3}, "model.moe_router_topk"),
        ({"seq_length": 1.5}, "model.seq_length"),
    ],
)
def test_shape_validation_names_the_field(kwargs: dict[str, object], field: str) -> None:
    base: dict[str, object] = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 8,
        "ffn_hidden_size": 256,
        "vocab_size": 100,
        "seq_length": 16,
    }
    with pytest.raises(ConfigError, match=field):
        ModelShape(**{**base, **kwargs})  # type: ignore[arg-type]


def test_global_batch_size_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="global_batch_size"):
        model_flops_per_step(GPT3_175B, 0)
