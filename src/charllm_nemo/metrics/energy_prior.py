"""Uncalibrated priors for the dry run: memory, power and speed of H100, H200, B200 and MI300X
from published figures, each with its source and a range where the figure is uncertain.

The dry run (train/plan.py) uses a platform's entry of the fitted table
(metrics/energy_calibration.json, ``charllm calibrate-energy``) when there is one; else, for these
four GPUs, the prior here, labelled as such and given as a range: the energy at the central
figures and at the corners of every range (low rate x low power, ... high). docs/compare-energy.md
(*Priors*) lists every figure with its source; where none was found the range is wide and says so.

The model is metrics/energy_model.py's, per pipeline stage: ``s_per_flop = 1 / (peak dense rate x
MFU)``, no fixed overhead a step (published MFUs already include it), idle and busy power per
device. Plain data and arithmetic; no framework.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from charllm_nemo.metrics.energy_model import Calibration, Estimate, estimate_stages
from charllm_nemo.metrics.peak import PEAK_TABLE


@dataclass(frozen=True)
class Figure:
    """A published figure: the value used, the range it may lie in, and where it comes from."""

    value: float
    low: float
    high: float
    source: str


@dataclass(frozen=True)
class DevicePrior:
    """One GPU's published figures (per device; W, bytes, fractions)."""

    key: str
    name: str
    memory_bytes: int
    memory_source: str
    power_limit_w: float
    power_limit_source: str
    idle_w: Figure
    busy_w: Figure
    mfu: Figure
    peak_key: str  # metrics/peak.py's PEAK_TABLE entry for the dense rate

    def peak_tflops(self, precision: str) -> float:
        """The dense rate (TFLOP/s) for the run's precision (fp32 runs: the bf16 rate is not
        theirs; the table's fp32 rate where it has one, else bf16)."""
        rates = PEAK_TABLE[self.peak_key].tflops
        key = "bf16" if precision in ("bf16", "fp16", "auto") else precision
        return float(rates.get(key) or rates["bf16"])


_NV_H100 = "NVIDIA H100 datasheet (SXM: 700 W max TDP, 80 GB HBM3)"
_NV_H200 = "NVIDIA H200 datasheet (SXM: up to 700 W TDP, 141 GB HBM3e)"
_NV_B200 = "NVIDIA HGX B200 / DGX B200 specifications (1,000 W per GPU, 180 GB HBM3e per GPU)"
_AMD_MI300X = "AMD Instinct MI300X datasheet (750 W peak board power, 192 GB HBM3)"
_LLAMA3 = (
    "Llama 3 paper (Dubey et al. 2024, arXiv 2407.21783, Table 4): 38-43 % BF16 MFU on 8-16K H100 "
    "for the 405B model"
)
_H100_NODE = (
    "Latif et al. 2024 (arXiv 2412.08602): an 8x H100 HGX node peaked at 8.4 kW of its rated 10.2 kW "
    "training Llama2-13b; Newkirk et al. 2025 (arXiv 2506.14551): compute-heavy training at 76 % of "
    "the node rating. Node-level, so the GPUs' share is read as 75-95 % of their 700 W"
)
_THIS_PROJECT_H200 = (
    "this project's H200 check (docs/gpu-check.md): the card sits at its 700 W cap under a bf16 "
    "matmul; no published per-GPU training draw found"
)
_IDLE_H200 = (
    "third-party measurements of an idle H200 with a CUDA context, 74-80 W (RunPod / Phala "
    "benchmark pages, not peer reviewed); no vendor idle figure"
)
_NONE = "no published figure found (2026-12-06): a wide range around a share of the board limit"

