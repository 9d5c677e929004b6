"""Config validation before any process group: each rule names the field(s) and a way out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from charllm_nemo.errors import ConfigError
from charllm_nemo.train.config import TrainConfig
from charllm_nemo.train.presets import model_preset, optim_preset, parallel_preset
from charllm_nemo.train.validate import (
    ConfigProblems,
    ResolvedLayout,
    alternating_layout,
    divisors,
    validate,
)
from tests.deadline import deadline


def cfg_for(
    model: str = "tiny_gpt", parallel: str = "single", optim: str = "base", **batch: int
) -> TrainConfig:
    cfg = TrainConfig(
        model=model_preset(model), parallel=parallel_preset(parallel), optim=optim_preset(optim)
    )
    for k, v in batch.items():
        setattr(cfg.batch, k, v)
    return cfg


def problems(cfg: TrainConfig, world: int | None = 1, device: str = "cuda") -> list[str]:
    with pytest.raises(ConfigProblems) as info:
        validate(cfg, world_size=world, device=device)
    assert isinstance(info.value, ConfigError)
    return info.value.problems


def one(cfg: TrainConfig, world: int | None = 1, device: str = "cuda") -> str:
    found = problems(cfg, world, device)
    assert len(found) == 1, found
    return found[0]


# -- a valid config resolves --------------------------------------------------------------------


def test_valid_config_resolves_its_layout() -> None:
    cfg = cfg_for("tiny_moe", "tp2ep2", global_batch_size=8, micro_batch_size=2)
    layout = validate(cfg, world_size=8, device="cuda")
    assert layout == ResolvedLayout(
        world_size=8,
        tp=2,
        pp=1,
        vpp=None,
        cp=1,
        ep=2,
        dp=4,
        expert_dp=2,
        num_microbatches=1,
        layers_per_stage=[4],
        layers_per_virtual_stage=[4],
    )
    assert layout.mcore_pipeline_layout() is None


def test_world_size_defaults_to_dp_times_model_size_or_nproc() -> None:
    cfg = cfg_for(parallel="dp2")
    assert validate(cfg, device="cpu").world_size == 2
    cfg = cfg_for(parallel="tp2")
    cfg.launch.nproc = 4
    assert validate(cfg, device="cpu").dp == 2


def test_all_problems_are_reported_at_once() -> None:
    cfg = cfg_for("tiny_gpt", "tp2pp2")
    cfg.parallel.pp = 3
    cfg.parallel.ep = 2
    cfg.model.num_attention_heads = 3
    cfg.telemetry.backend = "tpu"
    found = problems(cfg, world=12)
    assert len(found) >= 4
    text = "\n".join(found)
    for field in ("parallel.pp=3", "parallel.ep=2", "model.num_attention_heads=3", "telemetry.backend='tpu'"):
        assert field in text
    with pytest.raises(ConfigError, match=r"invalid training config \(\d+ problems\):\n  - "):
        validate(cfg, world_size=12, device="cuda")


# -- names -------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", ["model", "parallel", "optim"])
def test_unknown_names_list_the_known_ones(group: str) -> None:
    cfg = cfg_for()
    getattr(cfg, group).name = "mystery"
    msg = one(cfg)
    assert f"{group}.name='mystery' is not a known {group}" in msg
    assert {"model": "tiny_gpt", "parallel": "pp2", "optim": "recompute"}[group] in msg
    assert f"{group}.name=custom" in msg


def test_custom_name_is_accepted() -> None:
    cfg = cfg_for()
    cfg.model.name = cfg.parallel.name = cfg.optim.name = "custom"
    validate(cfg, world_size=1, device="cpu")


# -- world size and DP ---------------------------------------------------------------------------


def test_world_not_divisible_by_tp_pp_cp() -> None:
    msg = one(cfg_for(parallel="tp2pp2"), world=6)
    assert "world_size=6 is not divisible by parallel.tp*pp*cp=4 (tp=2, pp=2, cp=1)" in msg
    assert "launch.nproc in [4, 8, 12, 16]" in msg


def test_explicit_dp_must_match_world() -> None:
    msg = one(cfg_for(parallel="dp2"), world=4)
    assert "parallel.dp=2 does not match world_size=4" in msg and "parallel.dp=null" in msg


# -- expert parallelism ---------------------------------------------------------------------------


def test_ep_needs_an_moe_model() -> None:
    msg = one(cfg_for("tiny_gpt", "ep2"), world=2)
    assert "parallel.ep=2 needs a mixture-of-experts model" in msg and "tiny_moe" in msg


def test_ep_must_divide_the_experts() -> None:
    cfg = cfg_for("tiny_moe", "ep2")
    cfg.parallel.ep = 3
    found = problems(cfg, world=3)
    assert any("parallel.ep=3 does not divide model.num_experts=4; use ep in [1, 2, 4]" in p for p in found)


def test_moe_with_tensor_parallelism_needs_sequence_parallelism() -> None:
    # megatron-core 0.16's MoELayer.forward raises at the first training step otherwise.
    cfg = cfg_for("tiny_moe", "tp2")
    gpu = one(cfg, world=2, device="cuda")
    assert gpu.startswith("model.num_experts=4 with parallel.tp=2 needs parallel.sequence_parallel=true")
    assert "set parallel.sequence_parallel=true, or parallel.tp=1" in gpu
    cpu = one(cfg, world=2, device="cpu")  # CPU has no sequence parallelism: only tp=1 is a way out
    assert "on CPU, which has no sequence parallelism, set parallel.tp=1" in cpu
    cfg.parallel.sequence_parallel = True
    assert validate(cfg, world_size=2, device="cuda").tp == 2
    cfg.model.num_experts = None  # a dense model: tensor parallelism alone is fine
    cfg.parallel.sequence_parallel = False
    assert validate(cfg, world_size=2, device="cpu").tp == 2


def test_ep_is_carved_from_dp_times_cp() -> None:
    # TP=2 on 4 ranks leaves DP=2: EP=4 cannot fit although 4 divides the 4 experts.
    cfg = cfg_for("tiny_moe", "tp2")
    cfg.parallel.ep = 4
    cfg.parallel.sequence_parallel = True  # megatron-core's MoE needs it with TP
    msg = one(cfg, world=4)
    assert "parallel.ep=4 does not divide dp*cp=2" in msg
    assert "use ep in [1, 2]" in msg and "launch.nproc in [8" in msg


def test_ep_counts_context_parallel_ranks() -> None:
    cfg = cfg_for("tiny_moe", "cp2")
    cfg.parallel.ep = 4
    cfg.model.seq_length = 64
    layout = validate(cfg, world_size=4, device="cuda")  # dp=2, cp=2: ep=4 fits in dp*cp
    assert (layout.dp, layout.ep, layout.expert_dp) == (2, 4, 1)


# -- tensor parallelism --------------------------------------------------------------------------


def test_heads_must_divide_by_tp() -> None:
    cfg = cfg_for(parallel="tp2")
    cfg.parallel.tp = 8
    cfg.model.ffn_hidden_size = cfg.model.vocab_size = 1024
    cfg.model.hidden_size = 64
    msg = one(cfg, world=8)
    assert "model.num_attention_heads=4 is not divisible by parallel.tp=8; use tp in [1, 2, 4]" in msg


def test_kv_groups_must_be_a_multiple_or_divisor_of_tp() -> None:
    cfg = cfg_for("llama3_8b", "llama3_8b_tp2")  # 8 KV groups
    cfg.parallel.tp = 16  # a multiple of 8 groups: replicated KV heads, allowed by megatron-core
    validate(cfg, world_size=16, device="cuda")
    cfg.model.num_query_groups = 4
    cfg.model.num_attention_heads = 24
    cfg.model.hidden_size = 3072
    cfg.parallel.tp = 6
    found = problems(cfg, world=6)
    assert any(
        "model.num_query_groups=4 is neither a multiple nor a divisor of parallel.tp=6" in p for p in found
    )


@pytest.mark.parametrize("field", ["ffn_hidden_size", "vocab_size"])
def test_split_dimensions_must_divide_by_tp(field: str) -> None:
    cfg = cfg_for(parallel="tp2")
    setattr(cfg.model, field, 1001)
    msg = one(cfg, world=2)
    assert f"model.{field}=1001 is not divisible by parallel.tp=2; use tp in [1, 7, 11, 13]" in msg


def test_sequence_parallel_needs_tp() -> None:
    cfg = cfg_for()
    cfg.parallel.sequence_parallel = True
    msg = one(cfg)
    assert "parallel.sequence_parallel=true needs parallel.tp>1" in msg and "sequence_parallel=false" in msg


# -- pipeline ------------------------------------------------------------------------------------


def test_layers_must_divide_by_pp() -> None:
    cfg = cfg_for("llama3_8b", "llama3_8b_tp1pp1")
    cfg.parallel.pp = 3
    msg = one(cfg, world=3)
    assert msg.startswith("parallel.pp=3 does not divide model.num_layers=32; use pp in [1, 2, 4, 8, 16, 32]")
    assert "parallel.pipeline_layout" in msg and "[11, 11, 10]" in msg


def test_pp_larger_than_layers() -> None:
    cfg = cfg_for(parallel="pp4")
    cfg.parallel.pp = 8
    assert "parallel.pp=8 exceeds model.num_layers=4" in one(cfg, world=8)


def test_vpp_must_divide_layers_per_stage() -> None:
    cfg = cfg_for("llama3_70b", "llama3_70b_tp4pp4")
    cfg.parallel.vpp = 3
    cfg.batch.global_batch_size = 16
    msg = one(cfg, world=16)
    assert "parallel.vpp=3 does not divide the 20 layers per pipeline stage" in msg
    assert "use vpp in [2, 4, 5, 10, 20]" in msg


def test_vpp_needs_pp() -> None:
    cfg = cfg_for()
    cfg.parallel.vpp = 2
    assert "parallel.vpp=2 (interleaved pipeline) needs parallel.pp>1" in one(cfg)


def test_interleaving_needs_microbatches_in_multiples_of_pp() -> None:
    cfg = cfg_for(parallel="pp2_vpp2", global_batch_size=3)
    msg = one(cfg, world=2)
    assert "3 microbatches per step" in msg and "multiple of parallel.pp=2" in msg
    assert "global_batch_size in [2, 4, 6, 8]" in msg


def test_vpp_chunks_and_mcore_layout() -> None:
    layout = validate(cfg_for(parallel="pp2_vpp2"), world_size=2, device="cpu")
    assert layout.layers_per_virtual_stage == [1, 1, 1, 1] and layout.layers_per_stage == [2, 2]


def test_explicit_uneven_layout_becomes_megatron_cores_layout() -> None:
    layout = validate(cfg_for(parallel="pp2_uneven"), world_size=2, device="cpu")
    assert layout.layers_per_stage == [3, 1] and layout.uneven
    assert layout.mcore_pipeline_layout() == [
        ["embedding", "decoder", "decoder", "decoder"],
        ["decoder", "loss"],
    ]


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        ([2, 1], "sums to 3 layers but model.num_layers=4; make the entries sum to 4"),
        ([2, 1, 1], "has 3 entries but parallel.pp=2; give one entry per pipeline stage (2)"),
        ([4, 0], "has a stage with fewer than 1 layer"),
    ],
)
def test_explicit_layout_errors(layout: list[int], expected: str) -> None:
    cfg = cfg_for(parallel="pp2_uneven")
    cfg.parallel.pipeline_layout = layout
    msg = one(cfg, world=2)
    assert msg.startswith(f"parallel.pipeline_layout={layout}") and expected in msg


def test_explicit_layout_with_interleaving() -> None:
    cfg = cfg_for(parallel="pp2_uneven")
    cfg.model.num_layers = 8
    cfg.parallel.vpp = 2
    cfg.parallel.pipeline_layout = [6, 2]  # per stage, each split in 2 chunks
    layout = validate(cfg, world_size=2, device="cpu")
    assert layout.layers_per_virtual_stage == [3, 1, 3, 1] and layout.layers_per_stage == [6, 2]
    cfg.parallel.pipeline_layout = [2, 1, 3, 2]  # per virtual stage, megatron-core order
    layout = validate(cfg, world_size=2, device="cpu")
    assert layout.layers_per_stage == [5, 3]
    mc = layout.mcore_pipeline_layout()
    assert mc is not None and len(mc) == 4 and mc[0][0] == "embedding" and mc[-1][-1] == "loss"
    cfg.parallel.pipeline_layout = [5, 3]
    msg = one(cfg, world=2)
    assert "stages with [5, 3] layers cannot be split into parallel.vpp=2 chunks" in msg


def test_layout_and_scheme_are_exclusive() -> None:
    cfg = cfg_for(parallel="pp2_uneven")
    cfg.parallel.pipeline_layout_scheme = "alternating"
    assert "are both set; keep one" in one(cfg, world=2)


def test_alternating_scheme() -> None:
    assert alternating_layout(96, 8) == [13, 11] * 4
    assert alternating_layout(9, 3) == [4, 2, 3]
    layout = validate(cfg_for(parallel="pp2_alternating"), world_size=2, device="cpu")
    assert layout.layers_per_stage == [3, 1]
    cfg = cfg_for(parallel="pp4")
    cfg.parallel.pipeline_layout_scheme = "alternating"  # 4 layers on 4 stages: 1 each, no room
    msg = one(cfg, world=4)
    assert "pipeline_layout_scheme=alternating needs parallel.pp>=2 dividing model.num_layers=4" in msg
    assert "use pp in [2]" in msg
    cfg.parallel.pipeline_layout_scheme = "zigzag"
    assert "parallel.pipeline_layout_scheme='zigzag' is not valid; use one of [alternating]" in one(
        cfg, world=4
    )


# -- batch and context parallelism ---------------------------------------------------------------


def test_global_batch_must_divide_by_micro_batch_times_dp() -> None:
    cfg = cfg_for(global_batch_size=6, micro_batch_size=2)
    msg = one(cfg, world=2)
    assert "batch.global_batch_size=6 is not divisible by batch.micro_batch_size=2 * dp=2 = 4" in msg
    assert "use global_batch_size in [4, 8, 12, 16] or micro_batch_size in [1, 3]" in msg


def test_seq_length_must_divide_by_two_cp() -> None:
    cfg = cfg_for(parallel="cp2")
    cfg.parallel.cp = 4
    cfg.model.seq_length = cfg.model.max_position_embeddings = 36
    msg = one(cfg, world=4)
    assert (
        "model.seq_length=36 is not divisible by 2*parallel.cp=8" in msg
        and "cp in [1, 2, 3, 6, 9, 18]" in msg
    )


# -- recomputation -------------------------------------------------------------------------------


def test_recompute_layers_beyond_the_stage() -> None:
    cfg = cfg_for(parallel="pp2", optim="recompute")
    cfg.optim.recompute_num_layers = 3
    msg = one(cfg, world=2)
    assert "optim.recompute_num_layers=3 exceeds the 2 layers of the smallest (virtual) pipeline stage" in msg
    assert "use recompute_num_layers in [1, 2]" in msg


def test_recompute_layers_counted_per_uneven_stage() -> None:
    cfg = cfg_for(parallel="pp2_uneven", optim="recompute")
    cfg.optim.recompute_num_layers = 2  # the second stage holds only 1 layer
    assert "use recompute_num_layers in [1, 1]" in one(cfg, world=2)


def test_uniform_recompute_layers_must_divide_every_stage() -> None:
    # mcore checkpoints layers [i, i + n) while i < the stage's layers: 3 of 4 would run past the
    # end (IndexError in the first forward, on that stage only).
    cfg = cfg_for(optim="recompute")  # tiny_gpt: 4 layers, one stage
    cfg.optim.recompute_granularity, cfg.optim.recompute_method = "full", "uniform"
    cfg.optim.recompute_num_layers = 3
    msg = one(cfg)
    assert "optim.recompute_num_layers=3 with recompute_method=uniform must divide the layers of every" in msg
    assert "([4]); use one of [1, 2, 4], or recompute_method=block" in msg
    cfg.optim.recompute_num_layers = 2
    validate(cfg, world_size=1, device="cpu")
    cfg.optim.recompute_method, cfg.optim.recompute_num_layers = "block", 3  # block: any count
    validate(cfg, world_size=1, device="cpu")


@pytest.mark.parametrize(
    ("granularity", "method", "layers", "expected"),
    [
        (
            "full",
            None,
            1,
            "optim.recompute_granularity=full needs optim.recompute_method in [block, uniform]",
        ),
        (
            "full",
            "block",
            None,
            "optim.recompute_granularity=full needs optim.recompute_num_layers in [1, 4]",
        ),
        ("full", "block", 0, "optim.recompute_num_layers=0 must be >= 1"),
        (
            "selective",
            "uniform",
            None,
            "optim.recompute_method='uniform' does not apply to recompute_granularity=selective",
        ),
        (
            "selective",
            None,
            2,
            "optim.recompute_num_layers=2 must be null with recompute_granularity=selective",
        ),
        (None, "block", None, "have no effect without optim.recompute_granularity"),
        (
            "partial",
            None,
            None,
            "optim.recompute_granularity='partial' is not valid; use one of [full, selective]",
        ),
        ("full", "random", 1, "optim.recompute_method='random' is not valid; use one of [block, uniform]"),
    ],
)
def test_recompute_combinations(
    granularity: str | None, method: str | None, layers: int | None, expected: str
) -> None:
    cfg = cfg_for()
    cfg.optim.recompute_granularity, cfg.optim.recompute_method = granularity, method
    cfg.optim.recompute_num_layers = layers
    assert expected in one(cfg)


def test_selective_recompute_is_valid() -> None:
    cfg = cfg_for()
    cfg.optim.recompute_granularity = "selective"
    validate(cfg, world_size=1, device="cpu")


# -- overlap -------------------------------------------------------------------------------------


def test_param_gather_overlap_needs_distributed_optimizer_and_grad_overlap() -> None:
    cfg = cfg_for()
    cfg.optim.overlap_param_gather = True
    cfg.optim.use_distributed_optimizer = False
    found = problems(cfg)
    assert any(
        "optim.overlap_param_gather=true needs optim.use_distributed_optimizer=true" in p for p in found
    )
    assert any("optim.overlap_param_gather=true needs optim.overlap_grad_reduce=true" in p for p in found)
    # Left automatic, a GPU run has the distributed optimizer: only the grad overlap is missing.
    cfg.optim.use_distributed_optimizer = None
    (only,) = problems(cfg)
    assert only.startswith("optim.overlap_param_gather=true needs optim.overlap_grad_reduce=true;")


def test_tp_comm_overlap_needs_tp_and_sequence_parallel() -> None:
    cfg = cfg_for(parallel="tp2")
    cfg.optim.tp_comm_overlap = True
    msg = one(cfg, world=2)
    assert "optim.tp_comm_overlap=true needs parallel.tp>1 and parallel.sequence_parallel=true" in msg
    cfg.parallel.sequence_parallel = True
    validate(cfg, world_size=2, device="cuda")


# -- FSDP ----------------------------------------------------------------------------------------


def test_torch_fsdp2_does_not_support_pipeline_parallelism() -> None:
    cfg = cfg_for("tiny_moe", "fsdp_torch")
    cfg.parallel.pp = 2
    msg = one(cfg, world=4)
    assert "parallel.fsdp_impl=torch_fsdp2 does not support pipeline parallelism in megatron-core 0.16" in msg
    assert "parallel.fsdp_impl=megatron_fsdp or parallel.pp=1" in msg


def test_torch_fsdp2_limits() -> None:
    cfg = cfg_for("tiny_gpt", "fsdp_torch", optim="comm_overlap")
    found = problems(cfg, world=2)
    text = "\n".join(found)
    assert "cannot be combined with optim.use_distributed_optimizer=true" in text
    assert "needs model.untie_embeddings=true" in text
    cfg = cfg_for("tiny_moe", "fsdp_torch")
    cfg.parallel.ep = 2
    assert "does not support expert parallelism (parallel.ep=2)" in one(cfg, world=2)


def test_megatron_fsdp_composes_with_pipeline_and_expert_parallelism() -> None:
    cfg = cfg_for("tiny_moe", "fsdp", optim="comm_overlap")
    cfg.parallel.pp, cfg.parallel.ep = 2, 2
    validate(cfg, world_size=4, device="cuda")


def test_unknown_fsdp_impl() -> None:
    cfg = cfg_for(parallel="fsdp")
    cfg.parallel.fsdp_impl = "zero3"
    assert "parallel.fsdp_impl='zero3' is not valid; use one of [megatron_fsdp, torch_fsdp2]" in one(cfg)


# -- model ---------------------------------------------------------------------------------------


def test_model_shape_rules() -> None:
    cfg = cfg_for("tiny_moe")
    cfg.model.hidden_size = 66
    cfg.model.moe_router_topk = 5
    cfg.model.max_position_embeddings = 32
    cfg.model.ffn_hidden_size = 0
    text = "\n".join(problems(cfg))
    assert "model.hidden_size=66 is not divisible by model.num_attention_heads=4" in text
    assert "model.moe_router_topk=5 must lie in [1, model.num_experts=4]" in text
    assert "model.max_position_embeddings=32 is smaller than model.seq_length=64" in text
    assert "model.ffn_hidden_size=0 must be a positive number" in text


def test_kv_groups_must_divide_heads() -> None:
    cfg = cfg_for("tiny_moe")
    cfg.model.num_query_groups = 3
    assert "model.num_query_groups=3 does not divide model.num_attention_heads=4" in one(cfg)


@pytest.mark.parametrize(
    ("section", "field", "value", "expected"),
    [
        ("model", "position_embedding", "alibi", "use one of [rope, learned_absolute, none]"),
        ("model", "normalization", "BatchNorm", "use one of [LayerNorm, RMSNorm]"),
        ("batch", "precision", "fp8", "use one of [auto, fp32, bf16, fp16]"),
        ("launch", "launcher", "mpi", "use one of [local, slurm, none]"),
        ("launch", "device", "tpu", "use one of [auto, cpu, cuda]"),
        ("telemetry", "backend", "rapl", "use one of [auto, nvml, amdsmi, synthetic]"),
        ("telemetry", "collector_sched", "fifo", "use one of [auto, idle, normal]"),
    ],
)
def test_enumerated_values(section: str, field: str, value: str, expected: str) -> None:
    cfg = cfg_for()
    setattr(getattr(cfg, section), field, value)
    msg = "\n".join(problems(cfg))
    assert f"{section}.{field}={value!r} is not valid; {expected}" in msg


def test_telemetry_launch_and_data_rules() -> None:
    cfg = cfg_for()
    cfg.telemetry.windows = ["step", "layer"]
    cfg.telemetry.hz = 0
    cfg.telemetry.nice = 20
    cfg.launch.master_port = 70000
    cfg.data.path = "/nonexistent/corpus_text_document"
    text = "\n".join(problems(cfg))
    assert "telemetry.windows has unknown kinds ['layer']; use a subset of [step, microbatch, phase]" in text
    assert "telemetry.hz=0 is not a sampling rate; use a rate in [1, 1000] Hz" in text
    assert "telemetry.nice=20: give the telemetry process's nice value, an integer from 0" in text
    assert "launch.master_port=70000 is not a TCP port" in text
    assert "/nonexistent/corpus_text_document.bin and /nonexistent/corpus_text_document.idx not found" in text
    assert "data.path=null for mock data" in text


@pytest.mark.parametrize("hz", [5000, 0.5, "fast"])
def test_sampling_rate_outside_what_the_sampler_holds_is_refused_before_launch(hz: object) -> None:
    cfg = cfg_for()
    cfg.telemetry.hz = hz  # type: ignore[assignment]
    text = "\n".join(problems(cfg))
    assert f"telemetry.hz={hz!r} is " in text and "use a rate in [1, 1000] Hz" in text
    cfg.telemetry.enabled = False  # no sampler: the rate does not matter
    validate(cfg, world_size=1, device="cuda")


def test_a_run_directory_that_cannot_be_made_is_refused_before_launch(tmp_path: Path) -> None:
    cfg = cfg_for()
    (tmp_path / "afile").write_text("x")
    cfg.telemetry.out_dir = str(tmp_path / "afile")
    assert "is a file, not a directory; give a directory for the run" in one(cfg)
    cfg.telemetry.out_dir = str(tmp_path / "afile" / "run")
    assert f"cannot be made: {str(tmp_path / 'afile')!r} is a file" in one(cfg)
    cfg.telemetry.out_dir = str(tmp_path / "new" / "deeper" / "run")  # made later: fine
    validate(cfg, world_size=1, device="cuda")


def test_a_run_directory_in_a_folder_this_user_cannot_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (root ignores permissions, so the permission check itself is stood in for)
    import charllm_nemo.train.validate_run as vr

    monkeypatch.setattr(vr.os, "access", lambda path, mode: Path(path) != tmp_path)
    cfg = cfg_for()
    cfg.telemetry.out_dir = str(tmp_path / "run")
    assert f"{str(tmp_path)!r} is not writable by this user" in one(cfg)


def test_a_model_that_cannot_fit_the_hosts_memory_on_cpu_is_refused_before_it_allocates() -> None:
    from charllm_nemo.train.config import for_device
    from charllm_nemo.train.plan import RANK_PROCESS_FLOOR_BYTES as FLOOR
    from charllm_nemo.train.plan import cpu_memory_problem, plan_stage_activations, plan_stage_memory

    gib = 2**30
    big = for_device(cfg_for("llama3_70b"), "cpu")
    layout = validate(big, world_size=1, device="cuda")
    msg = cpu_memory_problem(big, layout, 1, 24 * gib)
    # 70.55 B parameters (the norms aside) x 16 bytes: fp32 weight, gradient, Adam's two moments;
    # and one microbatch of 8192 tokens through 80 layers of unfused attention in fp32.
    assert msg is not None
    assert msg.startswith("model=llama3_70b on CPU needs at least 2,890.1 GiB for 1 rank(s)")
    assert "1 rank(s) on this host: 1,051.3 GiB of weights, fp32 gradients and Adam's two moments" in msg
    assert "(the model has 70.552 B parameters), 1,838.6 GiB of activations for" in msg
    assert "batch.micro_batch_size=1 and model.seq_length=8192 (estimated;" in msg
    assert "256.0 MiB per rank for Python, torch and megatron-core; this host has 24.0 GiB" in msg
    assert cpu_memory_problem(big, layout, 1, None) is None  # memory unknown: no guess
    # The same per-stage plan as the dry run: the tied embedding's copy on the last stage and
    # every stage's ranks count when all ranks are on this host; a rank alone counts the
    # lightest stage.
    tiny = cfg_for("tiny_gpt", "pp2")
    layout = validate(tiny, world_size=2, device="cpu")
    stages = plan_stage_memory(tiny, layout)
    acts = plan_stage_activations(tiny, layout, "local")
    assert sum(s.total_bytes for s in stages) == 16 * (sum(s.parameters for s in stages))
    both = sum(s.total_bytes + a.total_bytes for s, a in zip(stages, acts, strict=True))
    assert cpu_memory_problem(tiny, layout, 2, both + 2 * FLOOR) is None
    assert cpu_memory_problem(tiny, layout, 2, both + 2 * FLOOR - 1) is not None
    lightest = min(s.total_bytes + a.total_bytes for s, a in zip(stages, acts, strict=True))
    assert cpu_memory_problem(tiny, layout, 1, lightest + FLOOR) is None
    assert cpu_memory_problem(tiny, layout, 1, lightest + FLOOR - 1) is not None
    # A small model with a sequence and micro batch far too large: its activations alone.
    long = cfg_for("tiny_gpt", micro_batch_size=8, global_batch_size=8)
    long.model.seq_length = long.model.max_position_embeddings = 16384
    layout = validate(long, world_size=1, device="cuda")
    msg = cpu_memory_problem(long, layout, 1, 24 * gib)
    assert msg is not None and "of activations for batch.micro_batch_size=8 and model.seq_length=16384" in msg
    # validate applies it on CPU only (this host has far less than a TB), before any allocation
    assert "needs at least 2,890.1 GiB" in one(big, world=1, device="cpu")
    # far too many ranks of a tiny model: each is a process with torch in it
    crowd = cfg_for("tiny_gpt", global_batch_size=4096)
    assert "for 4096 rank(s) on this host" in one(crowd, world=4096, device="cpu")
    validate(big, world_size=1, device="cuda")  # GPU memory is not this check's business


def test_an_unknown_precision_on_cpu_is_one_problem_not_two() -> None:
    cfg = cfg_for()
    cfg.batch.precision = "fp8"
    assert problems(cfg, device="cpu") == [
        "batch.precision='fp8' is not valid; use one of [auto, fp32, bf16, fp16]"
    ]
    cfg.batch.precision = "bf16"
    assert "batch.precision=bf16: megatron-core 0.16's mixed-precision optimizer" in one(cfg, device="cpu")


def test_data_path_with_both_files_is_accepted(tmp_path: Path) -> None:
    prefix = str(tmp_path / "corpus")
    for ext in (".bin", ".idx"):
        Path(prefix + ext).touch()
    cfg = cfg_for()
    cfg.data.path = prefix
    validate(cfg, world_size=1, device="cpu")


# -- CPU -----------------------------------------------------------------------------------------


def test_cpu_unsupported_options_come_from_train_cpu() -> None:
    pytest.importorskip("torch")
    cfg = cfg_for(parallel="tp2_sp")
    msg = one(cfg, world=2, device="cpu")
    assert "parallel.sequence_parallel=true" in msg and "sequence_parallel=false" in msg
    validate(cfg, world_size=2, device="cuda")  # fine on a GPU


def test_validating_for_a_cpu_imports_no_torch() -> None:
    """The CPU rules live apart from train/cpu.py's patches (train/cpu_rules.py): validating, as a
    dry run does, no longer imports torch (~2 s of each dry run; the docs test makes ~30)."""
    code = (
        "import sys\n"
        "from charllm_nemo.train.config import TrainConfig\n"
        "from charllm_nemo.train.validate import validate\n"
        "validate(TrainConfig(), world_size=1, device='cpu')\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=deadline(120))
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr


def test_divisors() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1) == [1] and divisors(0) == []


def test_a_zero_world_is_one_problem_named_where_it_comes_from() -> None:
    cfg = cfg_for()
    cfg.launch.nproc = 0
    assert one(cfg, world=None) == "launch.nproc=0 must be a positive number; e.g. launch.nproc=1"
    cfg.launch.nproc = 1
    assert one(cfg, world=0) == "world_size=0 must be >= 1; set launch.nproc (or the srun task count)"


@pytest.mark.parametrize(
    ("section", "name", "value"),
    [
        ("batch", "train_steps", 10**23),
        ("batch", "global_batch_size", 2**40),
        ("model", "vocab_size", 10**12),
        ("model", "seq_length", 2**40),
        ("parallel", "tp", 2**30),
        ("data", "seed", 2**40),
        ("launch", "nproc", 10**9),
    ],
)
def test_unbounded_integers_are_refused_by_name_before_any_other_check(
    section: str, name: str, value: int
) -> None:
    """Issue 33: ``batch.train_steps=1e23`` was accepted; later checks enumerate divisors of such
    values, so the bound comes first and is the only problem said."""
    from charllm_nemo.train.validate_model import INT_BOUNDS

    cfg = cfg_for("tiny_gpt")
    setattr(getattr(cfg, section), name, value)
    said = problems(cfg)
    assert len(said) == 1, said
    assert said[0].startswith(f"{section}.{name}={value} is larger than {INT_BOUNDS[f'{section}.{name}']:,}")


def test_the_bounds_leave_real_configs_alone() -> None:
    from charllm_nemo.train.validate_model import INT_BOUNDS

    cfg = cfg_for("tiny_gpt")
    for fieldname, high in INT_BOUNDS.items():
        section, name = fieldname.split(".")
        value = getattr(getattr(cfg, section), name)
        assert value is None or value <= high, fieldname
    assert validate(cfg, world_size=1, device="cuda").world_size == 1


def test_a_float_step_count_from_the_command_line_is_refused() -> None:
    from charllm_nemo.train import app

    with pytest.raises(ConfigError, match=r"batch\.train_steps"):
        app.load(["model=tiny_gpt", "batch.train_steps=1e23"])


def test_profile_steps_the_loop_never_reaches_are_refused_with_the_range_that_runs() -> None:
    # 5 steps run as 0..4: steps 5 and 6 would be traced by nobody, silently (the docs' old example)
    cfg = cfg_for(train_steps=5)
    cfg.telemetry.profile_steps = [5, 6]
    found = one(cfg, device="cpu")
    assert "telemetry.profile_steps=[5, 6]" in found and "runs steps 0..4" in found
    assert "batch.train_steps=7" in found
    cfg.telemetry.profile_steps = [3, 4]  # the last two steps of five: valid
    assert validate(cfg, world_size=1, device="cpu").world_size == 1
