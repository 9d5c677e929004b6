"""``charllm train ... dry_run=true``: what a valid config would run, without running it; and
the check every GPU rank makes against the same figures before it builds the model.

For planning a job (or a sweep) from a login node: the resolved layout, the work of one step
(tokens, model and hardware FLOPs, per rank), the memory each pipeline stage's ranks need for
weights, gradients and optimizer state (``charllm_nemo.metrics.memory``) and an estimate of the
activations they keep (``charllm_nemo.metrics.activations``). Framework-free: no torch, no
process group, nothing written (:func:`check_gpu_memory` is handed the rank's torch).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from charllm_nemo.errors import ConfigError
from charllm_nemo.metrics.activations import ActivationSetup, StageActivations, stage_activations
from charllm_nemo.metrics.flops import ModelShape, hardware_flops_per_step, parameter_count
from charllm_nemo.metrics.memory import StageMemory, stage_memory
from charllm_nemo.train.config import TrainConfig, for_device
from charllm_nemo.train.layout import ResolvedLayout
from charllm_nemo.train.plan_energy import energy_lines

if TYPE_CHECKING:
    from charllm_nemo.train.dist import DistInfo

log = logging.getLogger("charllm_nemo.train")


def _si(value: float, unit: str) -> str:
    for prefix, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n / 2**10:,.1f} KiB"


def _count(n: int) -> str:
    """A parameter count: 2.797 B, 21.3 M, 53.2 k."""
    if n >= 10**9:
        return f"{n / 1e9:.3f} B"
    return f"{n / 1e6:.1f} M" if n >= 10**6 else f"{n / 1e3:.1f} k"


def plan_stage_memory(cfg: TrainConfig, layout: ResolvedLayout) -> list[StageMemory]:
    """:func:`charllm_nemo.metrics.memory.stage_memory` for a validated config (its automatic
    settings taken for ``launch.device``)."""
    cfg = for_device(cfg, cfg.launch.device)
    o, p = cfg.optim, cfg.parallel
    return stage_memory(
        ModelShape.from_model_config(cfg.model),
        tp=layout.tp,
        pp=layout.pp,
        layers_per_virtual_stage=layout.layers_per_virtual_stage,
        ep=layout.ep,
        # Megatron-Core's gradient reduction, distributed optimizer and FSDP use the
        # data-parallel group with the context-parallel ranks in it.
        dp=layout.dp * layout.cp,
        expert_dp=layout.expert_dp,
        precision=cfg.batch.precision,
        # Megatron-FSDP needs (and train/model.py turns on) the distributed optimizer.
        distributed_optimizer=o.use_distributed_optimizer or p.fsdp,
        fsdp=p.fsdp,
        # PyTorch FSDP2 reduces gradients in the parameters' dtype; the others in fp32.
        fp32_gradients=not (p.fsdp and p.fsdp_impl == "torch_fsdp2"),
    )


def layer_implementation(device: str) -> str:
    """What the model's layers will be built from, as far as this host can tell (the dry run
    plans from a login node): ``te`` for a GPU run where TransformerEngine is installed, else
    ``local`` (train/model.py ``layer_spec``; the rank itself knows: ``layers_built``)."""
    if device != "cpu" and importlib.util.find_spec("transformer_engine") is not None:
        return "te"
    return "local"


IMPLEMENTATION_TEXT = {
    "local": "megatron-core's local layers: unfused attention keeps the s x s scores",
    "te": "TransformerEngine layers: flash attention keeps no s x s scores",
}


def plan_stage_activations(
    cfg: TrainConfig, layout: ResolvedLayout, implementation: str | None = None
) -> list[StageActivations]:
    """:func:`charllm_nemo.metrics.activations.stage_activations` for a validated config:
    what each pipeline stage's ranks keep for the backward at the schedule's peak.
    ``implementation``: ``local`` or ``te`` (None: :func:`layer_implementation`)."""
    cfg = for_device(cfg, cfg.launch.device)
    m, b, o = cfg.model, cfg.batch, cfg.optim
    setup = ActivationSetup(
        micro_batch_size=b.micro_batch_size,
        precision=b.precision,
        normalization=m.normalization,
        rope=m.position_embedding == "rope",
        implementation=implementation or layer_implementation(cfg.launch.device),
        tp=layout.tp,
        cp=layout.cp,
        sequence_parallel=cfg.parallel.sequence_parallel,
        recompute_granularity=o.recompute_granularity,
        recompute_method=o.recompute_method,
        recompute_num_layers=o.recompute_num_layers,
    )
    return stage_activations(
        ModelShape.from_model_config(m),
        setup,
        pp=layout.pp,
        layers_per_virtual_stage=layout.layers_per_virtual_stage,
        num_microbatches=layout.num_microbatches,
    )


def _groups(keys: list[Any]) -> list[tuple[int, int]]:
    """Runs of equal consecutive ``keys``, as (first index, last index)."""
    runs: list[tuple[int, int]] = []
    for i, key in enumerate(keys):
        if runs and keys[runs[-1][0]] == key:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _which(first: int, last: int) -> str:
    return f"stage {first}" if first == last else f"stages {first}-{last}"


def describe_plan(cfg: TrainConfig, layout: ResolvedLayout) -> list[str]:
    """The dry run's report, one line per entry."""
    cfg = for_device(cfg, cfg.launch.device)
    m, b, o, p = cfg.model, cfg.batch, cfg.optim, cfg.parallel
    shape = ModelShape.from_model_config(m)
    params = parameter_count(shape)
    tokens = b.global_batch_size * m.seq_length
    hw = hardware_flops_per_step(
        shape,
        b.global_batch_size,
        o.recompute_granularity,
        o.recompute_method,
        o.recompute_num_layers,
        pipeline_parallel=layout.pp,
        virtual_pipeline=layout.vpp,
        pipeline_layout=layout.layers_per_virtual_stage if layout.uneven else None,
    )
    world = layout.world_size
    vpp = f" vpp={layout.vpp}" if layout.vpp else ""
    fsdp = f" fsdp={p.fsdp_impl}" if p.fsdp else ""
    expert_dp = f" expert_dp={layout.expert_dp}" if m.num_experts else ""
    active = f", {_count(params.active)} active per token" if params.active != params.total else ""
    lines = [
        f"model={m.name}: {_count(params.total)} parameters{active}; {m.num_layers} layers, "
        f"hidden {m.hidden_size}, seq {m.seq_length}",
        f"layout: world={world} tp={layout.tp} pp={layout.pp}{vpp} cp={layout.cp} ep={layout.ep} "
        f"dp={layout.dp}{expert_dp}{fsdp}; layers/stage={layout.layers_per_stage}",
        f"step: {b.global_batch_size} sequences = {tokens:,} tokens, {layout.num_microbatches} "
        f"microbatch(es) of {b.micro_batch_size} per data-parallel rank, precision {b.precision}",
        f"FLOPs per step: model {_si(hw.model.total, 'FLOP')} "
        f"({_si(hw.model.total / world, 'FLOP')} per rank), "
        + (
            f"hardware {_si(hw.total, 'FLOP')} with recomputation (x{hw.recompute_overhead:.3f})"
            if hw.recompute.total
            else "no recomputation"
        ),
    ]
    lines += energy_lines(cfg, layout)
    stages = plan_stage_memory(cfg, layout)
    sharded = "FSDP" if p.fsdp else ("distributed optimizer" if o.use_distributed_optimizer else "")
    over = f"dp*cp={layout.dp * layout.cp}" if layout.cp > 1 else f"dp={layout.dp}"
    if m.num_experts:
        over += f", experts over expert_dp={layout.expert_dp}"
    lines.append(
        "memory per rank for weights, gradients and optimizer state"
        + (f" ({sharded}: split over {over})" if sharded else "")
        + ":"
    )
    for first, last in _groups([(s.layers, s.parameters, s.total_bytes) for s in stages]):
        s = stages[first]
        experts = f" ({_count(s.expert_parameters)} in experts)" if s.expert_parameters else ""
        lines.append(
            f"  {_which(first, last)}: {s.layers} layers, {_count(s.parameters)} parameters{experts}: "
            f"{_bytes(s.total_bytes)} (weights {_bytes(s.weight_bytes)}, "
            f"gradients {_bytes(s.gradient_bytes)}, optimizer {_bytes(s.optimizer_bytes)})"
        )
    implementation = layer_implementation(cfg.launch.device)
    acts = plan_stage_activations(cfg, layout, implementation)
    recompute = f"recompute {o.recompute_granularity}" if o.recompute_granularity else "no recomputation"
    hint = ""
    if implementation == "local" and cfg.launch.device != "cpu":
        hint = "; TransformerEngine is not importable here"
    lines.append(
        f"activations kept for the backward (estimate; {IMPLEMENTATION_TEXT[implementation]}{hint}; "
        f"{recompute}) and the peak with the state above:"
    )
    for first, last in _groups(
        [(a.in_flight, a.total_bytes, s.total_bytes) for a, s in zip(acts, stages, strict=True)]
    ):
        a = acts[first]
        lines.append(
            f"  {_which(first, last)}: {a.in_flight} microbatch(es) in flight: "
            f"{_bytes(a.total_bytes)}; peak {_bytes(a.total_bytes + stages[first].total_bytes)}"
        )
    top = max(range(len(stages)), key=lambda i: acts[i].total_bytes + stages[i].total_bytes)
    options = recompute_estimates(cfg, layout, implementation, top)
    if options:
        lines.append(
            f"  the highest peak, stage {top}'s, "
            + "; ".join(f"with {text}: {_bytes(stages[top].total_bytes + b)}" for text, b in options)
        )
    if hint:  # planned from a host without TE for GPU nodes that may well have it
        te_acts = plan_stage_activations(cfg, layout, "te")
        te = [a.total_bytes + s.total_bytes for a, s in zip(te_acts, stages, strict=True)]
        k = max(range(len(te)), key=te.__getitem__)
        lines.append(
            f"  with TransformerEngine layers instead (GPU nodes that have it): the highest peak, "
            f"stage {k}'s, {_bytes(te[k])}"
        )
    return lines


