"""Which ranks do the same work, for the alerts (docs/alerts.md, "Pipelines").

A pipeline stage does the work its layout gives it (its layers; the first stage the embedding,
the last the logits and loss), so two ranks are compared by time only when they sit in the same
stage. :class:`StageLayout` says, per global rank, its pipeline stage, and per stage the work
the layout assigns it (any unit; relative). Framework-free: the trainer builds it from its
resolved layout (:meth:`StageLayout.megatron`), an integration from its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from charllm_nemo.errors import ConfigError


@dataclass(frozen=True)
class StageLayout:
    """``stage_of_rank[r]``: rank ``r``'s pipeline stage (0 = the first). ``work[s]``: the work
    the layout gives stage ``s`` (e.g. its layers, the logits counted in layers' FLOPs), or None
    when unknown."""

    stage_of_rank: tuple[int, ...]
    work: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.stage_of_rank or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in self.stage_of_rank
        ):
            raise ConfigError(
                f"StageLayout.stage_of_rank={self.stage_of_rank!r} must be stages >= 0, one per rank"
            )
        if self.work is not None and (
            len(self.work) != self.stages or any(not w > 0 for w in self.work)  # NaN fails too
        ):
            raise ConfigError(
                f"StageLayout.work={self.work!r} must hold one positive number per stage ({self.stages})"
            )

    @property
    def stages(self) -> int:
        """How many pipeline stages."""
        return max(self.stage_of_rank) + 1

    def stage(self, rank: int) -> int | None:
        """Rank ``rank``'s stage, None when the layout does not know the rank."""
        return self.stage_of_rank[rank] if 0 <= rank < len(self.stage_of_rank) else None

    def work_share(self, stage: int) -> float | None:
        """The share (0-1) of one pipeline's work the layout gives ``stage``; None unknown."""
        if self.work is None or not 0 <= stage < len(self.work):
            return None
        return self.work[stage] / sum(self.work)

    @classmethod
    def megatron(
        cls,
        world_size: int,
        pp: int,
        layers_per_stage: Sequence[int] | None = None,
        logits_layers: float = 0.0,
    ) -> StageLayout:
        """Megatron-Core's default rank order (``tp-cp-ep-dp-pp``: the pipeline rank varies
        slowest, so rank ``r`` is in stage ``r // (world_size / pp)``). ``layers_per_stage``:
        the transformer layers of each stage (over its virtual chunks); ``logits_layers``: the
        output layer and loss of the last stage, in layers' worth of FLOPs (0: not counted).
        The embedding lookup has no GEMM and is not counted."""
        if pp < 1 or world_size % pp:
            raise ConfigError(f"parallel.pp={pp} does not divide the world size {world_size}")
        per_stage = world_size // pp
        work = None
        if layers_per_stage is not None and len(layers_per_stage) == pp:
            w = [float(n) for n in layers_per_stage]
            w[-1] += max(0.0, float(logits_layers))
            work = tuple(w) if all(x > 0 for x in w) else None
        return cls(tuple(r // per_stage for r in range(world_size)), work)
