"""Drop-in telemetry for training frameworks, on the step-telemetry API (charllm_nemo.steps).

The public API (what a user imports from here; docs/integrations.md says how to wire each):

* :class:`PowerThermalCallback` (nemo.py): NeMo 2 / Lightning callback (needs lightning).
* :class:`PowerThermalBridgeCallback` (bridge.py): Megatron-Bridge callback.
* :class:`MegatronLMTelemetry`, :class:`StepBoundaryTimers` (megatron_lm.py): Megatron-LM
  ``pretrain_gpt.py``-style loops, without patching Megatron-LM.
* :class:`IntegrationOptions`, :func:`open_step_telemetry`, :class:`RunFacts` (_common.py): the
  plain-value options every integration takes (sampling rate in Hz, where to log), the call that
  opens a rank's :class:`~charllm_nemo.steps.StepTelemetry` from them, and what the framework
  says of its run (model shape, batch, device, microbatches, steps).

Imported lazily: ``import charllm_nemo.integrations`` imports none of lightning, torch, megatron
or wandb; each name imports its module (and its framework) when first used.
"""

from __future__ import annotations

from typing import Any

from charllm_nemo._exports import lazy_attribute

_WHERE = {
    "PowerThermalCallback": "nemo",
    "PowerThermalBridgeCallback": "bridge",
    "MegatronLMTelemetry": "megatron_lm",
    "StepBoundaryTimers": "megatron_lm",
    "IntegrationOptions": "_common",
    "RunFacts": "_common",
    "open_step_telemetry": "_common",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _WHERE, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