TIGHT_SHARE = 0.9
"""A rank whose weights, gradients and optimizer state take more than this share of its GPU's
free memory is warned about when its activations are not estimated: they come on top."""

ACTIVATION_FIXES = (
    "activation recomputation (optim=recompute, or optim.recompute_granularity=selective), a "
    "smaller batch.micro_batch_size, or more tensor / pipeline parallelism (parallel.tp, parallel.pp)"
)

RECOMPUTE_OPTIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("optim.recompute_granularity=selective", {"recompute_granularity": "selective"}),
    (
        "optim=recompute",  # conf/optim/recompute.yaml: full, uniform, one layer a checkpoint
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    ),
)
"""The recomputation settings whose peak the dry run and the memory warning estimate, as (how to
ask for it, the ``optim`` fields it sets; ``recompute_method`` / ``recompute_num_layers`` None
where not set)."""


def recompute_estimates(
    cfg: TrainConfig, layout: ResolvedLayout, implementation: str, stage: int
) -> list[tuple[str, int]]:
    """Pipeline stage ``stage``'s estimated activations under each of :data:`RECOMPUTE_OPTIONS`
    that keeps less than ``cfg``'s own setting, as (how to ask for it, bytes)."""
    now = plan_stage_activations(cfg, layout, implementation)[stage].total_bytes
    out = []
    for text, fields in RECOMPUTE_OPTIONS:
        optim = replace(cfg.optim, **{"recompute_method": None, "recompute_num_layers": None, **fields})
        acts = plan_stage_activations(replace(cfg, optim=optim), layout, implementation)[stage].total_bytes
        if acts < now:
            out.append((text, acts))
    return out


