"""Activation memory (metrics/activations.py): the terms, the schedules, recomputation, and the
sum checked against what megatron-core really saves (CPU) and what an H200 really peaked at."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tests.deadline import deadline

from charllm_nemo.errors import ConfigError
from charllm_nemo.metrics.activations import (
    ActivationSetup,
    StageActivations,
    in_flight_microbatches,
    layer_activation_bytes,
    stage_activations,
)
from charllm_nemo.metrics.flops import ModelShape
from charllm_nemo.train.config import ModelConfig, TrainConfig
from charllm_nemo.train.plan import plan_stage_activations, plan_stage_memory
from charllm_nemo.train.presets import model_preset
from charllm_nemo.train.validate import validate


def _shape(layers: int, hidden: int, heads: int, ffn: int, vocab: int, seq: int) -> ModelShape:
    return ModelShape(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=ffn,
        vocab_size=vocab, seq_length=seq,
    )  # fmt: skip


def _one_stage(shape: ModelShape, setup: ActivationSetup) -> StageActivations:
    (stage,) = stage_activations(
        shape, setup, pp=1, layers_per_virtual_stage=[shape.num_layers], num_microbatches=1
    )
    return stage


# GPT-3 175B's layer: s 2048, h 12288, 96 heads, FFN 4h, GeLU, LayerNorm.
GPT3 = _shape(96, 12288, 96, 49152, 51200, 2048)


def test_a_transformer_engine_layer_is_korthikantis_count_without_dropout() -> None:
    # Korthikanti et al. (2022), eq. 2-4: sbh * (10 + 24 / t + 5 a s / (h t)) bytes a layer in
    # 16-bit, of which 2 sbh (two dropout masks, replicated) and the 5 a s / (h t) (scores,
    # their mask and dropout output) are not kept here: flash attention and no dropout.
    # Flash attention keeps its softmax statistics instead: 4 bytes per head and token.
    s, b, h, a = 2048, 1, 12288, 96
    sbh = s * b * h
    for tp, sp in ((1, False), (8, False), (8, True)):
        setup = ActivationSetup(b, "bf16", implementation="te", tp=tp, sequence_parallel=sp)
        replicated = 8 * sbh // (tp if sp else 1)
        expected = replicated + 24 * sbh // tp + 4 * (a // tp) * s * b
        assert layer_activation_bytes(GPT3, 0, setup) == expected
        # Rotary embeddings: megatron-core's attention copies query and key first (2 bytes each).
        rope = ActivationSetup(b, "bf16", rope=True, implementation="te", tp=tp, sequence_parallel=sp)
        assert layer_activation_bytes(GPT3, 0, rope) == expected + 4 * sbh // tp


def test_a_local_layer_keeps_the_scores_in_fp32_and_in_16_bit() -> None:
    # megatron-core's unfused attention: the fp32 softmax output for the softmax's backward,
    # its bf16 copy for the context GEMM; in fp32 training one tensor serves both.
    s, b, a = 2048, 2, 96
    scores = a * s * s * b
    bf16 = layer_activation_bytes(GPT3, 0, ActivationSetup(b, "bf16"))
    te = layer_activation_bytes(GPT3, 0, ActivationSetup(b, "bf16", implementation="te"))
    assert bf16 - (te - 4 * a * s * b) == 6 * scores  # same hidden-state terms, + the scores
    fp32 = layer_activation_bytes(GPT3, 0, ActivationSetup(b, "fp32"))
    assert fp32 - 2 * (bf16 - 6 * scores) == 4 * scores  # hidden terms twice the size
    # Selective recomputation (core attention) keeps q, k, v (views of the QKV output) instead.
    sel = layer_activation_bytes(GPT3, 0, ActivationSetup(b, "bf16", recompute_granularity="selective"))
    assert bf16 - sel == 6 * scores


def test_microbatches_in_flight_follow_megatron_cores_warmup() -> None:
    assert [in_flight_microbatches(i, 1, 8) for i in range(1)] == [1]  # no pipeline: one at a time
    assert [in_flight_microbatches(i, 4, 8) for i in range(4)] == [4, 3, 2, 1]  # 1F1B
    assert [in_flight_microbatches(i, 4, 2) for i in range(4)] == [2, 2, 2, 1]  # fewer microbatches
    # Interleaved, 2 chunks: 2 (pp - i - 1) + (vpp - 1) pp warm-up forwards, + 1, at most all 16.
    assert [in_flight_microbatches(i, 4, 8, vpp=2) for i in range(4)] == [11, 9, 7, 5]
    assert in_flight_microbatches(0, 4, 4, vpp=4) == 16


@pytest.mark.parametrize(("pp", "vpp"), [(2, 2), (4, 2), (4, 5), (8, 3), (16, 6)])
def test_the_first_stage_holds_megatron_lms_interleaving_penalty(pp: int, vpp: int) -> None:
    # Megatron-LM's theoretical_memory_usage.py: the first stage holds the activations of all L
    # layers once (1F1B), times 1 + (pp - 1) / (pp * vpp) when interleaved (Korthikanti et al.).
    chunk_passes = in_flight_microbatches(0, pp, 1000, vpp=vpp)
    layers_held = chunk_passes / (pp * vpp)  # in units of the model's L layers
    assert layers_held == pytest.approx(1 + (pp - 1) / (pp * vpp))
    assert in_flight_microbatches(0, pp, 1000) / pp == 1  # 1F1B: pp microbatches of L / pp layers


def test_full_recomputation_keeps_the_inputs_of_the_checkpointed_layers() -> None:
    shape = _shape(8, 256, 8, 1024, 1000, 128)
    layer_input = 2 * 4 * 128 * 256  # bf16 [s, b, h] with b = 4

    def saved(**recompute: Any) -> int:
        return _one_stage(shape, ActivationSetup(4, "bf16", **recompute)).saved_bytes

    none = saved()
    layer = layer_activation_bytes(shape, 0, ActivationSetup(4, "bf16"))
    post = none - 8 * layer  # final norm, output layer input, logits
    # uniform, groups of 2: four inputs; block 3: three inputs and five whole layers.
    assert saved(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2) == (
        post + 4 * layer_input
    )
    assert saved(recompute_granularity="full", recompute_method="block", recompute_num_layers=3) == (
        post + 3 * layer_input + 5 * layer
    )
    with pytest.raises(ConfigError, match="recompute_num_layers"):
        saved(recompute_granularity="full", recompute_method="block")


def test_the_last_stage_adds_the_logits_and_their_gradient() -> None:
    shape = _shape(4, 64, 4, 256, 1024, 64)
    stages = stage_activations(
        shape, ActivationSetup(2, "bf16", tp=2), pp=2, layers_per_virtual_stage=[2, 2], num_microbatches=4
    )
    logits = 4 * 2 * 64 * 1024 // 2  # fp32, split over TP
    assert [s.in_flight for s in stages] == [2, 1]
    assert [s.loss_grad_bytes for s in stages] == [0, logits]
    layer = layer_activation_bytes(shape, 0, ActivationSetup(2, "bf16", tp=2))
    assert stages[0].saved_bytes == 2 * 2 * layer
    assert stages[1].saved_bytes == 2 * layer + 2 * (2 * 2 * 64 * 64) + logits  # + norm, output input


def test_bad_setups_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"batch\.precision='fp8'"):
        ActivationSetup(1, "fp8")
    with pytest.raises(ConfigError, match="implementation='apex'"):
        ActivationSetup(1, implementation="apex")
    with pytest.raises(ConfigError, match="recompute_granularity='some'"):
        ActivationSetup(1, recompute_granularity="some")
    with pytest.raises(ConfigError, match="layers_per_virtual_stage"):
        stage_activations(GPT3, ActivationSetup(1), pp=2, layers_per_virtual_stage=[96], num_microbatches=1)


def test_the_estimate_matches_the_peak_of_a_real_h200_run() -> None:
    # bench/gpu_check.py's ~1.3B GPT on one H200 (2026-12-04, megatron-core 0.16.1's local
    # layers: no TransformerEngine there): torch.cuda.max_memory_allocated() 78,438,653,440
    # bytes, of which 23,597,678,592 the planned weights, gradients and optimizer state.
    cfg = TrainConfig()
    cfg.model = ModelConfig(**{
        **vars(model_preset("tiny_gpt")), "name": "custom", "num_layers": 24, "hidden_size": 2048,
        "num_attention_heads": 16, "ffn_hidden_size": 8192, "vocab_size": 50304, "seq_length": 2048,
        "max_position_embeddings": 2048,
    })  # fmt: skip
    cfg.batch.precision, cfg.batch.micro_batch_size, cfg.batch.global_batch_size = "bf16", 4, 16
    cfg.launch.device = "cuda"
    layout = validate(cfg, world_size=1, device="cuda")
    plan = plan_stage_memory(cfg, layout)[0].total_bytes
    assert plan == 23_597_678_592
    estimate = plan + plan_stage_activations(cfg, layout, "local")[0].total_bytes
    assert estimate / 78_438_653_440 == pytest.approx(1.0, abs=0.01)


# What megatron-core really keeps: models built as a CPU run builds them, in one subprocess.
SMALL = {"num_layers": 2, "hidden_size": 96, "num_attention_heads": 4, "ffn_hidden_size": 160,
         "seq_length": 56, "max_position_embeddings": 56, "vocab_size": 1000}  # fmt: skip
LLAMA = {**SMALL, "num_query_groups": 2, "swiglu": True, "position_embedding": "rope",
         "normalization": "RMSNorm", "untie_embeddings": True}  # fmt: skip
SELECTIVE, MOE = ["selective", None, None], {**LLAMA, "num_experts": 4, "moe_ffn_hidden_size": 176}
CASES: list[dict[str, Any]] = [
    {"model": SMALL, "precision": "fp32", "recompute": None},  # GPT: MHA, LayerNorm, GeLU
    {"model": SMALL, "precision": "bf16", "recompute": SELECTIVE},
    {"model": {**SMALL, "num_query_groups": 2}, "precision": "fp32", "recompute": ["full", "block", 1]},
    {"model": LLAMA, "precision": "bf16", "recompute": None},  # GQA, rope, RMSNorm, SwiGLU
    {"model": LLAMA, "precision": "fp32", "recompute": ["full", "uniform", 1]},
    {"model": {**LLAMA, "num_query_groups": None}, "precision": "bf16", "recompute": SELECTIVE},
    {"model": MOE, "precision": "bf16", "recompute": None},
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_estimate_matches_what_megatron_core_saves_on_cpu() -> None:
    pytest.importorskip("megatron.core")
    cases = [{**c, "micro_batch_size": 3} for c in CASES]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")  # fmt: skip
    helper = Path(__file__).with_name("_saved_tensors.py")
    proc = subprocess.run(
        [sys.executable, str(helper), json.dumps(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=deadline(300),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    measured = json.loads(lines[0][len("RESULT ") :])
    for case, saved in zip(cases, measured, strict=True):
        m = ModelConfig(**{**vars(model_preset("tiny_gpt")), **case["model"]})
        granularity, method, n = case["recompute"] or (None, None, None)
        setup = ActivationSetup(
            3, case["precision"], m.normalization, m.position_embedding == "rope",
            recompute_granularity=granularity, recompute_method=method, recompute_num_layers=n,
        )  # fmt: skip
        stage = _one_stage(ModelShape.from_model_config(m), setup)
        # Left out on purpose: the norms' statistics, rotary tables, masks, token ids (~1-2 %).
        assert 0.97 < stage.saved_bytes / saved <= 1.0, (case, stage.saved_bytes, saved)


SCHEDULES = [  # two ranks each: (model, parallel sizes, microbatches in flight per stage)
    ({**SMALL, "num_layers": 4}, {"pp": 2}, [2, 1]),  # 1F1B
    ({**SMALL, "num_layers": 4}, {"pp": 2, "vpp": 2}, [5, 3]),  # interleaved: chunk passes
    ({**SMALL, "num_layers": 4}, {"tp": 2}, [1]),  # heads and FFN split, the rest replicated
    (MOE, {"ep": 2}, [1]),  # two experts a rank, the tokens routed to them
]


@pytest.mark.parametrize(("model", "sizes", "in_flight"), SCHEDULES, ids=["pp2", "pp2-vpp2", "tp2", "ep2"])
def test_the_estimate_matches_a_real_step_on_two_ranks(
    model: dict[str, Any], sizes: dict[str, int], in_flight: list[int]
) -> None:
    # The peak of the storages saved for the backward on each rank during one step of
    # megatron-core's schedule (4 microbatches of 3), against the stage's estimate. With EP the
    # ranks' experts get unequal shares of the tokens (routing is not balanced): their sum is
    # compared with the estimate's (which assumes balanced routing) over the stage's ranks.
    pytest.importorskip("megatron.core")
    case = {"model": model, "precision": "fp32", "micro_batch_size": 3, "global_batch_size": 12, **sizes}
    port = _free_port()
    helper = Path(__file__).with_name("_saved_tensors_schedule.py")
    procs = [
        subprocess.Popen(
            [sys.executable, str(helper), json.dumps(case)],
            env=dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=deadline(300))[0] for p in procs]
    peaks: dict[int, list[int]] = {}
    for proc, out in zip(procs, outputs, strict=True):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, out[-3000:]
        result = json.loads(lines[0][len("RESULT ") :])
        assert result["left"] == 0  # every saved tensor was released by the backward
        peaks.setdefault(result["stage"], []).append(result["peak"])
    m = ModelConfig(**{**vars(model_preset("tiny_gpt")), **model})
    pp, vpp = sizes.get("pp", 1), sizes.get("vpp") or 1
    setup = ActivationSetup(3, "fp32", m.normalization, m.position_embedding == "rope", tp=sizes.get("tp", 1))
    stages = stage_activations(
        ModelShape.from_model_config(m), setup, pp=pp,
        layers_per_virtual_stage=[m.num_layers // (pp * vpp)] * (pp * vpp), num_microbatches=4,
    )  # fmt: skip
    assert [s.in_flight for s in stages] == in_flight
    for s in stages:
        measured = peaks[s.stage]
        assert 0.97 < s.saved_bytes * len(measured) / sum(measured) <= 1.0, (s, peaks)
