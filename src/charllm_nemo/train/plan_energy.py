"""The dry run's energy estimate: per pipeline stage, from the fitted table where the platform has
an entry (``charllm calibrate-energy``), else from the published-figure prior of an H100, H200,
B200 or MI300X (metrics/energy_prior.py), labelled as an uncalibrated prior with its range.

Both depend on the layout: each stage's hardware FLOPs (metrics/stage_flops.py: its layers, the
output layer on the last, recomputation) set how long it computes; the slowest stage and the
pipeline's fill and drain set the step (metrics/energy_model.py ``estimate_stages``).
docs/compare-energy.md says what each rests on.
"""

from __future__ import annotations

from charllm_nemo.metrics.flops import ModelShape
from charllm_nemo.metrics.stage_flops import stage_hardware_flops
from charllm_nemo.train.config import TrainConfig
from charllm_nemo.train.layout import ResolvedLayout


def stage_flops_per_rank(cfg: TrainConfig, layout: ResolvedLayout) -> list[float]:
    """Hardware FLOPs per rank of each pipeline stage per step (a stage's ranks share its work)."""
    o = cfg.optim
    per_stage = stage_hardware_flops(
        ModelShape.from_model_config(cfg.model),
        cfg.batch.global_batch_size,
        layout.layers_per_virtual_stage or [cfg.model.num_layers],
        layout.pp,
        o.recompute_granularity,
        o.recompute_method,
        o.recompute_num_layers,
    )
    ranks = layout.world_size / layout.pp
    return [f / ranks for f in per_stage]


def energy_lines(cfg: TrainConfig, layout: ResolvedLayout) -> list[str]:
    """The dry run's energy lines for ``launch.platform``: the fitted model's, else the prior's,
    else why there is none."""
    from charllm_nemo.metrics.energy_model import estimate_stages, load_table, platform_for
    from charllm_nemo.metrics.energy_prior import PRIORS, prior_estimate, prior_for

    flops = stage_flops_per_rank(cfg, layout)
    ranks = layout.world_size / layout.pp
    steps = cfg.batch.train_steps
    table = load_table()
    cal = platform_for(table, cfg.launch.platform, on_cpu=cfg.launch.device == "cpu")
    if cal is not None:
        e = estimate_stages(cal, flops, ranks, layout.num_microbatches, layout.vpp)
        err = (
            f"error on held-out runs: median {cal.held_out_error_median:.0%}, "
            f"max {cal.held_out_error_max:.0%}"
            if cal.held_out_error_median is not None and cal.held_out_error_max is not None
            else "no held-out error (fitted on fewer than 3 runs)"
        )
        return [
            f"energy (estimate, {cal.platform} model fitted on {cal.runs} runs; {err}): "
            f"{e.energy_step_j:,.4g} J per step, {e.energy_step_j * steps / 3.6e6:,.4g} kWh for "
            f"{steps:,} steps; step {e.step_s:.4g} s, {e.busy_share:.0%} busy; "
            f"power per device {e.power_avg_w:.4g} W average, {e.power_peak_w:.4g} W peak"
        ]
    prior = prior_for(cfg.launch.platform)
    if prior is not None:
        p = prior_estimate(prior, cfg.batch.precision, flops, ranks, layout.num_microbatches, layout.vpp)
        e = p.central
        return [
            f"energy (UNCALIBRATED PRIOR for {prior.name} from published figures: board limit "
            f"{prior.power_limit_w:.0f} W, idle {prior.idle_w.value:.0f} W, training draw "
            f"{prior.busy_w.value:.0f} W, MFU {prior.mfu.value:.0%}; sources and ranges in "
            f"docs/compare-energy.md): {e.energy_step_j:,.4g} J per step (range "
            f"{p.energy_low_j:,.4g}-{p.energy_high_j:,.4g}), {e.energy_step_j * steps / 3.6e6:,.4g} kWh "
            f"for {steps:,} steps (range {p.energy_low_j * steps / 3.6e6:,.4g}-"
            f"{p.energy_high_j * steps / 3.6e6:,.4g}); step {e.step_s:.4g} s, {e.busy_share:.0%} busy; "
            f"power per device {e.power_avg_w:.4g} W average",
            "  (a prior, not a measurement: charllm calibrate-energy fits this platform from measured "
            "runs, and the dry run then uses the fit instead)",
        ]
    known = ", ".join(sorted(table)) or "none"
    priors = ", ".join(p.name for p in PRIORS.values())
    return [
        f"energy: no estimate for launch.platform={cfg.launch.platform}; fitted platforms: {known}; "
        f"priors from published figures: {priors} (charllm calibrate-energy SWEEP_DIR fits one from "
        "measured runs)"
    ]
