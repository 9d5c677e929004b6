"""Whether a dry run's plans fit the named device's memory (``launch.platform``).

The plans are the configuration as given and each recomputation setting the dry run offers
(train/plan.py ``RECOMPUTE_OPTIONS``), with the layers this host expects (megatron-core's local
layers where TransformerEngine is not importable) and, planned from a host without it, with
TransformerEngine's too. A plan's peak is its highest stage's weights, gradients, optimizer state
and estimated activations (train/plan.py). It fits when that peak is at most
:data:`USABLE_SHARE` of the device's memory (its datasheet capacity, metrics/energy_prior.py):
the estimate leaves out the CUDA / ROCm context, communication buffers and the allocator's
fragmentation, which take the rest.

The verdict (docs/config.md, *Dry run*): each plan says ``fits`` or ``does not fit``; when the
configuration as given does not fit but another plan does, a WARNING line names those that fit
(exit 0: they are one setting away); when no plan fits, the dry run exits 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from charllm_nemo.train.config import TrainConfig
from charllm_nemo.train.layout import ResolvedLayout

USABLE_SHARE = 0.9
"""The share of a device's memory a plan's estimated peak may take (the estimate leaves out the
runtime's context, communication buffers and fragmentation: several GiB on a GPU)."""


@dataclass(frozen=True)
class PlanPeak:
    """One plan: how to ask for it, the layers it assumes, its highest stage and peak (bytes)."""

    how: str
    implementation: str
    stage: int
    peak_bytes: int
    configured: bool


@dataclass(frozen=True)
class MemoryFit:
    """The plans against one device: its name and capacity (bytes), each plan, and what fits."""

    device: str
    capacity_bytes: int
    plans: list[PlanPeak]

    @property
    def usable_bytes(self) -> float:
        return USABLE_SHARE * self.capacity_bytes

    def fits(self, plan: PlanPeak) -> bool:
        return plan.peak_bytes <= self.usable_bytes

    @property
    def any_fits(self) -> bool:
        return any(self.fits(p) for p in self.plans)

    @property
    def configured_fits(self) -> bool:
        """The configuration as given fits with every layer implementation planned for."""
        return all(self.fits(p) for p in self.plans if p.configured)


def plan_peaks(cfg: TrainConfig, layout: ResolvedLayout) -> list[PlanPeak]:
    """Every plan's highest stage and peak (see the module docstring)."""
    from charllm_nemo.train.plan import (
        RECOMPUTE_OPTIONS,
        layer_implementation,
        plan_stage_activations,
        plan_stage_memory,
    )

    state = [s.total_bytes for s in plan_stage_memory(cfg, layout)]
    here = layer_implementation(cfg.launch.device)
    implementations = [here] if here == "te" or cfg.launch.device == "cpu" else [here, "te"]
    variants: list[tuple[str, TrainConfig, bool]] = [("as configured", cfg, True)]
    for text, fields in RECOMPUTE_OPTIONS:
        optim = replace(cfg.optim, **{"recompute_method": None, "recompute_num_layers": None, **fields})
        variants.append((text, replace(cfg, optim=optim), False))
    out = []
    for implementation in implementations:
        for how, variant, configured in variants:
            acts = plan_stage_activations(variant, layout, implementation)
            peaks = [a.total_bytes + s for a, s in zip(acts, state, strict=True)]
            top = max(range(len(peaks)), key=peaks.__getitem__)
            out.append(PlanPeak(how, implementation, top, peaks[top], configured))
    return out


def memory_fit(cfg: TrainConfig, layout: ResolvedLayout) -> MemoryFit | None:
    """The plans against the memory of the device ``launch.platform`` names; None when it names
    none whose memory is known (or the run is on CPU: train/plan.py ``cpu_memory_problem``)."""
    from charllm_nemo.metrics.energy_prior import prior_for

    if cfg.launch.device == "cpu":
        return None
    device = prior_for(cfg.launch.platform)
    if device is None:
        return None
    return MemoryFit(device.name, device.memory_bytes, plan_peaks(cfg, layout))


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def fit_lines(cfg: TrainConfig, fit: MemoryFit | None) -> list[str]:
    """The dry run's memory verdict, one line per plan, then the verdict line."""
    if fit is None:
        if cfg.launch.device == "cpu":
            return []
        return [
            f"memory fit: not checked: launch.platform={cfg.launch.platform} names no device whose "
            "memory is known (NVIDIA H100, H200, B200, AMD MI300X); set it to check every plan"
        ]
    text = {"local": "local layers", "te": "TransformerEngine layers"}
    lines = [
        f"memory fit on {fit.device}: {_gib(fit.capacity_bytes)}, a plan fits when its peak is at "
        f"most {USABLE_SHARE:.0%} of it ({_gib(fit.usable_bytes)}; the rest: runtime context, "
        "communication buffers, fragmentation):"
    ]
    for p in fit.plans:
        verdict = "fits" if fit.fits(p) else "DOES NOT FIT"
        lines.append(
            f"  {p.how}, {text[p.implementation]}: peak {_gib(p.peak_bytes)} (stage {p.stage}): {verdict}"
        )
    fitting = [f"{p.how} ({text[p.implementation]})" for p in fit.plans if fit.fits(p)]
    if not fitting:
        lines.append(
            f"memory fit: NO PLAN FITS {fit.device}: more tensor / pipeline parallelism "
            "(parallel.tp, parallel.pp), a smaller batch.micro_batch_size or a larger device"
        )
    elif not fit.configured_fits:
        lines.append(
            f"WARNING: the configuration as given does not fit {fit.device}; these plans do: "
            + "; ".join(fitting)
        )
    return lines
