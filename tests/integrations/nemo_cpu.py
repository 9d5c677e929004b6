"""Test support: NeMo 2.7.3 (nemo.collections.llm) training on a CPU.

NeMo and megatron-core are written for CUDA. Everything here exists so that the real
``nl.Trainer`` + ``MegatronStrategy`` + ``llm.GPTModel`` path runs on CI's CPUs; none of it is in
the callback (charllm_nemo.integrations.nemo), which runs unchanged on a GPU. The megatron-core
CPU layer is the trainer's own (charllm_nemo.train.cpu); what NeMo itself needs on top:

* ``nemo.lightning.megatron_parallel`` builds DDP inside ``torch.cuda.stream(torch.cuda.Stream())``;
  ``megatron_init._set_random_seed`` adds the model-parallel RNG state only when
  ``torch.cuda.device_count() > 0``: those modules see a ``torch`` whose ``cuda`` has one "device",
  a no-op stream and the CPU RNG.
* The strategy and the data sampler log scalars through
  ``torch.tensor(x, pin_memory=True).to("cuda", non_blocking=True)``: while :func:`enable` is in
  effect, pinned CPU tensors are plain ones and ``Tensor.to("cuda")`` stays on the CPU (a Tensor
  method cannot be shimmed per module; this process is a test).
* ``gpt_data_step`` calls ``.cuda()`` on the batch: the model config gets :func:`cpu_data_step`.
* NeMo 2.7.3 passes ``no_weight_decay_cond`` / ``scale_lr_cond`` / ``lr_mult`` to megatron-core's
  ``get_megatron_optimizer``, which 0.16 removed (a TypeError on a GPU too):
  :func:`drop_removed_optimizer_kwargs` passes only what the installed signature takes.
* ``MockDataModule.setup`` passes ``create_attention_mask`` positionally into the dataset's
  ``seed``, so no mask is built; without TransformerEngine the local attention needs one:
  :class:`MaskedMockDataModule`.
* The default tokenizer downloads: :class:`ByteTokenizer` is a local stand-in.
* NeMo-Run writes to ``~/.nemo_run`` unless ``NEMORUN_HOME`` is set: tests set it to a tmp dir.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from typing import Any

import torch

from charllm_nemo.train import cpu as mcore_cpu

VOCAB = 256


class _CudaForNemo(mcore_cpu._CudaOnCpu):
    """``torch.cuda`` as NeMo's CUDA-only modules see it on a CPU run."""

    @staticmethod
    def device_count() -> int:
        return 1  # so that NeMo seeds the model-parallel RNG tracker (the CPU one)

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> Any:
        return mcore_cpu._CPU_STREAM

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class _TorchForNemo(mcore_cpu._TorchOnCpu):
    def __init__(self) -> None:
        super().__init__()
        self.cuda = _CudaForNemo()


NEMO_SHIMMED = (
    "nemo.lightning.megatron_parallel",
    "nemo.lightning.megatron_init",
)

_enabled = False


def drop_removed_optimizer_kwargs() -> None:
    """Make NeMo's call of ``get_megatron_optimizer`` pass only the keywords the installed
    megatron-core accepts (0.16 removed ``no_weight_decay_cond``, ``scale_lr_cond``, ``lr_mult``).
    Needed on a GPU as well; idempotent."""
    # nemo.lightning._strategy_lib imports it inside setup_megatron_optimizer, from the package
    from megatron.core import optimizer as moptimizer

    orig = moptimizer.get_megatron_optimizer
    if getattr(orig, "_charllm", False):
        return
    accepted = set(inspect.signature(orig).parameters)

    def get_megatron_optimizer(*args: Any, **kwargs: Any) -> Any:
        return orig(*args, **{k: v for k, v in kwargs.items() if k in accepted})

    get_megatron_optimizer._charllm = True  # type: ignore[attr-defined]
    moptimizer.get_megatron_optimizer = get_megatron_optimizer


def enable(tmp_home: str | None = None) -> None:
    """Everything above (idempotent). ``tmp_home``: NEMORUN_HOME for NeMo-Run."""
    global _enabled
    if tmp_home is not None:
        os.environ["NEMORUN_HOME"] = tmp_home
    if _enabled:
        return
    import importlib

    mcore_cpu.enable_cpu_support()
    shim = _TorchForNemo()
    for name in NEMO_SHIMMED:
        importlib.import_module(name).torch = shim  # type: ignore[attr-defined]
    drop_removed_optimizer_kwargs()

    orig_to = torch.Tensor.to
    orig_tensor = torch.tensor

    def is_cuda(device: Any) -> bool:  # (not an int: .to(other, non_blocking) passes a bool)
        return isinstance(device, (str, torch.device)) and mcore_cpu._is_cuda_device(device)

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        args = tuple("cpu" if is_cuda(a) else a for a in args)
        if is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return orig_to(self, *args, **kwargs)

    def tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("pin_memory", None)
        return orig_tensor(*args, **kwargs)

    torch.Tensor.to = to  # type: ignore[method-assign, assignment]
    torch.tensor = tensor  # type: ignore[assignment]
    _enabled = True