@dataclass(frozen=True)
class RankMemory:
    """One rank's need (its stage's weights, gradients and optimizer state), its GPU's free and
    total memory at start, and the activations its stage keeps at the schedule's peak
    (estimated, :func:`plan_stage_activations`), in bytes; None where the rank could not tell."""

    rank: int
    stage: int
    need: int | None
    free: int | None
    total: int | None
    activations: int | None = None


def memory_verdict(
    ranks: list[RankMemory],
    distributed_optimizer: bool = False,
    alternatives: Callable[[int], list[tuple[str, int]]] | None = None,
) -> tuple[str | None, str | None]:
    """(error, warning) for a run whose ranks reported ``ranks`` (every rank gets the same
    list, so every rank reaches the same verdict). The error names the rank short by the most:
    its GPU cannot hold even its stage's weights, gradients and optimizer state (a certainty, so
    the run stops). The warning names the tightest rank whose estimated peak (that state plus
    its activations) exceeds its free memory (an estimate, so the run goes on), or, where the
    activations are unknown, whose state alone takes over ``TIGHT_SHARE`` of it.
    ``distributed_optimizer``: it is on already (not suggested then). ``alternatives(stage)``:
    the stage's activations under other recomputation settings (:func:`recompute_estimates`),
    each quoted in the warning with the peak it would give."""
    known = [(r, r.need, r.free) for r in ranks if r.need is not None and r.free is not None]
    if not known:
        return None, None
    worst, need, free = max(known, key=lambda k: k[1] - k[2])
    if need > free:
        total = f" of {_bytes(worst.total)}" if worst.total is not None else ""
        short = sum(1 for _, n, f in known if n > f)
        ways = (
            []
            if distributed_optimizer
            else ["the distributed optimizer (optim.use_distributed_optimizer=true)"]
        )
        ways += ["more pipeline stages (parallel.pp) or tensor parallelism (parallel.tp)", "more GPUs"]
        return (
            f"rank {worst.rank} (pipeline stage {worst.stage}) needs at least {_bytes(need)} for its "
            f"weights, gradients and optimizer state before any activation, but its GPU has "
            f"{_bytes(free)} free{total} ({short} rank(s) short; `dry_run=true` prints the plan per "
            f"stage). Use {', '.join(ways)}"
        ), None
    tight, need, free = max(known, key=lambda k: (k[1] + (k[0].activations or 0)) / max(k[2], 1))
    if tight.activations is not None and need + tight.activations > free:
        over = sum(1 for r, n, f in known if r.activations is not None and n + r.activations > f)
        options = alternatives(tight.stage) if alternatives is not None else []
        estimates = "; ".join(
            f"with {text}: {_bytes(need + acts)}{' (fits)' if need + acts <= free else ''}"
            for text, acts in options
        )
        return None, (
            f"rank {tight.rank} (pipeline stage {tight.stage}) will likely run out of memory: its "
            f"estimated peak is {_bytes(need + tight.activations)} ({_bytes(need)} of weights, "
            f"gradients and optimizer state, {_bytes(tight.activations)} of activations), its GPU "
            f"has {_bytes(free)} free ({over} rank(s) over; `dry_run=true` prints the estimate per "
            f"stage). Use {ACTIVATION_FIXES}" + (f". Its estimated peak {estimates}" if estimates else "")
        )
    if tight.activations is None and need > TIGHT_SHARE * free:
        return None, (
            f"rank {tight.rank} (pipeline stage {tight.stage}): weights, gradients and optimizer "
            f"state take {_bytes(need)} of its GPU's {_bytes(free)} free; activations may not fit"
        )
    return None, None


