"""Model, optimizer and name checks of :func:`charllm_nemo.train.validate.validate`.

The checks of one config that do not depend on how it is laid out over ranks: the preset names,
the model's shape (heads, KV groups, position embeddings, experts' top-k) and the optimizer's
settings (learning rates, Adam betas, recomputation, communication overlap). The per-parallelism
checks (layout, tensor, pipeline, batch, FSDP) are in train/validate.py, whose checker extends
:class:`ModelChecks`; the module doc there says which megatron-core rule each mirrors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from charllm_nemo.train.config import TrainConfig
from charllm_nemo.train.layout import choices, divisors
from charllm_nemo.train.presets import CUSTOM, MODEL_PRESETS, OPTIM_PRESETS, PARALLEL_PRESETS

__all__ = [
    "NORMALIZATIONS",
    "POSITION_EMBEDDINGS",
    "PRECISIONS",
    "RECOMPUTE_GRANULARITIES",
    "RECOMPUTE_METHODS",
    "TOKEN_DISPATCHERS",
    "CheckerBase",
    "ModelChecks",
]

POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
TOKEN_DISPATCHERS = ("allgather", "alltoall", "flex")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("block", "uniform")


INT_BOUNDS: dict[str, int] = {
    "batch.train_steps": 10**9,
    "batch.micro_batch_size": 2**20,
    "batch.global_batch_size": 2**26,
    "model.num_layers": 10**4,
    "model.hidden_size": 2**20,
    "model.num_attention_heads": 2**16,
    "model.num_query_groups": 2**16,
    "model.ffn_hidden_size": 2**22,
    "model.vocab_size": 2**24,
    "model.seq_length": 2**24,
    "model.max_position_embeddings": 2**24,
    "model.num_experts": 2**16,
    "model.moe_router_topk": 2**16,
    "model.moe_ffn_hidden_size": 2**22,
    "parallel.tp": 2**20,
    "parallel.pp": 2**20,
    "parallel.vpp": 2**10,
    "parallel.cp": 2**20,
    "parallel.ep": 2**20,
    "parallel.dp": 2**20,
    "optim.warmup_steps": 10**9,
    "optim.recompute_num_layers": 10**4,
    "data.seed": 2**32 - 1,
    "launch.nproc": 2**16,
}
"""Largest value of each integer field of the train config: far above any real run (a billion
steps, a million-rank dimension, a 16M-token context), small enough that every check and
allocation sized by them stays bounded. (``launch.master_port`` has its own check: a TCP port.)"""

BOUND_HINTS = {
    "batch.train_steps": "the longest published runs take about 10**6 steps; e.g. batch.train_steps=1000",
    "data.seed": "a seed is a 32-bit unsigned number; e.g. data.seed=1234",
}


class CheckerBase:
    """Collects problems; each check reads the config and appends messages (one per problem,
    naming the field, the value and one that works)."""

    def __init__(self, cfg: TrainConfig, world_size: int, device: str) -> None:
        self.cfg = cfg
        self.world = world_size
        self.device = device
        self.problems: list[str] = []

    def add(self, message: str) -> None:
        self.problems.append(message)

    def positive(self, fieldname: str, value: int | float | None, *, allow_none: bool = False) -> bool:
        if value is None and allow_none:
            return True
        # nan compares False with everything and inf passes "> 0": both are refused by name.
        if value is None or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            self.add(f"{fieldname}={value!r} must be a positive number; e.g. {fieldname}=1")
            return False
        return True

    def within(
        self, fieldname: str, value: float, low: float, high: float, *, high_open: bool = False, hint: str
    ) -> bool:
        """``value`` finite and in [low, high] ([low, high) with ``high_open``); else a problem
        naming the field, the range and ``hint`` (a value that works)."""
        above = value >= low
        below = value < high if high_open else value <= high
        if isinstance(value, bool) or not (math.isfinite(value) and above and below):
            bracket = ")" if high_open else "]"
            self.add(f"{fieldname}={value!r} must lie in [{low:g}, {high:g}{bracket}; {hint}")
            return False
        return True

    def one_of(
        self, fieldname: str, value: object, allowed: Sequence[object], *, none_ok: bool = False
    ) -> bool:
        if value is None and none_ok:
            return True
        if value not in allowed:
            extra = " (or null)" if none_ok else ""
            self.add(f"{fieldname}={value!r} is not valid; use one of {choices(allowed)}{extra}")
            return False
        return True


class ModelChecks(CheckerBase):
    """The names, model and optimizer checks (see the module doc)."""

    # -- names ---------------------------------------------------------------------------------

    def names(self) -> None:
        c = self.cfg
        for group, name, table in (
            ("model", c.model.name, MODEL_PRESETS),
            ("parallel", c.parallel.name, PARALLEL_PRESETS),
            ("optim", c.optim.name, OPTIM_PRESETS),
        ):
            if name != CUSTOM and name not in table:
                self.add(
                    f"{group}.name={name!r} is not a known {group}; use {group}=<name> with one of "
                    f"{choices(sorted(table))}, or {group}.name={CUSTOM} for values set by hand"
                )

    # -- model ---------------------------------------------------------------------------------

    def bounds(self) -> bool:
        """Every integer field within :data:`INT_BOUNDS`; False (each problem named) otherwise.
        Checked first: later checks enumerate divisors and multiples of these values, which a
        value such as ``batch.train_steps=10**23`` would make unbounded in time."""
        ok = True
        for fieldname, high in INT_BOUNDS.items():
            section, name = fieldname.split(".")
            value = getattr(getattr(self.cfg, section), name)
            if isinstance(value, int) and not isinstance(value, bool) and value > high:
                hint = BOUND_HINTS.get(fieldname, "use a smaller value")
                self.add(f"{fieldname}={value} is larger than {high:,}, the most this tool accepts; {hint}")
                ok = False
        return ok

    def model(self) -> bool:
        """Shape checks; True when the fields later checks divide by are usable."""
        m = self.cfg.model
        pos = {
            name: self.positive(f"model.{name}", getattr(m, name))
            for name in (
                "num_layers",
                "hidden_size",
                "num_attention_heads",
                "ffn_hidden_size",
                "vocab_size",
                "seq_length",
            )
        }
        for name in ("num_query_groups", "max_position_embeddings", "moe_ffn_hidden_size", "num_experts"):
            pos[name] = self.positive(f"model.{name}", getattr(m, name), allow_none=True)
        self.one_of("model.position_embedding", m.position_embedding, POSITION_EMBEDDINGS)
        self.one_of("model.normalization", m.normalization, NORMALIZATIONS)
        self.one_of("model.moe_token_dispatcher", m.moe_token_dispatcher, TOKEN_DISPATCHERS)
        if pos["hidden_size"] and pos["num_attention_heads"] and m.hidden_size % m.num_attention_heads:
            self.add(
                f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
                f"{m.num_attention_heads}; use num_attention_heads in {choices(divisors(m.hidden_size))}"
            )
        g = m.num_query_groups
        if (
            pos["num_attention_heads"]
            and pos["num_query_groups"]
            and g is not None
            and m.num_attention_heads % g
        ):
            self.add(
                f"model.num_query_groups={g} does not divide model.num_attention_heads="
                f"{m.num_attention_heads}; use num_query_groups in "
                f"{choices(divisors(m.num_attention_heads))} or null (multi-head attention)"
            )
        mpe = m.max_position_embeddings
        if pos["seq_length"] and pos["max_position_embeddings"] and mpe is not None and mpe < m.seq_length:
            self.add(
                f"model.max_position_embeddings={mpe} is smaller than model.seq_length={m.seq_length}; "
                f"set max_position_embeddings >= {m.seq_length} or null"
            )
        e = m.num_experts
        if e is None:  # unused by a dense model, but a value that could never work is still wrong
            self.positive("model.moe_router_topk", m.moe_router_topk)
        elif pos["num_experts"] and not 1 <= m.moe_router_topk <= e:
            self.add(
                f"model.moe_router_topk={m.moe_router_topk} must lie in [1, model.num_experts={e}]; "
                f"e.g. model.moe_router_topk={min(2, e)}"
            )
        return all(pos.values())

    # -- optim ---------------------------------------------------------------------------------

    def optim(self, virtual_stages: list[int] | None) -> None:
        o, p = self.cfg.optim, self.cfg.parallel
        if self.positive("optim.lr", o.lr):
            self.within(
                "optim.min_lr", o.min_lr, 0.0, o.lr, hint=f"it is the floor of the decay, <= optim.lr={o.lr}"
            )
        if o.warmup_steps < 0:
            self.add(f"optim.warmup_steps={o.warmup_steps} must be >= 0")
        if not (math.isfinite(o.clip_grad) and o.clip_grad >= 0):
            self.add(
                f"optim.clip_grad={o.clip_grad!r} must be a finite number >= 0 (0 = no clipping), e.g. 1.0"
            )
        if not (math.isfinite(o.weight_decay) and o.weight_decay >= 0):
            self.add(f"optim.weight_decay={o.weight_decay!r} must be a finite number >= 0, e.g. 0.01")
        for name in ("adam_beta1", "adam_beta2"):
            # Adam divides by 1 - beta**t: a beta of 1 is a division by zero at the first step.
            self.within(f"optim.{name}", getattr(o, name), 0.0, 1.0, high_open=True, hint="e.g. 0.9 / 0.95")
        g_ok = self.one_of(
            "optim.recompute_granularity", o.recompute_granularity, RECOMPUTE_GRANULARITIES, none_ok=True
        )
        m_ok = self.one_of("optim.recompute_method", o.recompute_method, RECOMPUTE_METHODS, none_ok=True)
        if g_ok and m_ok:
            self._recompute(virtual_stages)
        if o.overlap_param_gather:
            megatron_fsdp = p.fsdp and p.fsdp_impl == "megatron_fsdp"
            if not (o.use_distributed_optimizer or megatron_fsdp):
                self.add(
                    "optim.overlap_param_gather=true needs optim.use_distributed_optimizer=true (or "
                    "parallel.fsdp=true with Megatron-FSDP); set one, or overlap_param_gather=false"
                )
            if not o.overlap_grad_reduce:
                self.add(
                    "optim.overlap_param_gather=true needs optim.overlap_grad_reduce=true; set both "
                    "(optim=comm_overlap) or neither"
                )
        if o.tp_comm_overlap and (p.tp == 1 or not p.sequence_parallel):
            self.add(
                f"optim.tp_comm_overlap=true needs parallel.tp>1 and parallel.sequence_parallel=true "
                f"(got tp={p.tp}, sequence_parallel={str(p.sequence_parallel).lower()}); set both or "
                "optim.tp_comm_overlap=false"
            )

    def _recompute(self, virtual_stages: list[int] | None) -> None:
        o = self.cfg.optim
        g, method, n = o.recompute_granularity, o.recompute_method, o.recompute_num_layers
        if g is None:
            if method is not None or n is not None:
                self.add(
                    f"optim.recompute_method={method!r} / optim.recompute_num_layers={n!r} have no "
                    "effect without optim.recompute_granularity; set recompute_granularity=full "
                    "(or optim=recompute) or set them to null"
                )
            return
        if g == "selective":
            if method is not None:
                self.add(
                    f"optim.recompute_method={method!r} does not apply to recompute_granularity=selective "
                    "(it recomputes only core attention); set optim.recompute_method=null, or use "
                    "recompute_granularity=full"
                )
            if n is not None:
                self.add(
                    f"optim.recompute_num_layers={n} must be null with recompute_granularity=selective; set "
                    "optim.recompute_num_layers=null, or use recompute_granularity=full"
                )
            return
        # full
        if method is None:
            self.add(
                "optim.recompute_granularity=full needs optim.recompute_method in [block, uniform]; e.g. "
                "optim.recompute_method=uniform"
            )
        limit = min(virtual_stages) if virtual_stages else None
        if n is None:
            self.add(
                "optim.recompute_granularity=full needs optim.recompute_num_layers"
                + (f" in [1, {limit}] (layers per pipeline stage)" if limit else " >= 1")
                + "; e.g. optim.recompute_num_layers=1"
            )
        elif n < 1:
            self.add(f"optim.recompute_num_layers={n} must be >= 1; e.g. optim.recompute_num_layers=1")
        elif limit is not None and n > limit:
            where = "(virtual) pipeline stage" if self.cfg.parallel.pp > 1 else "model"
            self.add(
                f"optim.recompute_num_layers={n} exceeds the {limit} layers of the smallest {where} "
                f"(model.num_layers={self.cfg.model.num_layers}, parallel.pp={self.cfg.parallel.pp}, "
                f"vpp={self.cfg.parallel.vpp}); use recompute_num_layers in [1, {limit}]"
            )
        elif method == "uniform" and virtual_stages and any(k % n for k in set(virtual_stages)):
            # mcore checkpoints layers [i, i + n) while i < the chunk's layers: a last group that
            # runs past the end fails in the first forward (IndexError), on that stage only.
            fits = divisors(math.gcd(*virtual_stages))
            self.add(
                f"optim.recompute_num_layers={n} with recompute_method=uniform must divide the layers of "
                f"every (virtual) pipeline stage ({sorted(set(virtual_stages))}); use one of {fits}, "
                "or recompute_method=block"
            )
