"""What a user of ``log_to="wandb"`` gets, checked on the W&B run itself: the offline
``.wandb`` file read back (tests/sinks/wandb_reader.py) against rank 0's ``steps.jsonl``.
Shared by the integrations' tests (one per integration)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from charllm_nemo.sinks.keys import STEP_KEY, SUMMARY_KEYS

from .wandb_reader import WandbRun, find_wandb_file, read_run

# the figures the synthetic device reports on every rank whatever the step's length (power,
# energy, clocks, throttle time; PCIe traffic needs a counter read inside the step): each one's
# rank/<r>/<figure> key must be in every step's row
SYNTHETIC_RANK_FIGURES = (
    "energy_j",
    "power_avg_w",
    "clock_sm_avg_mhz",
    "throttle_any_limiting_s",
)
# the highest sampled values: null (no key) for a step no sample fell in (#42: never an
# interpolated edge), so each is required on some step of each rank, not on every one
SAMPLED_RANK_FIGURES = ("power_peak_w", "temp_gpu_peak_c")
CROSS_RANK_KEYS = (
    "all/energy_j",
    "all/power_mean_w",
    "all/power_max_w",
    "all/ranks_throttled",
)
SAMPLED_CROSS_RANK_KEYS = ("all/temp_max_c",)  # the ranks' sampled peaks: on some step


def assert_every_step_in_wandb(
    run_dir: Path, world_size: int = 1, wandb_root: Path | None = None
) -> WandbRun:
    """Every step of ``run_dir/steps.jsonl`` is a row of the run's offline W&B file (under
    ``wandb_root``, default ``run_dir/wandb``) at its step, holding each rank's per-rank keys,
    the cross-rank keys (``all/energy_j`` = the step's energy in steps.jsonl) and the step's
    throughput / loss keys with the values steps.jsonl has; the run ended (its exit record)."""
    rows = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert rows, "no steps reported"
    run = read_run(find_wandb_file(wandb_root or run_dir / "wandb"), wait_s=30)
    assert run.exited, run.kinds
    history = {h[STEP_KEY]: h for h in run.history if STEP_KEY in h and "all/ranks_reporting" in h}
    assert sorted(history) == [r["step"] for r in rows]
    for rank in range(world_size):
        for n in SAMPLED_RANK_FIGURES:
            assert any(f"rank/{rank}/{n}" in h for h in history.values()), (rank, n)
    for key in SAMPLED_CROSS_RANK_KEYS:
        assert any(key in h for h in history.values()), key
    for row in rows:
        h = history[row["step"]]
        assert h["all/ranks_reporting"] == world_size
        for rank in range(world_size):
            missing = [n for n in SYNTHETIC_RANK_FIGURES if f"rank/{rank}/{n}" not in h]
            assert not missing, (row["step"], rank, missing)
        assert all(k in h for k in CROSS_RANK_KEYS), sorted(h)
        assert h["all/energy_j"] == pytest.approx(row["energy_j"], rel=1e-9)
        for name, key in SUMMARY_KEYS.items():
            if isinstance(row.get(name), (int, float)) and not isinstance(row.get(name), bool):
                assert h[key] == pytest.approx(row[name], rel=1e-9), key
    return run