def check_gpu_memory(
    cfg: TrainConfig, layout: ResolvedLayout, dist: DistInfo, torch: Any, implementation: str = "local"
) -> None:
    """Before the model is built (GPU): every rank gathers every rank's need (its stage's
    weights, gradients and optimizer state, train/plan.py), its stage's estimated activations
    (built from ``implementation``'s layers: ``local`` or ``te``) and its GPU's free memory. When
    a GPU cannot hold even the state, every rank raises the same ConfigError at once, instead of
    that rank running out of memory minutes later while the others wait for it in a collective;
    when the estimated peak does not fit, rank 0 warns. A rank that cannot tell (an error here)
    reports nothing and takes part all the same."""
    need = free = total = activations = None
    try:
        need = plan_stage_memory(cfg, layout)[dist.pp_rank].total_bytes
        activations = plan_stage_activations(cfg, layout, implementation)[dist.pp_rank].total_bytes
    except Exception:  # the check must not be what stops a run
        log.debug("GPU memory check: this rank cannot tell its plan", exc_info=True)
    try:
        free, total = (int(v) for v in torch.cuda.mem_get_info())
    except Exception:
        log.debug("GPU memory check: this rank cannot tell its free memory", exc_info=True)
    ranks: list[Any] = [None] * dist.world_size
    mine = RankMemory(dist.rank, dist.pp_rank, need, free, total, activations)
    torch.distributed.all_gather_object(ranks, mine)
    error, warning = memory_verdict(
        [r for r in ranks if isinstance(r, RankMemory)],
        distributed_optimizer=bool(cfg.optim.use_distributed_optimizer) or cfg.parallel.fsdp,
        alternatives=lambda stage: _quietly(recompute_estimates, cfg, layout, implementation, stage),
    )
    if error:
        raise ConfigError(error)
    if warning and dist.rank == 0:
        log.warning(warning)


def _quietly(fn: Callable[..., list[Any]], *args: Any) -> list[Any]:
    """``fn(*args)``, or [] when it raises: advice must not be what stops a run."""
    try:
        return fn(*args)
    except Exception:
        log.debug("GPU memory check: no advice", exc_info=True)
        return []


RANK_PROCESS_FLOOR_BYTES = 256 * 2**20
"""What a CPU rank's process takes before any model: Python with torch and megatron-core imported
held 288 MiB of private (unshared) memory here; the check counts 256 MiB."""


