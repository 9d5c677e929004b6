"""Choices train/model.py makes from the config and the machine (no model is built here)."""

from __future__ import annotations

import sys
from types import ModuleType

import pytest

from charllm_nemo.train import model
from charllm_nemo.train.config import TrainConfig
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
