"""Validate a TrainConfig before any process group exists, and resolve its parallel layout.

Every rule here mirrors a check that megatron-core 0.16 (or Megatron-LM's ``validate_args``,
which the pinned megatron-core's own trainers follow) would otherwise make only after the
process groups are up, or would trip over as an assertion deep in model construction:

* layout: ``world_size % (tp * pp * cp) == 0``, ``dp = world_size / (tp * pp * cp)``
  (``parallel_state.initialize_model_parallel``). Expert parallelism is carved out of the
  data-parallel x context-parallel ranks: megatron-core builds a second rank grid
  ``tp_expert x ep x dp_expert x pp`` over the same world, with the expert tensor-parallel size
  equal to ``tp`` (this trainer does not set it apart), so ``world_size % (tp * ep * pp) == 0``,
  i.e. ``ep`` must divide ``dp * cp``; and ``num_experts % ep == 0`` (``MoELayer``).
* tensor parallelism: attention heads, FFN width and vocabulary split across ``tp`` ranks
  (``divide()`` in the parallel linear layers and ``VocabParallelEmbedding``); KV groups must be a
  multiple *or a divisor* of ``tp`` (``TransformerConfig``: fewer groups than TP ranks are
  replicated); sequence parallelism needs ``tp > 1`` (``ModelParallelConfig``).
* pipeline: layers split evenly over ``pp`` stages and over ``vpp`` chunks per stage
  (``get_num_layers_to_build``), ``vpp`` needs ``pp > 1``; an uneven layout is given per stage
  and becomes megatron-core's ``pipeline_model_parallel_layout``; with interleaving the number
  of microbatches must be a multiple of ``pp`` (``microbatch_group_size_per_vp_stage`` defaults
  to ``pp`` in the interleaved schedule).
* batch: ``global_batch_size % (micro_batch_size * dp) == 0``; with CP the sequence splits into
  ``2 * cp`` chunks (load-balanced causal attention).
* recomputation (``TransformerConfig``): ``full`` needs a method (block | uniform) and a layer
  count between 1 and the layers of a (virtual) stage; ``selective`` takes neither.
* FSDP: PyTorch FSDP2 (``TorchFullyShardedDataParallel``) supports neither pipeline nor expert
  parallelism, nor the distributed optimizer, and needs untied embeddings; Megatron-FSDP
  (``use_megatron_fsdp``) composes with TP, CP, EP and PP.
* telemetry, launch, data and CPU limits: train/validate_run.py.
* the preset names, the model's shape and the optimizer's settings: train/validate_model.py
  (:class:`~charllm_nemo.train.validate_model.ModelChecks`, which the checker here extends).

All problems are collected and raised as one :class:`ConfigProblems` (a ``ConfigError``) whose
message lists each: the field(s), the value and a valid alternative.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from charllm_nemo.errors import ConfigError
from charllm_nemo.train.config import TrainConfig, for_device
from charllm_nemo.train.launch import resolve_device
from charllm_nemo.train.layout import ResolvedLayout, alternating_layout, choices, divisors, multiples
from charllm_nemo.train.plan import cpu_memory_problem
from charllm_nemo.train.presets import MODEL_PRESETS
from charllm_nemo.train.validate_model import (
    NORMALIZATIONS,
    POSITION_EMBEDDINGS,
    PRECISIONS,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    TOKEN_DISPATCHERS,
    ModelChecks,
)
from charllm_nemo.train.validate_run import cpu_problems, host_memory_bytes, run_problems

__all__ = [
    "FSDP_IMPLS",
    "NORMALIZATIONS",
    "PIPELINE_SCHEMES",
    "POSITION_EMBEDDINGS",
    "PRECISIONS",
    "RECOMPUTE_GRANULARITIES",
    "RECOMPUTE_METHODS",
    "TOKEN_DISPATCHERS",
    "ConfigProblems",
    "ResolvedLayout",
    "alternating_layout",
    "cpu_problems",
    "divisors",
    "resolve_device",
    "validate",
]

PIPELINE_SCHEMES = ("alternating",)
FSDP_IMPLS = ("megatron_fsdp", "torch_fsdp2")


class ConfigProblems(ConfigError):
    """Every problem found in one config; ``problems`` holds one message per problem."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems: list[str] = list(problems)
        n = len(self.problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid training config ({n} problem{'s' if n != 1 else ''}):\n{lines}")


def _world_size(cfg: TrainConfig, world_size: int | None) -> int:
    if world_size is not None:
        return world_size
    p = cfg.parallel
    if p.dp is not None:
        return p.dp * p.tp * p.pp * p.cp
    return cfg.launch.nproc


class _Checker(ModelChecks):
    """The per-parallelism checks, beside the model's (train/validate_model.py)."""

    # -- parallel layout -----------------------------------------------------------------------

    def parallel_basics(self) -> bool:
        p = self.cfg.parallel
        ok = all(
            [
                self.positive("parallel.tp", p.tp),
                self.positive("parallel.pp", p.pp),
                self.positive("parallel.cp", p.cp),
                self.positive("parallel.ep", p.ep),
                self.positive("parallel.vpp", p.vpp, allow_none=True),
                self.positive("parallel.dp", p.dp, allow_none=True),
            ]
        )
        self.one_of("parallel.fsdp_impl", p.fsdp_impl, FSDP_IMPLS)
        self.one_of(
            "parallel.pipeline_layout_scheme", p.pipeline_layout_scheme, PIPELINE_SCHEMES, none_ok=True
        )
        if self.world < 1:
            if self.world != self.cfg.launch.nproc:  # (launch.nproc itself: run_problems says it)
                self.add(f"world_size={self.world} must be >= 1; set launch.nproc (or the srun task count)")
            ok = False
        return ok

    def world_layout(self) -> int | None:
        """Data-parallel size, or None when the layout does not fit the world size."""
        p = self.cfg.parallel
        model_size = p.tp * p.pp * p.cp
        if self.world % model_size:
            fitting = [f"{n}" for n in multiples(model_size, start=self.world)]
            self.add(
                f"world_size={self.world} is not divisible by parallel.tp*pp*cp={model_size} "
                f"(tp={p.tp}, pp={p.pp}, cp={p.cp}); run on a multiple of {model_size} ranks "
                f"(launch.nproc in {choices(fitting)}) or pick tp*pp*cp in {choices(divisors(self.world))}"
            )
            return None
        dp = self.world // model_size
        if p.dp is not None and p.dp != dp:
            self.add(
                f"parallel.dp={p.dp} does not match world_size={self.world} / (tp*pp*cp={model_size}) = "
                f"{dp}; set parallel.dp=null (derived) or run on {p.dp * model_size} ranks"
            )
        return dp

    def experts(self, dp: int | None) -> None:
        p, m = self.cfg.parallel, self.cfg.model
        if p.ep == 1:
            return
        if m.num_experts is None:
            moe = [n for n, v in MODEL_PRESETS.items() if v.num_experts]
            self.add(
                f"parallel.ep={p.ep} needs a mixture-of-experts model but model.num_experts is null; "
                f"use parallel.ep=1 or an MoE model ({', '.join(moe)})"
            )
            return
        if m.num_experts % p.ep:
            self.add(
                f"parallel.ep={p.ep} does not divide model.num_experts={m.num_experts}; use ep in "
                f"{choices(divisors(m.num_experts))}"
            )
        if dp is not None and (dp * p.cp) % p.ep:
            # megatron-core: world % (expert_tp * ep * pp) == 0 with expert_tp = tp.
            ok_ep = [e for e in divisors(dp * p.cp) if m.num_experts % e == 0]
            self.add(
                f"parallel.ep={p.ep} does not divide dp*cp={dp * p.cp} (dp={dp} derived from world_size="
                f"{self.world} / (tp*pp*cp={p.tp * p.pp * p.cp})): expert parallel groups are carved "
                f"from the data- and context-parallel ranks; use ep in {choices(ok_ep)} or a world size "
                f"that makes dp*cp a multiple of {p.ep} (launch.nproc in "
                f"{choices(multiples(math.lcm(p.tp * p.pp * p.cp, p.tp * p.pp * p.ep), start=self.world))})"
            )

    def tensor(self) -> None:
        p, m = self.cfg.parallel, self.cfg.model
        tp = p.tp
        if m.num_attention_heads % tp:
            self.add(
                f"model.num_attention_heads={m.num_attention_heads} is not divisible by parallel.tp={tp}; "
                f"use tp in {choices(divisors(m.num_attention_heads))}"
            )
        g = m.num_query_groups
        if g is not None and g % tp and tp % g:
            ok_tp = [t for t in divisors(m.num_attention_heads) if g % t == 0 or t % g == 0]
            self.add(
                f"model.num_query_groups={g} is neither a multiple nor a divisor of parallel.tp={tp}; "
                f"use tp in {choices(ok_tp)}"
            )
        for name, value in (
            ("model.ffn_hidden_size", m.ffn_hidden_size),
            ("model.vocab_size", m.vocab_size),
            ("model.moe_ffn_hidden_size", m.moe_ffn_hidden_size if m.num_experts else None),
        ):
            if value is not None and value % tp:
                self.add(
                    f"{name}={value} is not divisible by parallel.tp={tp}; use tp in "
                    f"{choices([t for t in divisors(value) if t <= 64])}"
                    + (" or pad the vocabulary to a multiple of tp" if name == "model.vocab_size" else "")
                )
        if m.num_experts and tp > 1 and not p.sequence_parallel:
            # megatron-core 0.16's MoELayer.forward raises in training when its attention TP group
            # spans ranks and sequence parallelism is off: refuse it here, not at the first step.
            fix = (
                "on CPU, which has no sequence parallelism, set parallel.tp=1 and spread the experts "
                "with parallel.ep (e.g. parallel=ep2)"
                if self.device == "cpu"
                else "set parallel.sequence_parallel=true, or parallel.tp=1 and spread the experts "
                "with parallel.ep"
            )
            self.add(
                f"model.num_experts={m.num_experts} with parallel.tp={tp} needs "
                f"parallel.sequence_parallel=true (megatron-core's MoE layer refuses to train with "
                f"tensor but no sequence parallelism); {fix}"
            )
        if p.sequence_parallel:
            if tp == 1:
                self.add(
                    "parallel.sequence_parallel=true needs parallel.tp>1 (it splits the sequence over "
                    "the tensor-parallel ranks); set parallel.sequence_parallel=false or tp>=2"
                )
            elif (m.seq_length // max(p.cp, 1)) % tp:
                self.add(
                    f"model.seq_length={m.seq_length} (per CP rank: {m.seq_length // max(p.cp, 1)}) is not "
                    f"divisible by parallel.tp={tp} with parallel.sequence_parallel=true; use a multiple "
                    f"of {tp * max(p.cp, 1)} or sequence_parallel=false"
                )

    def pipeline(self) -> list[int] | None:
        """Layers per virtual stage (length pp * vpp, megatron-core's chunk order), or None."""
        p, m = self.cfg.parallel, self.cfg.model
        pp, layers = p.pp, m.num_layers
        vpp = p.vpp if p.vpp and p.vpp > 1 else None
        if vpp is not None and pp == 1:
            self.add(
                f"parallel.vpp={p.vpp} (interleaved pipeline) needs parallel.pp>1; set parallel.vpp=null "
                "or pp>=2"
            )
            return None
        chunks = vpp or 1
        if p.pipeline_layout is not None and p.pipeline_layout_scheme is not None:
            self.add(
                f"parallel.pipeline_layout={p.pipeline_layout} and parallel.pipeline_layout_scheme="
                f"{p.pipeline_layout_scheme!r} are both set; keep one (set the other to null)"
            )
            return None
        if p.pipeline_layout is not None:
            return self._explicit_layout(list(p.pipeline_layout), pp, chunks, layers)
        if p.pipeline_layout_scheme == "alternating":
            if pp < 2 or layers % pp or layers // pp < 2:
                self.add(
                    f"parallel.pipeline_layout_scheme=alternating needs parallel.pp>=2 dividing "
                    f"model.num_layers={layers} with at least 2 layers per stage (got pp={pp}); use pp in "
                    f"{choices([d for d in divisors(layers) if 2 <= d <= layers // 2])} or an explicit "
                    "parallel.pipeline_layout"
                )
                return None
            return self._explicit_layout(alternating_layout(layers, pp), pp, chunks, layers, scheme=True)
        if pp > layers:
            self.add(
                f"parallel.pp={pp} exceeds model.num_layers={layers}; use pp in {choices(divisors(layers))}"
            )
            return None
        if layers % pp:
            self.add(
                f"parallel.pp={pp} does not divide model.num_layers={layers}; use pp in "
                f"{choices(divisors(layers))} or set parallel.pipeline_layout (layers per stage, "
                f"e.g. {[layers // pp + (1 if i < layers % pp else 0) for i in range(pp)]})"
            )
            return None
        per_stage = layers // pp
        if per_stage % chunks:
            self.add(
                f"parallel.vpp={vpp} does not divide the {per_stage} layers per pipeline stage "
                f"(model.num_layers={layers} / parallel.pp={pp}); use vpp in "
                f"{choices([d for d in divisors(per_stage) if d > 1] or ['null'])} or vpp=null"
            )
            return None
        return [per_stage // chunks] * (pp * chunks)

    def _explicit_layout(
        self, layout: list[int], pp: int, chunks: int, layers: int, *, scheme: bool = False
    ) -> list[int] | None:
        what = (
            f"parallel.pipeline_layout_scheme=alternating (-> {layout})"
            if scheme
            else f"parallel.pipeline_layout={layout}"
        )
        if len(layout) not in (pp, pp * chunks):
            per = f" or {pp * chunks} (one per virtual stage)" if chunks > 1 else ""
            self.add(
                f"{what} has {len(layout)} entries but parallel.pp={pp}; give one entry per pipeline "
                f"stage ({pp}){per}"
            )
            return None
        if any(n < 1 for n in layout):
            self.add(f"{what} has a stage with fewer than 1 layer; give every stage >= 1 layer")
            return None
        if sum(layout) != layers:
            self.add(
                f"{what} sums to {sum(layout)} layers but model.num_layers={layers}; make the entries "
                f"sum to {layers}"
            )
            return None
        if len(layout) == pp * chunks:
            return layout
        # One entry per stage with interleaving: each stage's layers split evenly over its chunks.
        bad = [n for n in layout if n % chunks]
        if bad:
            self.add(
                f"{what}: stages with {bad} layers cannot be split into parallel.vpp={chunks} chunks; "
                f"give each stage a multiple of {chunks} layers or {pp * chunks} per-virtual-stage entries"
            )
            return None
        return [layout[i] // chunks for _ in range(chunks) for i in range(pp)]

    # -- batch, CP -----------------------------------------------------------------------------

    def batch(self, dp: int | None) -> int | None:
        b, p, m = self.cfg.batch, self.cfg.parallel, self.cfg.model
        ok = all(
            [
                self.positive("batch.micro_batch_size", b.micro_batch_size),
                self.positive("batch.global_batch_size", b.global_batch_size),
                self.positive("batch.train_steps", b.train_steps),
            ]
        )
        self.one_of("batch.precision", b.precision, PRECISIONS)
        if ok:
            self.profile_steps(b.train_steps)
        if p.cp > 1 and m.seq_length % (2 * p.cp):
            ok_cp = [1] + [c for c in divisors(m.seq_length) if c > 1 and m.seq_length % (2 * c) == 0]
            self.add(
                f"model.seq_length={m.seq_length} is not divisible by 2*parallel.cp={2 * p.cp} (context "
                f"parallelism splits the sequence into 2*cp chunks); use a seq_length multiple of {2 * p.cp} "
                f"or cp in {choices(ok_cp)}"
            )
        if not ok or dp is None:
            return None
        per_step = b.micro_batch_size * dp
        if b.global_batch_size % per_step:
            mbs_ok = [mb for mb in divisors(b.global_batch_size) if (b.global_batch_size // mb) % dp == 0]
            self.add(
                f"batch.global_batch_size={b.global_batch_size} is not divisible by batch.micro_batch_size="
                f"{b.micro_batch_size} * dp={dp} = {per_step}; use global_batch_size in "
                f"{choices(multiples(per_step, start=b.global_batch_size))}"
                + (f" or micro_batch_size in {choices(mbs_ok)}" if mbs_ok else "")
            )
            return None
        n = b.global_batch_size // per_step
        vpp = p.vpp if p.vpp and p.vpp > 1 else None
        if vpp is not None and p.pp > 1 and n % p.pp:
            self.add(
                f"{n} microbatches per step (batch.global_batch_size={b.global_batch_size} / "
                f"(micro_batch_size={b.micro_batch_size} * dp={dp})) is not a multiple of "
                f"parallel.pp={p.pp}, which the interleaved schedule (parallel.vpp={vpp}) needs; use "
                f"global_batch_size in {choices(multiples(per_step * p.pp, start=b.global_batch_size))}"
                " or parallel.vpp=null"
            )
        return n

    def profile_steps(self, train_steps: int) -> None:
        # A step the loop never reaches would be traced by nobody, silently: refuse it instead.
        chosen = self.cfg.telemetry.profile_steps or []
        late = sorted({s for s in chosen if isinstance(s, int) and s >= train_steps})
        if not late:
            return
        fit = [s for s in range(max(0, train_steps - 2), train_steps)]
        self.add(
            f"telemetry.profile_steps={list(chosen)} names step(s) {late} that never run: "
            f"batch.train_steps={train_steps} runs steps 0..{train_steps - 1} (steps count from 0); "
            f"choose steps below {train_steps} (e.g. telemetry.profile_steps={fit}) or set "
            f"batch.train_steps={max(late) + 1} or more"
        )

    # -- FSDP ----------------------------------------------------------------------------------

    def fsdp(self) -> None:
        p, o, m, b = self.cfg.parallel, self.cfg.optim, self.cfg.model, self.cfg.batch
        if not p.fsdp or p.fsdp_impl != "torch_fsdp2":
            return
        # megatron-core 0.16 + Megatron-LM validate_args: FSDP2 limits.
        if p.pp > 1:
            self.add(
                f"parallel.fsdp_impl=torch_fsdp2 does not support pipeline parallelism in megatron-core "
                f"0.16 (parallel.pp={p.pp}); use parallel.fsdp_impl=megatron_fsdp or parallel.pp=1"
            )
        if p.ep > 1:
            self.add(
                f"parallel.fsdp_impl=torch_fsdp2 does not support expert parallelism (parallel.ep={p.ep}); "
                "use parallel.fsdp_impl=megatron_fsdp or parallel.ep=1"
            )
        if o.use_distributed_optimizer:
            self.add(
                "parallel.fsdp_impl=torch_fsdp2 cannot be combined with optim.use_distributed_optimizer=true "
                "(FSDP2 shards the optimizer itself); set use_distributed_optimizer=false or use "
                "parallel.fsdp_impl=megatron_fsdp"
            )
        if not m.untie_embeddings:
            self.add(
                "parallel.fsdp_impl=torch_fsdp2 needs model.untie_embeddings=true; set it, or use "
                "parallel.fsdp_impl=megatron_fsdp"
            )
        if b.precision == "fp16":
            self.add("parallel.fsdp_impl=torch_fsdp2 does not support batch.precision=fp16; use bf16 or fp32")


def validate(cfg: TrainConfig, world_size: int | None = None, device: str = "cpu") -> ResolvedLayout:
    """Check ``cfg`` for ``world_size`` ranks on ``device`` (``cpu`` | ``cuda`` | ``auto``) and
    return the resolved layout; raise :class:`ConfigProblems` listing every problem found.

    ``world_size`` None = ``parallel.dp * tp * pp * cp`` when ``parallel.dp`` is set, else
    ``launch.nproc``. Touches no process group, no accelerator and allocates no model.
    """
    device = resolve_device(device)
    cfg = for_device(cfg, device)
    world = _world_size(cfg, world_size)
    c = _Checker(cfg, world, device)
    c.names()
    if not c.bounds():  # before any check that loops over divisors of these values
        raise ConfigProblems(c.problems)
    model_ok = c.model()
    layout_ok = c.parallel_basics()
    c.problems.extend(run_problems(cfg, device))
    dp: int | None = None
    virtual: list[int] | None = None
    if layout_ok:
        dp = c.world_layout()
        if model_ok:
            c.experts(dp)
            c.tensor()
            virtual = c.pipeline()
    n_micro = c.batch(dp if layout_ok else None)
    c.optim(virtual)
    c.fsdp()
    if device == "cpu":
        c.problems.extend(cpu_problems(cfg))
    if c.problems:
        raise ConfigProblems(c.problems)
    assert dp is not None and virtual is not None and n_micro is not None
    p = cfg.parallel
    vpp = p.vpp if p.vpp and p.vpp > 1 else None
    chunks = vpp or 1
    per_stage = [sum(virtual[v * p.pp + i] for v in range(chunks)) for i in range(p.pp)]
    layout = ResolvedLayout(
        world_size=world,
        tp=p.tp,
        pp=p.pp,
        vpp=vpp,
        cp=p.cp,
        ep=p.ep,
        dp=dp,
        expert_dp=world // (p.tp * p.ep * p.pp),
        num_microbatches=n_micro,
        layers_per_stage=per_stage,
        layers_per_virtual_stage=virtual,
    )
    if device == "cpu":
        local = world if cfg.launch.launcher == "local" else 1  # others: this rank alone, at least
        memory = cpu_memory_problem(cfg, layout, local, host_memory_bytes())
        if memory:
            raise ConfigProblems([memory])
    return layout
