"""Choices train/model.py makes from the config and the machine (no model is built here)."""

from __future__ import annotations

import sys
from types import ModuleType

import pytest

from charllm_nemo.errors import ConfigError
from charllm_nemo.train import model
from charllm_nemo.train.config import TrainConfig, for_device
from charllm_nemo.train.presets import model_preset


def _with_te(monkeypatch: pytest.MonkeyPatch, grouped_linear: object) -> None:
    """TransformerEngine "installed", its mcore extension exposing ``grouped_linear``."""
    monkeypatch.setattr(model, "_have_te", lambda: True)
    ext = ModuleType("megatron.core.extensions.transformer_engine")
    ext.TEColumnParallelGroupedLinear = grouped_linear  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megatron.core.extensions.transformer_engine", ext)


def test_experts_run_as_one_grouped_gemm_on_a_gpu_with_transformer_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    moe = TrainConfig(model=model_preset("mixtral_8x7b"))
    dense = TrainConfig(model=model_preset("llama3_70b"))
    _with_te(monkeypatch, object)
    assert model.grouped_gemm_experts(moe, on_cpu=False)
    assert not model.grouped_gemm_experts(moe, on_cpu=True)  # the local spec: one GEMM per expert
    assert not model.grouped_gemm_experts(dense, on_cpu=False)
    _with_te(monkeypatch, None)  # a TransformerEngine without grouped linear layers
    assert not model.grouped_gemm_experts(moe, on_cpu=False)
    monkeypatch.setattr(model, "_have_te", lambda: False)
    assert not model.grouped_gemm_experts(moe, on_cpu=False)


def _fake_te(monkeypatch: pytest.MonkeyPatch, initialize_ub: object) -> None:
    """``transformer_engine.pytorch.module.base`` with ``initialize_ub`` (None: TE not there)."""
    if initialize_ub is None:
        monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.module", None)
        return
    base = ModuleType("transformer_engine.pytorch.module.base")
    base.initialize_ub = initialize_ub  # type: ignore[attr-defined]
    module = ModuleType("transformer_engine.pytorch.module")
    module.base = base  # type: ignore[attr-defined]
    for name, mod in (
        ("transformer_engine", ModuleType("transformer_engine")),
        ("transformer_engine.pytorch", ModuleType("transformer_engine.pytorch")),
        ("transformer_engine.pytorch.module", module),
        ("transformer_engine.pytorch.module.base", base),
    ):
        monkeypatch.setitem(sys.modules, name, mod)


def test_tp_comm_overlap_sets_up_transformer_engines_userbuffers(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    calls: list[dict[str, object]] = []

    def initialize_ub(shape, tp_size, use_fp8=False, dtype=None, ub_cfgs=None, bootstrap_backend=None):  # type: ignore[no-untyped-def]
        calls.append(
            dict(shape=shape, tp_size=tp_size, use_fp8=use_fp8, dtype=dtype, backend=bootstrap_backend)
        )

    cfg = TrainConfig(model=model_preset("llama3_70b"))
    cfg.parallel.tp, cfg.parallel.cp, cfg.batch.micro_batch_size = 4, 2, 2
    cfg.batch.precision = "bf16"
    _fake_te(monkeypatch, initialize_ub)
    model.initialize_tp_comm_overlap(cfg)
    # Megatron-LM's buffer: a microbatch's sequence over CP, by the hidden size.
    assert calls == [
        dict(shape=[8192 * 2 // 2, 8192], tp_size=4, use_fp8=False, dtype=torch.bfloat16, backend="nccl")
    ]

    def old_initialize_ub(shape, tp_size, use_fp8=False, ub_cfgs=None):  # type: ignore[no-untyped-def]
        raise AssertionError("not to be called: MPI bootstrap only")

    _fake_te(monkeypatch, old_initialize_ub)
    with pytest.raises(ConfigError, match="bootstraps userbuffers over MPI only"):
        model.initialize_tp_comm_overlap(cfg)
    _fake_te(monkeypatch, None)
    with pytest.raises(
        ConfigError, match=r"needs TransformerEngine's userbuffers .*set optim\.tp_comm_overlap=false"
    ):
        model.initialize_tp_comm_overlap(cfg)


@pytest.mark.parametrize(
    ("cp", "sp", "needs"), [(2, False, "parallel.cp>1"), (1, True, "parallel.sequence_parallel")]
)
def test_a_gpu_run_that_needs_transformer_engine_without_it_is_told_before_the_model(
    monkeypatch: pytest.MonkeyPatch, cp: int, sp: bool, needs: str
) -> None:
    pytest.importorskip("megatron.core")
    monkeypatch.setattr(model, "_have_te", lambda: False)
    cfg = TrainConfig(model=model_preset("tiny_gpt"))
    cfg.parallel.cp, cfg.parallel.sequence_parallel = cp, sp
    with pytest.raises(ConfigError, match=f"^{needs} need TransformerEngine on GPU"):
        model.layer_spec(cfg, on_cpu=False)
    cfg.parallel.cp, cfg.parallel.sequence_parallel = 1, False
    assert model.layer_spec(cfg, on_cpu=False) is not None  # the local spec serves the rest


def test_the_layers_a_rank_builds_are_named_for_the_activation_estimate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(model, "_have_te", lambda: True)
    assert model.layers_built(on_cpu=False) == "te"
    assert model.layers_built(on_cpu=True) == "local"  # CPU: always megatron-core's local spec
    monkeypatch.setattr(model, "_have_te", lambda: False)
    assert model.layers_built(on_cpu=False) == "local"


@pytest.mark.parametrize(("topk", "pre_softmax"), [(1, True), (2, False)])
def test_top1_routing_takes_the_softmax_before_choosing(topk: int, pre_softmax: bool) -> None:
    # megatron-core refuses top-1 with the softmax after the choice (over one logit: always 1,
    # no gradient); top-2 keeps Mixtral's softmax over the chosen two.
    pytest.importorskip("megatron.core")
    cfg = TrainConfig(model=model_preset("tiny_moe"))
    cfg.model.moe_router_topk = topk
    config = model.transformer_config(for_device(cfg, "cpu"), on_cpu=True)
    assert config.moe_router_topk == topk
    assert config.moe_router_pre_softmax is pre_softmax
