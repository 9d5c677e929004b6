"""bench/bench_train_telemetry.py's step-mode statistics: the ratios and the absolute cost per
step it reports must recover a known slowdown."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_train_telemetry", REPO / "bench" / "bench_train_telemetry.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_known_fixed_cost_per_step_is_recovered_with_its_break_even_step_length() -> None:
    bench = _bench()
    rng = random.Random(3)
    units = []
    for _ in range(400):
        base = 0.030 * (1 + rng.uniform(-0.1, 0.1))  # slow drift: shared by a quad's four steps
        on = [base + 0.0003 + rng.gauss(0, 0.0005) for _ in range(2)]
        off = [base + rng.gauss(0, 0.0005) for _ in range(2)]
        units.append((on, off))
    r = bench.summarize_units(units)
    lo, hi = r["added_ms_ci95"]
    assert lo < 0.3 < hi and hi - lo < 0.15
    assert r["added_ms"] == pytest.approx(0.3, abs=0.05)
    # 0.3 ms is 0.5 % of a 60 ms step
    assert r["target_step_ms"] == pytest.approx(r["added_ms"] / 0.005)
    assert r["target_step_ms"] < r["target_step_ms_upper"] == pytest.approx(hi / 0.005)
    assert r["ratio_paired_mean"] == pytest.approx(1.01, abs=0.002)


def test_no_cost_gives_no_break_even_step_length() -> None:
    bench = _bench()
    units = [([0.03, 0.03], [0.031, 0.031]) for _ in range(10)]  # ON faster
    r = bench.summarize_units(units)
    assert r["added_ms"] < 0 and r["target_step_ms"] is None and r["target_step_ms_upper"] is None