PRIORS: dict[str, DevicePrior] = {
    p.key: p
    for p in (
        DevicePrior(
            "h100_sxm",
            "NVIDIA H100 SXM (80 GB)",
            80 * 10**9,
            _NV_H100,
            700.0,
            _NV_H100,
            Figure(75.0, 50.0, 120.0, f"{_IDLE_H200} (same GH100 die as the H200); " + _NONE),
            Figure(600.0, 525.0, 665.0, _H100_NODE),
            Figure(0.40, 0.30, 0.45, _LLAMA3 + "; down to 30 % for smaller jobs"),
            "h100_sxm",
        ),
        DevicePrior(
            "h200_sxm",
            "NVIDIA H200 SXM (141 GB)",
            141 * 10**9,
            _NV_H200,
            700.0,
            _NV_H200,
            Figure(77.0, 60.0, 120.0, _IDLE_H200),
            Figure(630.0, 525.0, 700.0, _THIS_PROJECT_H200 + "; " + _H100_NODE),
            Figure(0.40, 0.25, 0.50, "same GH100 compute as H100: " + _LLAMA3 + "; " + _NONE + " for H200"),
            "h200_sxm",
        ),
        DevicePrior(
            "b200",
            "NVIDIA B200 (180 GB)",
            180 * 10**9,
            _NV_B200,
            1000.0,
            _NV_B200,
            Figure(120.0, 70.0, 250.0, _NONE),
            Figure(850.0, 600.0, 1000.0, _NONE),
            Figure(0.35, 0.20, 0.50, _NONE),
            "b200",
        ),
        DevicePrior(
            "mi300x",
            "AMD Instinct MI300X (192 GB)",
            192 * 10**9,
            _AMD_MI300X,
            750.0,
            _AMD_MI300X,
            Figure(130.0, 80.0, 250.0, _NONE),
            Figure(640.0, 450.0, 750.0, _NONE),
            Figure(0.30, 0.15, 0.45, _NONE),
            "mi300x",
        ),
    )
}
"""The four GPUs' priors; docs/compare-energy.md (*Priors*) shows the table."""

_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("b200", re.compile(r"(?<!G)\bB200\b")),
    ("h200_sxm", re.compile(r"\bH200\b(?!.*\b(NVL|PCIE)\b)")),
    ("h100_sxm", re.compile(r"\bH100\b(?!.*\b(NVL|PCIE)\b)")),
    ("mi300x", re.compile(r"\bMI300X\b")),
)


def prior_for(name: str | None) -> DevicePrior | None:
    """The prior for a device name as NVML / AMD SMI / a user writes it ("NVIDIA H200",
    "NVIDIA H100 80GB HBM3", "MI300X", ...); None for any other (PCIe and NVL cards included:
    their limits differ)."""
    if not name:
        return None
    text = " ".join(re.sub(r"[-_/]", " ", name.upper()).split())
    for key, pattern in _RULES:
        if pattern.search(text):
            return PRIORS[key]
    return None


def calibration(prior: DevicePrior, precision: str, idle_w: float, busy_w: float, mfu: float) -> Calibration:
    """metrics/energy_model.py's model for one choice of the prior's figures."""
    s_per_flop = 1.0 / (prior.peak_tflops(precision) * 1e12 * mfu)
    return Calibration(
        platform=f"{prior.name} (prior)",
        s_per_flop=s_per_flop,
        step_overhead_s=0.0,
        idle_w=idle_w,
        busy_w=busy_w,
        peak_ratio=busy_w / max(idle_w, busy_w),
        power_limit_w=prior.power_limit_w,
        runs=0,
        held_out_error_median=None,
        held_out_error_max=None,
        fitted_from="published figures (metrics/energy_prior.py)",
    )


@dataclass(frozen=True)
class PriorEstimate:
    """The central estimate and the range of the energy per step over every corner of the
    prior's ranges (J)."""

    central: Estimate
    energy_low_j: float
    energy_high_j: float


def prior_estimate(
    prior: DevicePrior,
    precision: str,
    stage_flops_per_rank: Sequence[float],
    ranks_per_stage: float,
    microbatches: int,
    vpp: int | None = None,
) -> PriorEstimate:
    """The prior's energy per step for one layout, at the central figures and its range (every
    combination of the low and high idle power, busy power and MFU)."""

    def energy(idle: float, busy: float, mfu: float) -> Estimate:
        cal = calibration(prior, precision, idle, busy, mfu)
        return estimate_stages(cal, stage_flops_per_rank, ranks_per_stage, microbatches, vpp)

    central = energy(prior.idle_w.value, prior.busy_w.value, prior.mfu.value)
    corners = [
        energy(i, b, m).energy_step_j
        for i, b, m in itertools.product(
            (prior.idle_w.low, prior.idle_w.high),
            (prior.busy_w.low, prior.busy_w.high),
            (prior.mfu.low, prior.mfu.high),
        )
    ]
    return PriorEstimate(central, min(corners), max(corners))
