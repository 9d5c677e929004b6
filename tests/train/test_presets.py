"""The presets: real shapes, conf/ yaml identical to presets.py, paper layouts that validate."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from charllm_nemo.errors import ConfigError
from charllm_nemo.train.config import BatchConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from charllm_nemo.train.presets import (
    MODEL_PRESETS,
    OPTIM_PRESETS,
    OPTIM_VARIANTS,
    PAPER_MODELS,
    PARALLEL_PRESETS,
    model_preset,
    optim_preset,
    parallel_preset,
)
from charllm_nemo.train.validate import validate

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUPS = {
    "model": (MODEL_PRESETS, ModelConfig),
    "parallel": (PARALLEL_PRESETS, ParallelConfig),
    "optim": (OPTIM_PRESETS, OptimConfig),
}


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_preset_has_a_yaml_and_every_yaml_a_preset(group: str) -> None:
    presets, _ = GROUPS[group]
    yamls = {p.stem for p in (CONF / group).glob("*.yaml")}
    assert yamls == set(presets)


@pytest.mark.parametrize(("group", "name"), [(g, n) for g, (presets, _) in GROUPS.items() for n in presets])
def test_yaml_equals_preset(group: str, name: str) -> None:
    # Merged onto a schema whose every field differs from the yaml's would hide nothing: the
    # yaml must spell out every field itself, so compare its keys too.
    presets, schema = GROUPS[group]
    raw = OmegaConf.load(CONF / group / f"{name}.yaml")
    assert set(raw.keys()) == {f.name for f in dataclasses.fields(schema)}
    loaded = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), raw))
    assert loaded == presets[name]


# (name, layers, hidden, heads, kv groups, ffn, seq, vocab, experts, topk)
SHAPES = [
    ("gpt3_175b", 96, 12288, 96, None, 49152, 2048, 51200, None, None),
    ("llama3_70b", 80, 8192, 64, 8, 28672, 8192, 128256, None, None),
    ("llama3_8b", 32, 4096, 32, 8, 14336, 8192, 128256, None, None),
    ("mixtral_8x7b", 32, 4096, 32, 8, 14336, 4096, 32000, 8, 2),
    ("mixtral_8x22b", 56, 6144, 48, 8, 16384, 4096, 32768, 8, 2),
]


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_paper_models_have_their_published_shapes(shape: tuple[object, ...]) -> None:
    name, layers, hidden, heads, groups, ffn, seq, vocab, experts, topk = shape
    m = model_preset(str(name))
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups) == (
        layers,
        hidden,
        heads,
        groups,
    )
    assert (m.ffn_hidden_size, m.seq_length, m.vocab_size, m.num_experts) == (ffn, seq, vocab, experts)
    if experts:
        assert m.moe_router_topk == topk and m.moe_ffn_hidden_size == ffn


def test_model_families() -> None:
    gpt = model_preset("gpt3_175b")
    assert (gpt.swiglu, gpt.position_embedding, gpt.normalization, gpt.untie_embeddings) == (
        False,
        "learned_absolute",
        "LayerNorm",
        False,
    )
    for name in ("llama3_70b", "llama3_8b", "mixtral_8x7b", "mixtral_8x22b", "tiny_moe"):
        m = model_preset(name)
        assert (m.swiglu, m.position_embedding, m.normalization, m.untie_embeddings) == (
            True,
            "rope",
            "RMSNorm",
            True,
        ), name
    tiny_moe = model_preset("tiny_moe")
    assert (tiny_moe.num_experts, tiny_moe.moe_router_topk, tiny_moe.moe_token_dispatcher) == (
        4,
        2,
        "allgather",
    )


def test_optim_variants_are_the_papers_four() -> None:
    assert set(OPTIM_VARIANTS) == set(OPTIM_PRESETS)
    base, overlap, recompute, both = (optim_preset(n) for n in OPTIM_VARIANTS)
    assert base.recompute_granularity is None and not base.overlap_grad_reduce
    assert overlap.overlap_grad_reduce and overlap.overlap_param_gather and overlap.use_distributed_optimizer
    assert recompute.recompute_granularity == "full" and not recompute.overlap_grad_reduce
    assert both.recompute_granularity == "full" and both.overlap_grad_reduce


def test_getters_return_copies_and_name_the_choices_when_unknown() -> None:
    a = model_preset("tiny_gpt")
    a.num_layers = 99
    assert model_preset("tiny_gpt").num_layers == 4
    assert parallel_preset("tp2") is not parallel_preset("tp2")
    with pytest.raises(ConfigError, match=r"model='gpt5' is not a known preset; use one of \[.*'tiny_gpt'"):
        model_preset("gpt5")
    with pytest.raises(ConfigError, match="parallel='tp3'"):
        parallel_preset("tp3")
    with pytest.raises(ConfigError, match="optim='fast'"):
        optim_preset("fast")


# model, parallel layout, world size, global batch -> expected dp, microbatches, layers per stage
PAPER_LAYOUTS = [
    ("gpt3_175b", "gpt3_175b_tp8pp8", 64, 1536, 1, 1536, [12] * 8),
    ("gpt3_175b", "gpt3_175b_tp8pp8", 1024, 1536, 16, 96, [12] * 8),
    ("gpt3_175b", "gpt3_175b_tp8pp16", 1024, 1536, 8, 192, [6] * 16),
    ("gpt3_175b", "gpt3_175b_tp4pp8_vpp6", 1024, 1536, 32, 48, [12] * 8),
    ("gpt3_175b", "gpt3_175b_tp8pp8_alternating", 512, 1536, 8, 192, [13, 11] * 4),
    ("llama3_70b", "llama3_70b_tp4pp4", 64, 512, 4, 128, [20] * 4),
    ("llama3_70b", "llama3_70b_tp8pp4", 256, 512, 8, 64, [20] * 4),
    ("llama3_70b", "llama3_70b_tp4pp4_vpp5_cp2", 128, 512, 4, 128, [20] * 4),
    ("llama3_70b", "llama3_70b_tp4pp4_uneven", 64, 512, 4, 128, [19, 21, 21, 19]),
    ("llama3_8b", "llama3_8b_tp1pp1", 8, 128, 8, 16, [32]),
    ("llama3_8b", "llama3_8b_tp2", 16, 128, 8, 16, [32]),
    ("llama3_8b", "llama3_8b_cp2", 16, 128, 8, 16, [32]),
    ("mixtral_8x7b", "mixtral_8x7b_pp4ep8_vpp8", 64, 256, 16, 16, [8] * 4),
    ("mixtral_8x7b", "mixtral_8x7b_tp2pp4ep4", 64, 256, 8, 32, [8] * 4),
    ("mixtral_8x22b", "mixtral_8x22b_tp2pp8ep8", 128, 256, 8, 32, [7] * 8),
    ("mixtral_8x22b", "mixtral_8x22b_tp2pp8ep8_alternating", 256, 256, 16, 16, [8, 6] * 4),
]


@pytest.mark.parametrize("row", PAPER_LAYOUTS, ids=[f"{r[1]}@{r[2]}" for r in PAPER_LAYOUTS])
def test_paper_layouts_validate_without_building_a_model(row: tuple[object, ...]) -> None:
    model, parallel, world, gbs, dp, micro, stages = row
    cfg = TrainConfig(
        model=model_preset(str(model)),
        parallel=parallel_preset(str(parallel)),
        batch=BatchConfig(global_batch_size=int(str(gbs)), precision="bf16"),
    )
    for variant in OPTIM_VARIANTS:
        cfg.optim = optim_preset(variant)
        layout = validate(cfg, world_size=int(str(world)), device="cuda")
        assert (layout.dp, layout.num_microbatches, layout.layers_per_stage) == (dp, micro, stages)
        assert layout.tp * layout.pp * layout.cp * layout.dp == world


def test_every_paper_model_has_a_layout() -> None:
    assert {r[0] for r in PAPER_LAYOUTS} == set(PAPER_MODELS)
    assert {r[1] for r in PAPER_LAYOUTS} == {
        n for n in PARALLEL_PRESETS if n.split("_")[0] in {"gpt3", "llama3", "mixtral"}
    }


@pytest.mark.parametrize(
    ("model", "parallel"),
    [
        ("tiny_gpt", "single"),
        ("tiny_gpt", "tp2"),
        ("tiny_gpt", "pp2"),
        ("tiny_gpt", "pp2_vpp2"),
        ("tiny_gpt", "pp2_uneven"),
        ("tiny_gpt", "pp2_alternating"),
        ("tiny_gpt", "dp2"),
        ("tiny_moe", "ep2"),
        ("tiny_moe", "pp2"),
    ],
)
def test_cpu_layouts_validate_on_two_cpu_ranks(model: str, parallel: str) -> None:
    cfg = TrainConfig(model=model_preset(model), parallel=parallel_preset(parallel))
    for variant in ("base", "recompute"):
        cfg.optim = optim_preset(variant)
        layout = validate(cfg, world_size=2, device="cpu")
        assert layout.world_size == 2 and sum(layout.layers_per_stage) == 4


def test_every_combination_validate_accepts_megatron_core_accepts_too() -> None:
    # Validation runs before any process group; megatron-core's TransformerConfig checks run
    # on every rank after start-up. What the first lets through, the second must not refuse.
    pytest.importorskip("megatron.core")
    import itertools
    import math

    from charllm_nemo.train.config import for_device
    from charllm_nemo.train.model import transformer_config
    from charllm_nemo.train.validate import ConfigProblems

    accepted = 0
    for m, p, o in itertools.product(MODEL_PRESETS, PARALLEL_PRESETS, OPTIM_PRESETS):
        cfg = TrainConfig(model=model_preset(m), parallel=parallel_preset(p), optim=optim_preset(o))
        par = cfg.parallel
        model_ranks = par.tp * par.pp * par.cp
        world = model_ranks * (par.dp or math.lcm(par.ep, 2 if par.fsdp else 1))
        cfg.batch.global_batch_size = 256 * (world // model_ranks)
        try:
            validate(cfg, world_size=world, device="cuda")
        except ConfigProblems:
            continue
        transformer_config(for_device(cfg, "cuda"), on_cpu=False)  # raises on a disagreement
        accepted += 1
    assert accepted > 400  # most combinations are valid somewhere: the check is not vacuous
