"""The parallel layout a config resolves to, and the small integer maths behind it.

Framework-free: no torch, no megatron-core. :func:`charllm_nemo.train.validate.validate`
produces a :class:`ResolvedLayout`; the runtime reads it (e.g. the pipeline layout it hands to
megatron-core's ``TransformerConfig(pipeline_model_parallel_layout=...)``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ResolvedLayout:
    """The parallel layout a valid config resolves to, for one world size.

    ``layers_per_stage[i]`` is the number of transformer layers on pipeline rank ``i`` (over all
    its virtual chunks); ``layers_per_virtual_stage`` lists the ``pp * (vpp or 1)`` model chunks
    in layer order (chunk ``v`` of rank ``i`` is entry ``v * pp + i``, megatron-core's order).
    ``expert_dp`` is the data-parallel size of the expert weights: ``world / (tp * ep * pp)``.
    """

    world_size: int
    tp: int
    pp: int
    vpp: int | None
    cp: int
    ep: int
    dp: int
    expert_dp: int
    num_microbatches: int
    layers_per_stage: list[int] = field(default_factory=list)
    layers_per_virtual_stage: list[int] = field(default_factory=list)

    @property
    def uneven(self) -> bool:
        """True when the virtual stages do not all hold the same number of layers."""
        return len(set(self.layers_per_virtual_stage)) > 1

    def mcore_pipeline_layout(self) -> list[list[str]] | None:
        """megatron-core's ``pipeline_model_parallel_layout`` (list form) for an uneven layout,
        None for an even one: one list per virtual stage, ``"embedding"`` first on the first,
        ``"loss"`` last on the last, ``"decoder"`` once per transformer layer."""
        if not self.uneven:
            return None
        stages: list[list[str]] = [["decoder"] * n for n in self.layers_per_virtual_stage]
        stages[0].insert(0, "embedding")
        stages[-1].append("loss")
        return stages


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` in increasing order ([] for n < 1)."""
    if n < 1:
        return []
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def multiples(step: int, start: int = 1, count: int = 4) -> list[int]:
    first = max(step, (start // step) * step)
    return [first + i * step for i in range(count)]


def choices(values: Iterable[object]) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def alternating_layout(num_layers: int, pp: int) -> list[int]:
    """The alternating uneven scheme: stages get one layer more, one fewer, in turn, around
    ``num_layers / pp`` (an odd last stage keeps the even share). E.g. 96 layers on 8 stages:
    [13, 11, 13, 11, 13, 11, 13, 11]. Needs ``num_layers % pp == 0``."""
    base = num_layers // pp
    layout = [base + 1 if i % 2 == 0 else base - 1 for i in range(pp)]
    if pp % 2:
        layout[-1] = base
    return layout
