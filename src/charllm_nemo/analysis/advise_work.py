"""The work each pipeline stage holds, counted as the FLOP model counts it
(:mod:`charllm_nemo.metrics.flops`, docs/flops.md): its transformer layers (forward + backward,
plus what activation recomputation reruns), the output layer's logits GEMM on the last stage,
and the embedding lookup (first stage) and the loss (last stage), which are not GEMMs and count
0 FLOPs there as in Megatron-LM's count. The unit is one layer's model FLOPs, so a stage's time
per unit of work is its time per layer when nothing else differs."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class WorkModel:
    """Per-stage work in units of one layer's model FLOPs (forward + backward).

    ``head``: the output layer's logits GEMM (forward + backward), last stage only.
    ``recompute``: the FLOPs a recomputed layer adds (its forward again, or the selective
    modules' part of it), in layers; ``recompute_first``: only the first this many layers of
    each stage are recomputed (Megatron-Core's ``block`` method), None: every layer."""

    head: float = 0.0
    recompute: float = 0.0
    recompute_first: int | None = None
    known: bool = False

    def stage(self, index: int, layers: int, stages: int) -> float:
        """The work of stage ``index`` (of ``stages``) holding ``layers`` layers."""
        redone = layers if self.recompute_first is None else min(layers, self.recompute_first)
        return layers + redone * self.recompute + (self.head if index == stages - 1 else 0.0)

    def stages(self, layers: list[int]) -> list[float]:
        """The work of every stage of ``layers`` (layers per stage)."""
        return [self.stage(i, n, len(layers)) for i, n in enumerate(layers)]

    def describe(self) -> str:
        """One evidence line: how the work was counted."""
        if not self.known:
            return (
                "the work per stage counts layers only (no model shape in the config): the output "
                "layer, embedding and loss are not counted"
            )
        parts = [f"the last stage's output layer (logits GEMM) counted as {self.head:.2f} layers of work"]
        if self.recompute:
            which = (
                "every layer"
                if self.recompute_first is None
                else f"the first {self.recompute_first} of each stage"
            )
            parts.append(f"recomputation adds {self.recompute:.2f} layer(s) of work to {which}")
        parts.append(
            "the embedding lookup (first stage) and the loss (last stage) are not GEMMs: 0 FLOPs, "
            "as the FLOP model counts them"
        )
        return "; ".join(parts)


def work_model(config: dict[str, Any]) -> WorkModel:
    """The run's :class:`WorkModel` from its config (``model`` and ``optim``); layers only
    (``known`` False) when the config does not give the model's shape."""
    from charllm_nemo.errors import ConfigError
    from charllm_nemo.metrics.flops import ModelShape, hardware_flops_per_step
    from charllm_nemo.train.config import ModelConfig

    model = config.get("model")
    if not isinstance(model, dict):
        return WorkModel()
    names = {f.name for f in fields(ModelConfig)}
    optim = config.get("optim") if isinstance(config.get("optim"), dict) else {}
    assert isinstance(optim, dict)
    granularity = optim.get("recompute_granularity")
    method = optim.get("recompute_method")
    first = optim.get("recompute_num_layers")
    try:
        shape = ModelShape.from_model_config(ModelConfig(**{k: v for k, v in model.items() if k in names}))
        modules = optim.get("recompute_modules")
        hw = hardware_flops_per_step(
            shape,
            1,
            granularity if granularity in ("full", "selective") else None,
            method if granularity == "full" else None,
            first if granularity == "full" else None,
            recompute_modules=tuple(modules) if isinstance(modules, list) and modules else ("core_attn",),
        )
    except (ConfigError, TypeError, ValueError):  # an odd config: layers only, said in the evidence
        return WorkModel()
    flops = hw.model
    layer = (flops.total - flops.logits) / shape.num_layers if shape.num_layers > 0 else 0.0
    if layer <= 0:
        return WorkModel()
    per_redone = 0.0
    block = None
    if hw.recompute.total:
        redone = hw.recomputed_layers if granularity == "full" else shape.num_layers
        per_redone = hw.recompute.total / max(1, redone) / layer
        if granularity == "full" and method == "block" and isinstance(first, int):
            block = first
    return WorkModel(head=flops.logits / layer, recompute=per_redone, recompute_first=block, known=True)
