"""``charllm train``'s run-level results: the rates of its model (:func:`train_rates`) and the
medians of ``summary.json`` (:func:`run_summary`).

The per-step logic (the one per-rank vector a step, the reports, the console line, steps.jsonl)
is the framework-free step API's: charllm_nemo.steps.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from charllm_nemo.steps.observers import STEPS_FILE
from charllm_nemo.steps.summary import SUMMARY_FIELDS, SUMMARY_FILE, run_summary

if TYPE_CHECKING:
    from charllm_nemo.steps.rates import StepRates
    from charllm_nemo.train.config import TrainConfig

log = logging.getLogger("charllm_nemo.train")

__all__ = ["STEPS_FILE", "SUMMARY_FIELDS", "SUMMARY_FILE", "run_summary", "train_rates"]

"""Rank 0's steps and their medians, written when training ends (train/loop.py)."""


def train_rates(
    cfg: TrainConfig,
    world_size: int,
    device_name: str | None,
    on_cpu: bool,
    layers_per_virtual_stage: list[int] | None = None,
    compute_units: int | None = None,
    tf32_gemms: bool = False,
) -> StepRates | None:
    """The rates of ``cfg``'s model (FLOPs per step, model and with recomputation; the peak rate;
    ``telemetry.attention_flops``), or None when they cannot be computed (a metrics error must
    not stop training: the figures stay absent).

    ``device_name`` and ``compute_units`` (its SMs / CUs: torch's ``multi_processor_count``)
    identify the peak rate: the count tells an MI250X GCD (110) from an MI250 one (104), which
    share a name, and scales the rate of a MIG slice or an MI300X CPX partition. On CPU the peak
    is ``telemetry.cpu_peak_tflops`` (None: no MFU). ``tf32_gemms``: fp32 training whose GEMMs
    run as TF32 (TransformerEngine's layers do): MFU against the TF32 rate, not the CUDA-core
    FP32 one (which would put it above 100 %)."""
    from charllm_nemo.metrics import flops, peak
    from charllm_nemo.steps.rates import StepRates

    b, o, p, t = cfg.batch, cfg.optim, cfg.parallel, cfg.telemetry
    try:
        causal = t.attention_flops == "causal"
        shape = flops.ModelShape.from_model_config(cfg.model, causal_attention_flops=causal)
        uneven = layers_per_virtual_stage and len(set(layers_per_virtual_stage)) > 1
        hw = flops.hardware_flops_per_step(
            shape,
            b.global_batch_size,
            o.recompute_granularity,
            o.recompute_method,
            o.recompute_num_layers,
            pipeline_parallel=p.pp,
            virtual_pipeline=p.vpp if p.vpp and p.vpp > 1 else None,
            pipeline_layout=layers_per_virtual_stage if uneven else None,
        )
        name = "cpu" if on_cpu else (device_name or "")
        dtype = "tf32" if tf32_gemms and b.precision == "fp32" and not on_cpu else b.precision
        rate = peak.lookup_peak_tflops(
            name,
            dtype,
            override_tflops=t.cpu_peak_tflops if on_cpu else None,
            compute_units=None if on_cpu else compute_units,
        )
        return StepRates(
            model_flops_per_step=float(flops.model_flops_per_step(shape, b.global_batch_size).total),
            global_batch_size=b.global_batch_size,
            seq_length=cfg.model.seq_length,
            world_size=world_size,
            peak_tflops_per_gpu=rate,
            hardware_flops_per_step=float(hw.total),
            attention_flops="causal" if causal else "full",
        )
    except Exception:  # a metrics error must not stop training; the figures stay absent
        log.debug("no throughput figures", exc_info=True)
        return None
