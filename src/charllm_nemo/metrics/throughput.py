"""Throughput, TFLOP/s per GPU, MFU and HFU from measured step times.

Plain functions over numbers. Definitions (docs/flops.md):

* tokens/s = global_batch_size x seq_length / step time
* model TFLOP/s per GPU = model FLOPs per step / (step time x world_size) / 1e12
* MFU = model TFLOP/s per GPU / peak dense TFLOP/s per GPU; HFU the same with hardware FLOPs

``world_size`` is every rank of the job (TP x PP x CP x DP), so the rates are per-GPU averages
over the whole job. An unknown peak gives ``mfu = hfu = None``, never a made-up ratio.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from charllm_nemo.errors import ConfigError

TERA = 1e12


@dataclass(frozen=True, slots=True)
class StepThroughput:
    """Rates of one step (or the mean step of a window).

    Units in the names: ``*_per_s`` per second of wall time, ``*_tflops_per_gpu`` in TFLOP/s
    per GPU; ``mfu`` / ``hfu`` are fractions (0.45 = 45 %), None when the peak is unknown.
    """

    step_time_s: float
    tokens_per_s: float
    samples_per_s: float
    tokens_per_s_per_gpu: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    peak_tflops_per_gpu: float | None
    mfu: float | None
    hfu: float | None


def _positive_number(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{name}={value!r} must be a finite number > 0")
    return float(value)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")
    return value


def _flops(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigError(f"{name}={value!r} must be a finite, non-negative number of FLOPs")
    return float(value)


def step_throughput(
    step_time_s: float,
    global_batch_size: int,
    seq_length: int,
    model_flops_per_step: float,
    hardware_flops_per_step: float | None,
    world_size: int,
    peak_tflops_per_gpu: float | None,
) -> StepThroughput:
    """Rates of one training step that took ``step_time_s`` seconds of wall time.

    ``model_flops_per_step`` / ``hardware_flops_per_step`` are FLOPs (counts) of the whole
    step over all ranks (``flops.model_flops_per_step(...).total``,
    ``flops.hardware_flops_per_step(...).total``); hardware None = no recomputation, same as
    model. ``peak_tflops_per_gpu`` in TFLOP/s (``peak.lookup_peak_tflops``), None if unknown.
    Raises ConfigError (a ValueError) naming the argument that is out of range.
    """
    step_s = _positive_number("step_time_s", step_time_s)
    gbs = _positive_int("global_batch_size", global_batch_size)
    seq = _positive_int("seq_length", seq_length)
    ranks = _positive_int("world_size", world_size)
    model = _flops("model_flops_per_step", model_flops_per_step)
    hardware = (
        model
        if hardware_flops_per_step is None
        else _flops("hardware_flops_per_step", hardware_flops_per_step)
    )
    if hardware < model:
        raise ConfigError(
            f"hardware_flops_per_step={hardware_flops_per_step!r} is below "
            f"model_flops_per_step={model_flops_per_step!r}; hardware FLOPs are model FLOPs plus "
            f"recomputation, pass None when nothing is recomputed"
        )
    peak = (
        None if peak_tflops_per_gpu is None else _positive_number("peak_tflops_per_gpu", peak_tflops_per_gpu)
    )

    tokens_per_s = gbs * seq / step_s
    model_tflops = model / (step_s * ranks) / TERA
    hardware_tflops = hardware / (step_s * ranks) / TERA
    return StepThroughput(
        step_time_s=step_s,
        tokens_per_s=tokens_per_s,
        samples_per_s=gbs / step_s,
        tokens_per_s_per_gpu=tokens_per_s / ranks,
        model_tflops_per_gpu=model_tflops,
        hardware_tflops_per_gpu=hardware_tflops,
        peak_tflops_per_gpu=peak,
        mfu=None if peak is None else model_tflops / peak,
        hfu=None if peak is None else hardware_tflops / peak,
    )


def window_throughput(
    step_times_s: Sequence[float],
    global_batch_size: int,
    seq_length: int,
    model_flops_per_step: float,
    hardware_flops_per_step: float | None,
    world_size: int,
    peak_tflops_per_gpu: float | None,
    *,
    skip_first: int = 0,
) -> StepThroughput:
    """Rates over several equal steps: total work / total time, i.e. at the mean step time.

    Averaging per-step MFUs would over-weight fast steps; this does not. ``skip_first`` drops
    warm-up steps (compilation, allocator growth) from the front.
    """
    if isinstance(skip_first, bool) or not isinstance(skip_first, int) or skip_first < 0:
        raise ConfigError(f"skip_first={skip_first!r} must be a non-negative integer")
    times = list(step_times_s)[skip_first:]
    if not times:
        raise ConfigError(
            f"step_times_s has {len(step_times_s)} steps and skip_first={skip_first}: "
            f"no step is left to measure; pass more steps or skip fewer"
        )
    for i, t in enumerate(times):
        _positive_number(f"step_times_s[{i + skip_first}]", t)
    return step_throughput(
        math.fsum(times) / len(times),
        global_batch_size,
        seq_length,
        model_flops_per_step,
        hardware_flops_per_step,
        world_size,
        peak_tflops_per_gpu,
    )
