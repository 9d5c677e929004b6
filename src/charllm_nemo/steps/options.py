"""What a :class:`~charllm_nemo.steps.StepTelemetry` is made with, as typed option objects: how
the rank's steps are cut and telemetered (:class:`StepOptions`) and what its throughput and MFU
are counted from (:class:`RateInputs`). The constructor takes these, not their fields one by
one, so a caller that has them from its config passes them on whole."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepOptions:
    """How one rank's steps are telemetered (the same on every rank).

    ``device``: ``cuda`` times marks with CUDA events resolved at step end, else the host clock.
    ``windows``: the window kinds to record (None: all; ``()`` none). ``total_steps``: the last
    step asks for its figures at once. ``max_figure_wait_s``: the most a step waits for an
    earlier step's overdue figures (None: up to two sampling periods, at most 50 ms; 0: never,
    they are dropped). ``figures``: the telemetry figures each rank reports (names of
    ``telemetry.rank_vector.STEP_FIGURE_KEYS``; None: all where the telemetry process computes
    them, ``THREAD_MODE_FIGURES`` where the training thread does). ``phase_times``: sum each
    step's phases by group on every rank and send the host's CPU pressure and the sampler's
    health (alerts ask for them). ``rank_info``: every rank sends its static facts once.
    ``num_microbatches`` per step (a step may change it), ``num_chunks`` (virtual pipeline
    chunks on this rank) and ``group_size`` (mcore's ``microbatch_group_size_per_vp_stage``)
    map the k-th forward to its microbatch."""

    device: str = "cpu"
    windows: Sequence[str] | None = None
    total_steps: int | None = None
    max_figure_wait_s: float | None = None
    figures: Sequence[str] | None = None
    phase_times: bool = False
    rank_info: bool = False
    num_microbatches: int = 1
    num_chunks: int = 1
    group_size: int | None = None


@dataclass(frozen=True)
class RateInputs:
    """What a step's FLOPs, throughput and MFU are counted from: ``model`` (a ModelShape),
    ``global_batch_size`` (sequences a step), ``seq_length`` (default the shape's),
    ``attention_flops`` (``full`` | ``causal``; default the shape's), against
    ``peak_tflops_per_gpu`` (None: looked up for the CUDA device at ``precision``)."""

    model: Any
    global_batch_size: int
    seq_length: int | None = None
    attention_flops: str | None = None
    peak_tflops_per_gpu: float | None = None
    precision: str = "bf16"
