"""Throughput, TFLOP/s and MFU of a step from a framework-free model shape.

:class:`StepRates` holds what is fixed for a run (FLOPs per step, the batch, the peak rate, the
attention convention) and fills each :class:`~charllm_nemo.steps.report.StepReport`'s rates from
its step time. Built by :meth:`StepRates.for_model` from a
:class:`~charllm_nemo.metrics.flops.ModelShape` (whose builders read a megatron-core
TransformerConfig, a NeMo 2 GPTConfig or Megatron-LM's args).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.config import ATTENTION_FLOPS

if TYPE_CHECKING:
    from charllm_nemo.metrics.flops import ModelShape
    from charllm_nemo.steps.report import StepReport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRates:
    """Per-run constants of the rate figures. FLOPs are counts for the whole step over all
    ranks; ``hardware_flops_per_step`` None = nothing recomputed (same as the model's);
    ``peak_tflops_per_gpu`` TFLOP/s of one device, None = unknown (no MFU);
    ``attention_flops``: ``full`` | ``causal``, how the model FLOPs count attention."""

    model_flops_per_step: float
    global_batch_size: int
    seq_length: int
    world_size: int
    peak_tflops_per_gpu: float | None = None
    hardware_flops_per_step: float | None = None
    attention_flops: str = "full"
    _said: set[str] = field(default_factory=set, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.attention_flops not in ATTENTION_FLOPS:
            raise ConfigError(
                f"telemetry.attention_flops={self.attention_flops!r} is not valid; use one of "
                f"{', '.join(ATTENTION_FLOPS)}"
            )

    @classmethod
    def for_model(
        cls,
        model: ModelShape,
        global_batch_size: int,
        world_size: int,
        *,
        seq_length: int | None = None,
        attention_flops: str | None = None,
        peak_tflops_per_gpu: float | None = None,
        device_name: str | None = None,
        precision: str = "bf16",
        compute_units: int | None = None,
        hardware_flops_per_step: float | None = None,
    ) -> StepRates:
        """The rates of ``model`` trained ``global_batch_size`` sequences a step on
        ``world_size`` ranks. ``seq_length`` None = the shape's. ``attention_flops`` None = the
        shape's own convention (``causal_attention_flops``). The peak: ``peak_tflops_per_gpu``
        when given, else looked up for ``device_name`` (torch's device name; ``compute_units``
        its SM / CU count) and ``precision`` (bf16 | fp16 | fp32 | tf32 | fp8), else unknown."""
        from charllm_nemo.metrics import flops, peak

        if attention_flops is not None:
            if attention_flops not in ATTENTION_FLOPS:
                raise ConfigError(
                    f"telemetry.attention_flops={attention_flops!r} is not valid; use one of "
                    f"{', '.join(ATTENTION_FLOPS)}"
                )
            model = replace(model, causal_attention_flops=attention_flops == "causal")
        if seq_length is not None and seq_length != model.seq_length:
            model = replace(model, seq_length=seq_length)
        total = float(flops.model_flops_per_step(model, global_batch_size).total)
        rate = peak_tflops_per_gpu
        if rate is None and device_name:
            rate = peak.lookup_peak_tflops(device_name, precision, compute_units=compute_units)
        return cls(
            model_flops_per_step=total,
            global_batch_size=global_batch_size,
            seq_length=model.seq_length,
            world_size=world_size,
            peak_tflops_per_gpu=rate,
            hardware_flops_per_step=hardware_flops_per_step,
            attention_flops="causal" if model.causal_attention_flops else "full",
        )

    def fill(self, report: StepReport) -> None:
        """Put the rates of ``report``'s step time into it (nothing when the step time is not
        positive). Never raises: a rate that cannot be computed stays None, and why is logged
        once (a warning for each reason), not on every step."""
        from charllm_nemo.metrics.throughput import step_throughput

        if not report.step_time_s > 0:
            return
        try:
            r = step_throughput(
                report.step_time_s,
                self.global_batch_size,
                self.seq_length,
                self.model_flops_per_step,
                self.hardware_flops_per_step,
                self.world_size,
                self.peak_tflops_per_gpu,
            )
        except ConfigError as exc:
            if str(exc) not in self._said:  # said once for each reason, not on every step
                self._said.add(str(exc))
                log.warning("no tokens/s, TFLOP/s or MFU from step %s on: %s", report.step, exc)
            return
        report.tokens_per_s, report.samples_per_s = r.tokens_per_s, r.samples_per_s
        report.model_tflops_per_gpu = r.model_tflops_per_gpu
        report.hardware_tflops_per_gpu = r.hardware_tflops_per_gpu
        report.mfu = r.mfu
        report.mfu_attention = self.attention_flops
