"""bench/bench_train_telemetry.py's step-mode statistics: the ratios and the absolute cost per
step it reports must recover a known slowdown."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tests.load_script import load_script


def _bench():
    return load_script("bench/bench_train_telemetry.py")


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


def _dump(rng: random.Random, slowdown: float, units: int = 80, background: float = 0.0, **over):
    """A --dump-steps file of ``units`` ABBA quads whose ON steps are ``slowdown`` slower; the
    load of other processes per segment of 8 units is ``background`` (cores)."""
    steps = []
    for u in range(units):
        base = 0.030 * (1 + rng.uniform(-0.1, 0.1))
        for i, arm in enumerate(("on", "off", "off", "on")):
            t = base * (slowdown if arm == "on" else 1.0) * (1 + rng.gauss(0, 0.002))
            steps.append([u, arm, i in (0, 1), [t, t * 0.99, t * 0.98]])
    dump = {
        "config": "free",
        "contrast": "all",
        "model_overrides": {},
        "order": "abba",
        "unit_steps": 4,
        "segment_units": 8,
        "background": [background] * ((units + 7) // 8),
        "steps": steps,
    }
    dump.update(over)
    return dump


def test_pooled_runs_count_every_run_s_quads_and_find_the_common_slowdown() -> None:
    bench = _bench()
    rng = random.Random(5)
    dumps = [(f"run{i}", _dump(rng, 1.004)) for i in range(3)]
    r = bench.pool_dumps(dumps)
    assert r["runs"] == 3 and r["units"] == 240 and r["pairs"] == 480 and r["segments"] == 30
    lo, hi = r["iteration"]["ratio_paired_mean_ci95"]
    assert lo < 1.004 < hi and hi - lo < 0.002
    # One run's interval is wider than the pooled one: pooling is what narrows it.
    one = bench.pool_dumps(dumps[:1])["iteration"]["ratio_paired_mean_ci95"]
    assert one[1] - one[0] > hi - lo
    # The verdict is one run's rule over the pooled quads: the geometric mean's interval.
    assert bench.verdict(bench.pool_dumps([(f"n{i}", _dump(rng, 1.0)) for i in range(2)])) == "MET"
    assert bench.verdict(bench.pool_dumps([(f"s{i}", _dump(rng, 1.02)) for i in range(2)])) == "MISSED"


def test_the_verdict_follows_the_geometric_mean_not_the_median() -> None:
    bench = _bench()
    stats = {"ratio_median_ci95": [1.004, 1.0115], "ratio_paired_mean_ci95": [1.0051, 1.0109]}
    r = {"iteration": stats, "background_cores_mean": 0.0}
    assert bench.verdict(r) == "MISSED"  # the median's interval straddles 1.005; the mean's does not
    stats["ratio_paired_mean_ci95"] = [1.001, 1.0049]
    assert bench.verdict(r) == "MET"
    stats["ratio_paired_mean_ci95"] = [1.0049, 1.0051]
    assert bench.verdict(r).startswith("INCONCLUSIVE (the interval straddles the target)")


def test_pooling_keeps_each_run_s_load_with_its_own_units() -> None:
    bench = _bench()
    rng = random.Random(6)
    # A quiet run with no slowdown and a loaded one with a large one: the verdict over the quiet
    # segments only sees the quiet run's units.
    quiet = _dump(rng, 1.0, units=100)
    loaded = _dump(rng, 1.05, units=100, background=0.9)
    r = bench.pool_dumps([("quiet", quiet), ("loaded", loaded)])
    assert r["background_cores_mean"] > bench.BUSY_MACHINE_CORES
    assert r["quiet_rounds"] == 13
    assert r["quiet"]["on"]["iteration"]["units"] == 100
    assert r["quiet"]["on"]["iteration"]["ratio_paired_mean"] == pytest.approx(1.0, abs=0.002)
    assert r["iteration"]["ratio_paired_mean"] == pytest.approx(1.025, abs=0.005)
    assert bench.verdict(r).startswith("MET (over the 13 quiet segments)")


@pytest.mark.parametrize(
    ("second", "message"),
    [
        ({"config": "busy"}, "config is 'busy' but run0 has 'free'"),
        ({"contrast": "thread"}, "contrast is 'thread'"),
        ({"model_overrides": {"hidden_size": 256}}, "model_overrides is {'hidden_size': 256}"),
    ],
)
def test_pooling_refuses_runs_of_different_configurations(second: dict, message: str) -> None:
    bench = _bench()
    rng = random.Random(7)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("{", r"\{")):
        bench.pool_dumps([("run0", _dump(rng, 1.0)), ("run1", _dump(rng, 1.0, **second))])


def test_pool_refuses_a_steps_only_dump_and_prints_the_pooled_verdict(tmp_path: Path, capsys) -> None:
    bench = _bench()
    old = tmp_path / "old.json"
    old.write_text('[[0, "on", true, [0.03, 0.03, 0.03]]]')
    assert bench.print_pool([str(old)]) == 2
    assert "not a --dump-steps file of this bench" in capsys.readouterr().err
    rng = random.Random(8)
    files = []
    for i in range(2):
        f = tmp_path / f"run{i}.json"
        f.write_text(json.dumps(_dump(rng, 1.0)))
        files.append(str(f))
    assert bench.print_pool(files) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{files[0]}: per-unit geometric mean")
    assert out[2].startswith("pooled, 2 runs: free: ") and out[2].endswith("target <= 1.005: MET")
    payload = json.loads(out[-1].removeprefix("BENCH_JSON "))
    assert payload["verdict_free"] == "MET" and payload["results"]["free"]["runs"] == 2