def cpu_memory_problem(
    cfg: TrainConfig, layout: ResolvedLayout, local_ranks: int, memory: int | None
) -> str | None:
    """A run that cannot fit this host's memory on CPU (a preset meant for GPUs, far too many
    ranks, or a micro batch or sequence far too large), told before anything is allocated: the
    weights, gradients and optimizer state of the stages of ``local_ranks`` ranks (the same
    per-stage plan as the dry run and the GPU check; on CPU fp32, 16 bytes a parameter), their
    estimated activations (megatron-core's local layers: :func:`plan_stage_activations`, which
    came to 0.98-0.99 of what the CPU ranks really kept) and :data:`RANK_PROCESS_FLOOR_BYTES` per
    rank for the process itself, against ``memory`` bytes. ``local_ranks`` equal to the world:
    every rank on this host; fewer: the lightest stage's ranks. Buffers and the allocator are not
    counted, so it refuses no run that fits."""
    if memory is None:
        return None
    try:
        stages = plan_stage_memory(cfg, layout)
        acts = plan_stage_activations(cfg, layout, "local")
    except (ValueError, TypeError):
        return None
    per_stage = [(s.total_bytes, a.total_bytes) for s, a in zip(stages, acts, strict=True)]
    if local_ranks >= layout.world_size:
        ranks_per_stage = layout.world_size // layout.pp
        state = ranks_per_stage * sum(st for st, _ in per_stage)
        activations = ranks_per_stage * sum(a for _, a in per_stage)
    else:
        lightest = min(per_stage, key=sum)
        state, activations = local_ranks * lightest[0], local_ranks * lightest[1]
    floor = local_ranks * RANK_PROCESS_FLOOR_BYTES
    need = state + activations + floor
    if need <= memory:
        return None
    params = sum(s.parameters for s in stages)  # one replica: the model (its 2-D weights)
    return (
        f"model={cfg.model.name} on CPU needs at least {_bytes(need)} for {local_ranks} rank(s) "
        f"on this host: {_bytes(state)} of weights, fp32 gradients and Adam's two moments (the model "
        f"has {_count(params)} parameters), {_bytes(activations)} of activations for "
        f"batch.micro_batch_size={cfg.batch.micro_batch_size} and model.seq_length="
        f"{cfg.model.seq_length} (estimated; `dry_run=true` prints both per stage) and "
        f"{_bytes(RANK_PROCESS_FLOOR_BYTES)} per rank for Python, torch and megatron-core; this host "
        f"has {_bytes(memory)}: train a small model, a smaller micro batch or sequence, or fewer "
        "ranks, on a CPU (model=tiny_gpt or tiny_moe, launch.nproc), or run on GPUs "
        "(launch.device=cuda)"
    )


def peak_memory(torch: Any, on_cpu: bool) -> tuple[str, int | None]:
    """This rank's peak memory so far and what measured it: ``cuda_max_allocated`` (the
    caching allocator's peak of tensors allocated on the rank's GPU) or, on CPU, ``max_rss``
    (the process's peak resident set: Python, torch and its libraries included)."""
    if not on_cpu:
        try:
            return "cuda_max_allocated", int(torch.cuda.max_memory_allocated())
        except Exception:  # a figure, never a reason to fail
            return "cuda_max_allocated", None
    import resource

    return "max_rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def memory_report(
    measure: str, ranks: list[tuple[int | None, int | None, int, int | None]]
) -> dict[str, Any]:
    """``summary.json``'s ``memory`` from every rank's (peak, plan, pipeline stage, activations):
    the peaks (``measure``) beside each rank's planned weights, gradients and optimizer state
    (the lower bound the dry run prints) and its stage's estimated activations, indexed by rank."""
    return {
        "measure": measure,
        "peak_bytes": [peak for peak, _, _, _ in ranks],
        "plan_bytes": [plan for _, plan, _, _ in ranks],
        "activation_bytes": [act for _, _, _, act in ranks],
        "pp_stage": [stage for _, _, stage, _ in ranks],
    }


def memory_line(report: dict[str, Any]) -> str | None:
    """Rank 0's closing line about memory: the rank with the highest peak, and its plan."""
    known = [(peak, rank) for rank, peak in enumerate(report["peak_bytes"]) if peak is not None]
    if not known:
        return None
    peak, rank = max(known)
    plan = report["plan_bytes"][rank]
    acts = report.get("activation_bytes", [None] * len(report["peak_bytes"]))[rank]
    planned = f"; its stage's weights, gradients and optimizer state: {_bytes(plan)}" if plan else ""
    if plan and acts:
        planned += f", activations (estimated): {_bytes(acts)}, together {_bytes(plan + acts)}"
    where = f"rank {rank} (pipeline stage {report['pp_stage'][rank]})"
    return f"memory: peak {_bytes(peak)} ({report['measure']}) on {where}{planned}"
