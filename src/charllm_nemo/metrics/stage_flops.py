"""Hardware FLOPs per pipeline stage: the work each stage's ranks do in one step.

A stage holds its layers (the model chunks ``c`` with ``c % pp == stage``, megatron-core's
interleaved order) and, on the last stage, the output layer (the logits GEMM); recomputation adds
one forward of the recomputed layers it holds. The stages' FLOPs add up to
:func:`~charllm_nemo.metrics.flops.hardware_flops_per_step`'s total. Units: FLOPs per step.
"""

from __future__ import annotations

from collections.abc import Sequence

from charllm_nemo.metrics.flops import (
    _SELECTIVE_MODULE_TERMS,
    FORWARD_BACKWARD_FACTOR,
    ModelShape,
    _forward_flops,
    _tokens,
    recomputed_layer_indices,
)


def stage_hardware_flops(
    shape: ModelShape,
    global_batch_size: int,
    layers_per_virtual_stage: Sequence[int],
    pp: int,
    recompute_granularity: str | None = None,
    recompute_method: str | None = None,
    recompute_num_layers: int | None = None,
    recompute_modules: Sequence[str] = ("core_attn",),
) -> list[float]:
    """Hardware FLOPs of each pipeline stage per step (all of its ranks together), in stage order.

    ``layers_per_virtual_stage``: the layers of each model chunk in model order (a resolved
    layout's, ``pp x (vpp or 1)`` entries)."""
    tokens = _tokens(shape, global_batch_size)
    chunks, start = [], 0
    for n in layers_per_virtual_stage:
        chunks.append(range(start, start + n))
        start += n
    layers: list[list[int]] = [[] for _ in range(pp)]
    for c, chunk in enumerate(chunks):
        layers[c % pp].extend(chunk)
    recomputed: set[int] = set()
    terms: list[str] | None = None
    if recompute_granularity == "full":
        vpp = len(chunks) // pp if len(chunks) > pp else None
        recomputed = set(
            recomputed_layer_indices(
                shape,
                recompute_method,
                recompute_num_layers,
                pipeline_parallel=pp,
                virtual_pipeline=vpp,
                pipeline_layout=list(layers_per_virtual_stage),
            )
        )
    elif recompute_granularity == "selective":
        terms = sorted({t for m in recompute_modules for t in _SELECTIVE_MODULE_TERMS.get(m, ())})
    out = []
    for s, mine in enumerate(layers):
        total = FORWARD_BACKWARD_FACTOR * _forward_flops(shape, tokens, mine, logits=s == pp - 1).total
        if recomputed:
            total += _forward_flops(shape, tokens, [i for i in mine if i in recomputed], logits=False).total
        elif terms is not None:
            total += _forward_flops(shape, tokens, mine, terms=terms, logits=False).total
        out.append(float(total))
    return out