def cpu_data_step(dataloader_iter: Iterator[Any]) -> dict[str, torch.Tensor]:
    """NeMo's ``gpt_data_step`` for one pipeline stage, without ``.cuda()``."""
    batch = next(dataloader_iter)
    if isinstance(batch, tuple) and len(batch) == 3:
        batch = batch[0]
    keys = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
    return {k: batch[k] for k in keys if k in batch}


class ByteTokenizer:
    """A 256-token stand-in for NeMo's tokenizers (the default one downloads)."""

    vocab_size = VOCAB
    eos_id = 0
    bos_id = 1
    pad_id = 0

    def text_to_ids(self, text: str) -> list[int]:
        return list(text.encode())


def masked_mock_data_module(**kwargs: Any) -> Any:
    """A NeMo ``MockDataModule`` whose datasets carry the causal mask (see the module doc)."""
    return MaskedMockDataModule(**kwargs)


def _masked_module_class() -> type:
    from nemo.collections.llm.gpt.data.mock import MockDataModule, _MockGPTDataset

    class _MaskedMockDataModule(MockDataModule):  # type: ignore[misc]
        def setup(self, stage: str = "") -> None:
            def ds(name: str, n: int) -> Any:
                return _MockGPTDataset(self.tokenizer, name, n, self.seq_length, create_attention_mask=True)

            self._train_ds = ds("train", self.num_train_samples)
            self._validation_ds = ds("valid", self.num_val_samples)
            self._test_ds = ds("test", self.num_test_samples)

    return _MaskedMockDataModule


class MaskedMockDataModule:
    """Factory with the class's name for Fiddle configs: ``MaskedMockDataModule(**kw)`` builds
    the ``MockDataModule`` subclass (NeMo is imported only when it is called)."""

    def __new__(cls, **kwargs: Any) -> Any:  # type: ignore[misc]
        kwargs.setdefault("num_workers", 0)
        kwargs.setdefault("pin_memory", False)
        kwargs.setdefault("tokenizer", ByteTokenizer())
        return _masked_module_class()(**kwargs)


def cpu_model_overrides() -> dict[str, Any]:
    """NeMo ``GPTConfig`` fields a CPU run sets (fp32, no fusions, local attention's mask)."""
    return {
        "use_cpu_initialization": True,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "gradient_accumulation_fusion": False,
        "batch_p2p_comm": False,
        "data_step_fn": cpu_data_step,
        "bf16": False,
        "fp16": False,
        "params_dtype": torch.float32,
        "pipeline_dtype": torch.float32,
    }


def tiny_gpt_config(**overrides: Any) -> Any:
    """A 2-layer Llama-style ``llm.GPTConfig`` for the CPU (vocab 256, seq 32)."""
    from nemo.collections import llm

    kw: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        seq_length=32,
        vocab_size=VOCAB,
        make_vocab_size_divisible_by=1,
        share_embeddings_and_output_weights=False,
    )
    kw.update(cpu_model_overrides())
    kw.update(overrides)
    return llm.GPTConfig(**kw)


def tiny_mixtral_config(**overrides: Any) -> Any:
    """A 2-layer, 4-expert ``llm.MixtralConfig`` for the CPU (allgather dispatcher, no bias)."""
    from nemo.collections import llm

    kw: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=32,
        max_position_embeddings=32,
        vocab_size=VOCAB,
        make_vocab_size_divisible_by=1,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        add_bias_linear=False,
        share_embeddings_and_output_weights=False,
    )
    kw.update(cpu_model_overrides())
    kw.update(overrides)
    return llm.MixtralConfig(**kw)


def cpu_strategy(**overrides: Any) -> Any:
    """``nl.MegatronStrategy`` for one CPU process (gloo, fp32, no distributed optimizer)."""
    from nemo import lightning as nl

    kw: dict[str, Any] = dict(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        ckpt_load_optimizer=False,
        ckpt_save_optimizer=False,
        process_group_backend="gloo",
        ckpt_async_save=False,  # its IO imports tensorstore (not installed)
    )
    kw.update(overrides)
    return nl.MegatronStrategy(**kw)


def cpu_optimizer(lr: float = 1e-3) -> Any:
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl

    return nl.MegatronOptimizerModule(
        config=OptimizerConfig(
            optimizer="adam", lr=lr, use_distributed_optimizer=False, bf16=False, fp16=False
        )
    )
