"""Model and hardware arithmetic: FLOPs, parameters, peak rates, throughput, MFU, memory.

Plain functions and dataclasses over a :class:`ModelShape` (no torch, no framework, nothing
of ``charllm_nemo.train``). The public API (what a user or an integration may import from here;
docs/flops.md):

* :class:`ModelShape`, :func:`model_flops_per_step`, :func:`model_flops_per_token`,
  :func:`hardware_flops_per_step`, :func:`parameter_count`, :class:`FlopsBreakdown`,
  :class:`HardwareFlops`, :class:`ParameterCount` (flops.py): FLOPs of a GPT / MoE step.
* ``ModelShape.from_transformer_config``, ``from_nemo_config``, ``from_megatron_args``: a
  ModelShape from a framework's model config (the fields read by shape_builders.py).
* :class:`DevicePeak`, :data:`PEAK_TABLE`, :func:`identify_device`, :func:`lookup_peak_tflops`
  (peak.py): dense peak TFLOP/s per device and dtype.
* :class:`StepThroughput`, :func:`step_throughput`, :func:`window_throughput` (throughput.py):
  tokens/s, TFLOP/s per GPU, MFU and HFU from measured step times (s).
* :class:`StageMemory`, :func:`stage_memory` (memory.py); :class:`ActivationSetup`,
  :class:`StageActivations`, :func:`stage_activations` (activations.py): bytes per rank.

Imported lazily: ``import charllm_nemo.metrics`` loads none of its modules.
"""

from __future__ import annotations

from typing import Any

from charllm_nemo._exports import lazy_attribute

_WHERE = {
    "ModelShape": "flops",
    "FlopsBreakdown": "flops",
    "HardwareFlops": "flops",
    "ParameterCount": "flops",
    "model_flops_per_step": "flops",
    "model_flops_per_token": "flops",
    "hardware_flops_per_step": "flops",
    "parameter_count": "flops",
    "DevicePeak": "peak",
    "PEAK_TABLE": "peak",
    "identify_device": "peak",
    "lookup_peak_tflops": "peak",
    "StepThroughput": "throughput",
    "step_throughput": "throughput",
    "window_throughput": "throughput",
    "StageMemory": "memory",
    "stage_memory": "memory",
    "ActivationSetup": "activations",
    "StageActivations": "activations",
    "stage_activations": "activations",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _WHERE, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
