"""The report's Advice and Energy sections are tables built from what ``charllm advise`` and
``charllm energy`` return (issue #47: they were console text in a monospace box)."""

from __future__ import annotations

import re
from pathlib import Path

from charllm_nemo.analysis.report_tables import advice_rows, energy_rows
from charllm_nemo.cli import main
from tests.analysis.helpers import constant_run


def test_advice_puts_the_verdict_first_and_folds_runs_without_advice_by_reason() -> None:
    report = {
        "advice": [{"kind": "micro_batch_size", "run": "s/run=a", "current": 1, "proposed": 4,
                    "expected_gain": 0.12, "evidence": ["mb4 12 % more samples/s", "5 repeats"],
                    "overrides": ["batch.micro_batch_size=4"], "command": "charllm train ..."}],
        "no_advice": [{"kind": "pipeline_layout", "run": f"s/run={k}", "reason": "no pipeline (pp=1)"}
                      for k in "abcdefgh"]
        + [{"kind": "placement", "run": "s/run=a", "reason": "one node"}],
        "problems": [],
    }  # fmt: skip
    report["advice"].append({**report["advice"][0], "kind": "pipeline_layout", "current": [2, 2],
                             "proposed": [3, 1]})  # fmt: skip
    advice, none = advice_rows(report)
    assert advice[1]["advice"] == "pipeline_layout: [2,2] -> [3,1]"
    assert next(iter(advice[0])) == "advice" and advice[0]["advice"] == "micro_batch_size: 1 -> 4"
    assert (
        advice[0]["expected_gain_pct"] == 12.0
        and advice[0]["evidence"] == "mb4 12 % more samples/s; 5 repeats"
    )
    assert [(r["no advice"], r["runs"]) for r in none] == [("pipeline_layout", 8), ("placement", 1)]
    assert none[0]["which"].endswith("and 2 more")


def test_energy_is_one_row_per_run_with_its_figure_first_and_one_per_rank() -> None:
    reports = [{"run": "r", "energy_j": 100.0, "uncertainty_j": 2.0, "uncertainty_share": 0.02,
                "ranks_measured": 2, "ranks_missing": 0, "synthetic": True,
                "mlperf": {"meets": False, "reasons": ["sampled at 1 Hz"], "checked": ["rate"]},
                "carbon": None,
                "per_device": [{"rank": 0, "device_index": 0, "energy_j": 50.0, "method": "counter",
                                "coverage": 1.0, "uncertainty_j": 0.5,
                                "bound_basis": "attribution"}]}]  # fmt: skip
    runs, ranks = energy_rows(reports)
    assert list(runs[0])[:2] == ["run", "energy_j"] and runs[0]["uncertainty_pct"] == 2.0
    assert runs[0]["MLPerf Training power rules (rate)"] == "does not meet: sampled at 1 Hz"
    assert ranks == [{"run": "r", "rank": 0, "device": 0, "energy_j": 50.0, "method": "counter",
                      "coverage": 1.0, "counter_period_s": None, "bound_j": 0.5,
                      "bound_basis": "attribution"}]  # fmt: skip


def _section(page: str, name: str) -> str:
    return page.split(f"<h2>{name}</h2>", 1)[1].split("<h2>", 1)[0]


def test_the_report_shows_advice_and_energy_as_tables(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep=s"
    constant_run(sweep / "run=a", steps=2, seconds=3.0)
    constant_run(sweep / "run=b", steps=2, seconds=3.0, power_w=600.0)
    page_path = tmp_path / "report.html"
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "out"), "--html", str(page_path)]) == 0
    page = page_path.read_text()
    advice, energy = _section(page, "Advice"), _section(page, "Energy")
    assert "<pre>" not in advice and "<pre>" not in energy
    assert "<th>no advice</th>" in advice  # both runs' "no advice" folded by reason, with a count
    folded = re.findall(r"<tr><td class=\"s\">([a-z_]+)</td><td class=\"s\">[^<]*</td><td>(\d+)</td>", advice)
    assert folded and all(int(n) <= 2 for _, n in folded) and any(int(n) == 2 for _, n in folded)
    assert "<th>energy_j</th>" in energy and energy.count("<table>") == 2  # per run, per rank
    assert "sweep=s/run=b" in energy
