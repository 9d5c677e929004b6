"""megatron-core 0.16 -> 0.19 differences (charllm_nemo.train.mcore_compat, the CPU stream)."""

from __future__ import annotations

import builtins
import sys
from typing import Any

import pytest
import torch

from charllm_nemo.errors import ConfigError
from charllm_nemo.train import mcore_compat


def _batch(seq: int = 8) -> dict[str, torch.Tensor]:
    tokens = torch.arange(seq).view(1, seq)
    return {"tokens": tokens, "labels": tokens + 1, "position_ids": tokens.clone()}


def test_cp_batch_is_the_identity_without_context_parallelism() -> None:
    # cp=1 (no model parallel state): every token stays on this rank, whichever mcore is installed
    batch = _batch()
    out = mcore_compat.batch_on_this_cp_rank(dict(batch))
    assert torch.equal(out["tokens"], batch["tokens"])
    assert torch.equal(out["labels"], batch["labels"])


def test_cp_batch_passes_is_hybrid_cp_and_the_group_to_019(monkeypatch: pytest.MonkeyPatch) -> None:
    # megatron-core 0.19.2's signature: is_hybrid_cp is required, cp_group=None means the world
    seen: dict[str, Any] = {}

    def get_batch_on_this_cp_rank(
        batch: dict,
        is_hybrid_cp: bool,
        cp_group: Any = None,
        hybrid_cp_group_func: Any = None,
        use_per_sequence_balancing: bool = False,
    ) -> dict:
        seen.update(is_hybrid_cp=is_hybrid_cp, cp_group=cp_group)
        return batch

    import megatron.core.utils as mutils

    monkeypatch.setattr(mutils, "get_batch_on_this_cp_rank", get_batch_on_this_cp_rank)
    mcore_compat._cp_takes_is_hybrid.cache_clear()
    try:
        group = object()
        mcore_compat.batch_on_this_cp_rank(_batch(), cp_group=group)
    finally:
        mcore_compat._cp_takes_is_hybrid.cache_clear()
    assert seen == {"is_hybrid_cp": False, "cp_group": group}


def test_missing_triton_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    # what megatron-core >= 0.18 raises on a CPU build of torch
    real_import = builtins.__import__

    def fake_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "megatron.core":
            raise ModuleNotFoundError("No module named 'triton'", name="triton")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "megatron.core", raising=False)
    monkeypatch.setattr("importlib.import_module", lambda name: fake_import(name))
    with pytest.raises(ConfigError, match="pip install triton"):
        mcore_compat.import_megatron_core()


def test_mcore_version_is_a_pair_of_ints() -> None:
    major, minor = mcore_compat.mcore_version()
    assert (major, minor) >= (0, 16)


def test_cpu_torch_cuda_answers_current_stream() -> None:
    # megatron-core 0.19's start_grad_sync: torch.cuda.current_stream().wait_event(...)
    from charllm_nemo.train.cpu import _CudaOnCpu

    cuda = _CudaOnCpu()
    stream = cuda.current_stream()
    assert stream is cuda.default_stream()
    assert stream.wait_event(object()) is None
    assert stream.wait_stream(stream) is None
