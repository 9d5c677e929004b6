"""charllm compare: a made difference is found with its sign and size; no difference, a single
run a side, a figure that trends through a run, a difference below the resolution and a single
step give no verdict, with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from charllm_nemo.analysis.compare import (
    FIGURES,
    bootstrap_difference,
    compare_groups,
    load_group,
    render,
)
from charllm_nemo.analysis.compare_stats import hierarchical_difference, repeats_needed, widening
from charllm_nemo.cli import main

TOKENS = 4096  # tokens per step
RESAMPLES = 600  # fewer than the command's 2,000: the verdicts below are far from the edge


def make_run(
    path: Path,
    step_time_s: np.ndarray,
    power_w: float = 300.0,
    world: int = 2,
    temp_c: np.ndarray | float = 60.0,
    peak_w: np.ndarray | float | None = None,
    throttle: float = 0.0,
) -> Path:
    """A run directory as charllm train leaves it, as far as compare reads it: rank folders,
    summary.json's world size and rank 0's steps.jsonl (step 0 is warm-up: 10x slower).
    ``temp_c``/``peak_w``: per measured step, or one value for all."""
    for r in range(world):
        (path / f"rank={r}").mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps({"status": "complete", "world_size": world}))
    n = step_time_s.size
    temps = np.broadcast_to(np.asarray(temp_c, float), (n,))
    peaks = np.broadcast_to(np.asarray(power_w * 1.1 if peak_w is None else peak_w, float), (n,))
    lines = []
    rows = [(10 * step_time_s[0], temps[0], peaks[0]), *zip(step_time_s, temps, peaks, strict=True)]
    for i, (t, temp, peak) in enumerate(rows):
        lines.append(
            json.dumps(
                {
                    "step": i,
                    "step_time_s": float(t),
                    "tokens_per_s": TOKENS / float(t),
                    "energy_j": power_w * world * float(t),
                    "ranks_reporting": world,
                    "power_peak_w": float(peak),
                    "temp_gpu_peak_c": float(temp),
                    "throttle_share": throttle,
                }
            )
        )
    (path / "steps.jsonl").write_text("\n".join(lines) + "\n")
    return path


def noisy(seed: int, n: int = 60, mean: float = 0.100, sd: float = 0.004) -> np.ndarray:
    return np.random.default_rng(seed).normal(mean, sd, n)


def by_name(result: dict, i: int = 0) -> dict:
    return {row["figure"]: row for row in result["comparisons"][i]["figures"]}


def warming(step_time_s: np.ndarray, start_c: float, rise_c: float, tau_s: float = 2.0) -> np.ndarray:
    """A die that warms through the run: ``start + rise x (1 - exp(-t / tau))`` at each step's
    end (t from the first measured step's start, after the 10x warm-up step)."""
    t = 10 * step_time_s[0] + np.cumsum(step_time_s)
    return np.round(start_c + rise_c * (1 - np.exp(-t / tau_s)))  # whole degrees, as NVML reads


def repeats(
    root: Path, seed: int, hosts: tuple[float, ...] = (0.95, 1.0, 1.06), scale: float = 1.0, hot: bool = False
) -> Path:
    """Runs of one configuration under ``root``, one per entry of ``hosts``: that run's host
    speed (a quiet or a busy minute, as a factor on its step times), 40 steps of 4 % noise;
    ``hot``: a configuration that runs 25 % slower, 15 °C hotter, 60 W more at peak and
    throttled 30 % of the time."""
    rng = np.random.default_rng(seed)
    for k, host in enumerate(hosts):
        t = rng.normal(0.1, 0.004, 40) * host * scale * (1.25 if hot else 1.0)
        temp = warming(t, 45.0 + rng.normal(0, 1.5) + (15 if hot else 0), 20.0)
        peak = 500.0 + (60 if hot else 0) + rng.normal(0, 3, t.size)
        make_run(root / f"seed={k}", t, temp_c=temp, peak_w=peak, throttle=0.3 if hot else 0.0)
    return root


def test_two_single_runs_of_one_configuration_get_no_verdict_on_time_or_temperature(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One configuration run twice: the second met a quiet host (25 % faster steps, as in the
    # issue's -65.8 % "better") and its die warmed through a run that, being slower in the
    # first, lasted longer there: the first's pooled peak temperature is higher. Neither is a
    # property of the configuration; one run a side cannot tell, and says so.
    t_a, t_b = noisy(1), noisy(2) * 0.75
    a = make_run(tmp_path / "a", t_a, temp_c=warming(t_a, 45.0, 20.0))
    b = make_run(tmp_path / "b", t_b, temp_c=warming(t_b, 45.0, 20.0))
    rows = by_name(compare_groups([load_group(a), load_group(b)], resamples=RESAMPLES))
    for name in ("step_time_s", "tokens_per_s", "energy_per_token_j", "tokens_per_j"):
        assert rows[name]["verdict"] == "no verdict", rows[name]
        assert "one run on both sides" in rows[name]["reason"]
        assert "step-to-step variance only" in rows[name]["reason"]
        assert rows[name]["interval_kind"] == "steps only (one run a side)"
    assert "runs a side would resolve" in rows["step_time_s"]["reason"]
    assert (
        isinstance(rows["step_time_s"]["repeats_needed"], int) and rows["step_time_s"]["repeats_needed"] >= 3
    )
    temp = rows["temp_gpu_peak_c"]
    assert temp["verdict"] == "no verdict" and "trends within a run" in temp["reason"]
    assert temp["equal_time_s"] == pytest.approx(float(10 * t_b[0] + t_b.sum()))
    # The printed text carries the reasons.
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert out.count("no verdict") >= 5 and "why: one run on both sides" in out
    assert "why: temp_gpu_peak_c trends within a run" in out


def test_three_hot_runs_against_three_cool_runs_get_the_right_verdicts(tmp_path: Path) -> None:
    cool = load_group(repeats(tmp_path / "cool", seed=10))
    hot = load_group(repeats(tmp_path / "hot", seed=11, hot=True))
    rows = by_name(compare_groups([cool, hot], resamples=RESAMPLES))
    for name in ("step_time_s", "energy_per_token_j", "temp_gpu_peak_c", "power_peak_w", "throttle_share"):
        assert rows[name]["verdict"] == "worse", rows[name]
    for name in ("tokens_per_s", "tokens_per_j"):
        assert rows[name]["verdict"] == "worse", rows[name]
        assert rows[name]["difference"] < 0
    assert rows["step_time_s"]["interval_kind"] == "runs and steps"
    assert 0.1 < rows["step_time_s"]["difference"] < 0.4
    # the temperature warms through every run: compared at equal time, and said so
    assert rows["temp_gpu_peak_c"]["equal_time_s"] is not None
    assert "equal time" in rows["temp_gpu_peak_c"]["reason"]
    # the cool configuration against the hot one: the mirror verdicts
    back = by_name(compare_groups([hot, cool], resamples=RESAMPLES))
    assert back["step_time_s"]["verdict"] == "better" and back["temp_gpu_peak_c"]["verdict"] == "better"


def test_three_repeats_against_three_repeats_of_one_configuration_get_no_verdict(tmp_path: Path) -> None:
    # Host speed varies run to run by ~6 % (4 % step noise), and the three runs of B happened
    # to meet a busier host than A's: pooling steps alone (the old interval) calls B slower;
    # resampling runs does not.
    a = load_group(repeats(tmp_path / "a", seed=20, hosts=(0.90, 0.97, 1.01)))
    b = load_group(repeats(tmp_path / "b", seed=21, hosts=(0.99, 1.03, 1.10)))
    rows = by_name(compare_groups([a, b], resamples=RESAMPLES))
    _, low, high = bootstrap_difference(a.values["step_time_s"], b.values["step_time_s"])
    assert not low <= 0 <= high  # steps alone: a false difference
    for name in ("step_time_s", "tokens_per_s", "energy_per_token_j", "tokens_per_j", "temp_gpu_peak_c"):
        assert rows[name]["verdict"] in ("no clear difference", "no difference"), rows[name]


def test_a_difference_below_the_resolution_is_no_difference(tmp_path: Path) -> None:
    # 550.0 W against 550.005 W at every step: a zero-width interval that excludes zero, but
    # 5 mW is far below what a board power reading can tell (+-5 W).
    a = make_run(tmp_path / "a", noisy(3), peak_w=550.0)
    b = make_run(tmp_path / "b", noisy(4), peak_w=550.005)
    row = by_name(compare_groups([load_group(a), load_group(b)], resamples=RESAMPLES))["power_peak_w"]
    assert row["verdict"] == "no difference" and "resolution" in row["reason"]
    # ... while 60 W is a difference, even from one run a side (peak power is not time-like)
    c = make_run(tmp_path / "c", noisy(5), peak_w=610.0)
    row = by_name(compare_groups([load_group(a), load_group(c)], resamples=RESAMPLES))["power_peak_w"]
    assert row["verdict"] == "worse" and row["interval_kind"] == "steps only (one run a side)"


def test_one_measured_step_gives_no_verdict(tmp_path: Path) -> None:
    a = make_run(tmp_path / "a", noisy(6, n=1))  # warm-up + one measured step
    b = make_run(tmp_path / "b", noisy(7, n=1), peak_w=900.0)
    g = load_group(a)
    assert g.steps("step_time_s") == 1
    rows = by_name(compare_groups([g, load_group(b)], resamples=RESAMPLES))
    for name in ("power_peak_w", "step_time_s"):
        assert rows[name]["verdict"] == "no verdict" and "1 measured step(s)" in rows[name]["reason"]


def test_the_hierarchical_interval_covers_the_truth(tmp_path: Path) -> None:
    # Known truth: 3 runs a side, run effects sd 6 %, AR(1) step noise sd 5 % (rho 0.5), the
    # second side 5 % slower. The 95 % interval must hold the true +5 % in >= 93 % of trials
    # (bench/bench_compare_coverage.py measures more settings and trials); the step-only
    # interval does not come close.
    from bench.bench_compare_coverage import coverage

    got = coverage(runs=3, steps=12, run_sd=0.06, step_sd=0.05, trials=60, resamples=300)
    assert got >= 0.93, got
    assert coverage(runs=3, steps=12, run_sd=0.06, step_sd=0.05, trials=60, resamples=300, widen=False) < got


def test_small_sample_widening_and_repeats() -> None:
    assert widening(1, 5) == 1.0
    assert widening(3, 3) == pytest.approx(np.sqrt(1.5) * 2.776 / 1.96, rel=1e-3)
    assert widening(30, 30) < 1.05
    # 5 % run-to-run spread, a 10 % effect: ~4 runs a side; no effect: nothing to resolve
    n = repeats_needed(0.05, 0.10)
    assert n is not None and 3 <= n <= 6
    assert repeats_needed(0.05, 0.0) is None and repeats_needed(0.5, 0.01) is None


def test_a_faster_pair_of_repeats_is_better_and_warm_up_is_left_out(tmp_path: Path) -> None:
    make_run(tmp_path / "a" / "seed=1", noisy(5))
    make_run(tmp_path / "a" / "seed=2", noisy(15))
    make_run(tmp_path / "b" / "seed=1", noisy(6) * 0.8)
    make_run(tmp_path / "b" / "seed=2", noisy(16) * 0.8)
    group = load_group(tmp_path / "a")
    assert group.steps("step_time_s") == 120  # 2 x 61 lines, the warm-up steps left out
    assert float(np.max(group.values["step_time_s"])) < 0.2
    rows = by_name(compare_groups([group, load_group(tmp_path / "b")], resamples=RESAMPLES))
    assert rows["step_time_s"]["verdict"] == "better"
    assert rows["tokens_per_j"]["verdict"] == "better"
    assert rows["power_peak_w"]["verdict"] == "no difference"


def test_partial_energy_sums_are_not_compared(tmp_path: Path) -> None:
    a = make_run(tmp_path / "a", noisy(7))
    lines = (a / "steps.jsonl").read_text().splitlines()
    lines = [json.dumps({**json.loads(x), "ranks_reporting": 1}) for x in lines]
    (a / "steps.jsonl").write_text("\n".join(lines) + "\n")
    g = load_group(a)
    assert g.steps("energy_per_token_j") == 0
    assert g.steps("step_time_s") == 60


def test_repeats_of_a_configuration_are_kept_per_run(tmp_path: Path) -> None:
    # A folder holding two repeats (two run directories) is one group of both runs' steps.
    make_run(tmp_path / "cfg" / "seed=1", noisy(8, n=30))
    make_run(tmp_path / "cfg" / "seed=2", noisy(9, n=30))
    g = load_group(tmp_path / "cfg")
    assert len(g.runs) == 2 and g.runs_with("step_time_s") == 2
    assert g.steps("step_time_s") == 60
    assert [a.size for a in g.per_run["step_time_s"]] == [30, 30]


def test_bootstrap_interval_is_reproducible_and_covers_the_point() -> None:
    a, b = noisy(10), noisy(11) * 1.05
    first = bootstrap_difference(a, b)
    assert first == bootstrap_difference(a, b)
    point, low, high = first
    assert low <= point <= high
    # hierarchical: a run drawn twice is resampled independently each time, the point is the
    # pooled medians' difference
    p2, lo2, hi2 = hierarchical_difference([a, noisy(12)], [b, noisy(13) * 1.05], resamples=300)
    assert lo2 <= p2 <= hi2


def test_hostile_step_lines_are_reported_not_raised(tmp_path: Path) -> None:
    a = make_run(tmp_path / "a", noisy(12))
    with (a / "steps.jsonl").open("a") as f:
        f.write('{"step": 99, "step_time_s": "\\u001b[2Jslow"}\n{"step": \n')
    g = load_group(a)
    assert g.steps("step_time_s") == 60
    assert any("step_time_s" in p for p in g.problems)
    b = make_run(tmp_path / "b\x1b[2J", noisy(13))
    text = render(compare_groups([g, load_group(b)], resamples=RESAMPLES))
    assert "\x1b" not in text


def test_cli_text_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = repeats(tmp_path / "a", seed=30, hosts=(0.98, 1.02))
    b = repeats(tmp_path / "b", seed=31, hosts=(0.98, 1.02), scale=1.6)
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "step_time_s" in out and "worse" in out and "(2 run(s))" in out
    assert main(["compare", str(a), str(b), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["figure"] for r in data["comparisons"][0]["figures"]] == [f.name for f in FIGURES]
    assert data["groups"][0]["runs_measured"]["step_time_s"] == 2
    assert main(["compare", str(a), str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
