"""charllm compare: a made difference is found with its sign and size, no difference is not."""

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
from charllm_nemo.cli import main

TOKENS = 4096  # tokens per step


def make_run(path: Path, step_time_s: np.ndarray, power_w: float = 300.0, world: int = 2) -> Path:
    """A run directory as charllm train leaves it, as far as compare reads it: rank folders,
    summary.json's world size and rank 0's steps.jsonl (step 0 is warm-up: 10x slower)."""
    for r in range(world):
        (path / f"rank={r}").mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps({"status": "complete", "world_size": world}))
    lines = []
    for i, t in enumerate([10 * step_time_s[0], *step_time_s]):
        lines.append(
            json.dumps(
                {
                    "step": i,
                    "step_time_s": float(t),
                    "tokens_per_s": TOKENS / float(t),
                    "energy_j": power_w * world * float(t),
                    "ranks_reporting": world,
                    "power_peak_w": power_w * 1.1,
                    "temp_gpu_peak_c": 60.0,
                    "throttle_share": 0.0,
                }
            )
        )
    (path / "steps.jsonl").write_text("\n".join(lines) + "\n")
    return path


def noisy(seed: int, n: int = 60, mean: float = 0.100, sd: float = 0.004) -> np.ndarray:
    return np.random.default_rng(seed).normal(mean, sd, n)


def by_name(result: dict, i: int = 0) -> dict:
    return {row["figure"]: row for row in result["comparisons"][i]["figures"]}


def test_a_twenty_percent_slower_run_is_found_worse(tmp_path: Path) -> None:
    # Same power, steps 20 % longer: step time +20 %, tokens/s -1/6, energy per token +20 %.
    a = make_run(tmp_path / "a", noisy(1))
    b = make_run(tmp_path / "b", noisy(2) * 1.2)
    rows = by_name(compare_groups([load_group(a), load_group(b)]))
    st = rows["step_time_s"]
    assert st["verdict"] == "worse"
    assert st["interval"][0] > 0.15 and st["interval"][1] < 0.25
    assert 0.17 < st["difference"] < 0.23
    assert rows["tokens_per_s"]["verdict"] == "worse"
    assert rows["energy_per_token_j"]["verdict"] == "worse"
    assert rows["tokens_per_j"]["verdict"] == "worse"
    # Peak power and temperature did not change: no verdict.
    assert rows["power_peak_w"]["verdict"] == "no clear difference"
    assert rows["throttle_share"]["difference_kind"] == "absolute"


def test_the_same_distribution_gets_no_verdict(tmp_path: Path) -> None:
    a = make_run(tmp_path / "a", noisy(3))
    b = make_run(tmp_path / "b", noisy(4))
    rows = by_name(compare_groups([load_group(a), load_group(b)]))
    for name in ("step_time_s", "tokens_per_s", "energy_per_token_j", "tokens_per_j"):
        assert rows[name]["verdict"] == "no clear difference", rows[name]
        low, high = rows[name]["interval"]
        assert low < 0 < high


def test_a_faster_run_is_better_and_warm_up_is_left_out(tmp_path: Path) -> None:
    a = make_run(tmp_path / "a", noisy(5))
    b = make_run(tmp_path / "b", noisy(6) * 0.8)
    group = load_group(a)
    assert group.steps("step_time_s") == 60  # 61 lines, the warm-up step left out
    assert float(np.max(group.values["step_time_s"])) < 0.2
    rows = by_name(compare_groups([group, load_group(b)]))
    assert rows["step_time_s"]["verdict"] == "better"
    assert rows["tokens_per_j"]["verdict"] == "better"


def test_partial_energy_sums_are_not_compared(tmp_path: Path) -> None:
    a = make_run(tmp_path / "a", noisy(7))
    lines = (a / "steps.jsonl").read_text().splitlines()
    lines = [json.dumps({**json.loads(x), "ranks_reporting": 1}) for x in lines]
    (a / "steps.jsonl").write_text("\n".join(lines) + "\n")
    g = load_group(a)
    assert g.steps("energy_per_token_j") == 0
    assert g.steps("step_time_s") == 60


def test_repeats_of_a_configuration_are_pooled(tmp_path: Path) -> None:
    # A folder holding two repeats (two run directories) is one group of both runs' steps.
    make_run(tmp_path / "cfg" / "seed=1", noisy(8, n=30))
    make_run(tmp_path / "cfg" / "seed=2", noisy(9, n=30))
    g = load_group(tmp_path / "cfg")
    assert len(g.runs) == 2
    assert g.steps("step_time_s") == 60


def test_bootstrap_interval_is_reproducible_and_covers_the_point() -> None:
    a, b = noisy(10), noisy(11) * 1.05
    first = bootstrap_difference(a, b)
    assert first == bootstrap_difference(a, b)
    point, low, high = first
    assert low <= point <= high


def test_hostile_step_lines_are_reported_not_raised(tmp_path: Path) -> None:
    a = make_run(tmp_path / "a", noisy(12))
    with (a / "steps.jsonl").open("a") as f:
        f.write('{"step": 99, "step_time_s": "\\u001b[2Jslow"}\n{"step": \n')
    g = load_group(a)
    assert g.steps("step_time_s") == 60
    assert any("step_time_s" in p for p in g.problems)
    b = make_run(tmp_path / "b", noisy(13))
    text = render(compare_groups([g, load_group(b)]))
    assert "\x1b" not in text


def test_cli_text_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = make_run(tmp_path / "a", noisy(14))
    b = make_run(tmp_path / "b", noisy(15) * 1.2)
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "step_time_s" in out and "worse" in out
    assert main(["compare", str(a), str(b), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["figure"] for r in data["comparisons"][0]["figures"]] == [f.name for f in FIGURES]
    assert main(["compare", str(a), str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
