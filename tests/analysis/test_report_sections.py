"""The report's sections (alerts, advice, energy, comparison, data quality under every figure),
the throttle-to-slowdown figure, the timeline's axes and legend, and the paper-figure table."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from charllm_nemo.analysis import figures, figures_run
from charllm_nemo.analysis.analyze import analyze
from charllm_nemo.analysis.load import Run, open_run
from charllm_nemo.analysis.report_sections import figure_quality, figure_runs, run_alerts
from charllm_nemo.cli import main
from tests.analysis.helpers import constant_run, phased_run

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 128  # tokens per step of constant_run's defaults (global batch 8 x seq 16)


def write_steps(run: Path, step_time_s: np.ndarray, power_w: float) -> None:
    """rank 0's steps.jsonl as charllm train writes it, as far as compare reads it."""
    lines = [
        json.dumps(
            {
                "step": i,
                "step_time_s": float(t),
                "tokens_per_s": TOKENS / float(t),
                "energy_j": 2 * power_w * float(t),
                "ranks_reporting": 2,
                "power_peak_w": power_w,
                "temp_gpu_peak_c": 50.0,
                "throttle_share": 0.0,
            }
        )
        for i, t in enumerate(step_time_s)
    ]
    (run / "steps.jsonl").write_text("\n".join(lines) + "\n")


def load_run(path: Path) -> Run:
    return open_run(path, path.parent)


ALERT = {
    "kind": "straggler", "severity": "warning", "step": 5, "rank": 1, "host": "node0",
    "local_rank": 1, "gpu_index": 1, "gpu_uuid": "SYN-1", "pp_stage": 0, "wall_ns": 1,
    "message": "rank 1 straggles <script>alert(1)</script>",
}  # fmt: skip


def test_report_has_alerts_advice_energy_comparison_and_data_quality(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep=s"
    a, b = sweep / "run=a", sweep / "run=b"
    constant_run(a)
    constant_run(b, power_w=600.0)
    rng = np.random.default_rng(7)
    write_steps(a, rng.normal(0.100, 0.003, 40), 400.0)
    write_steps(b, rng.normal(0.120, 0.003, 40), 600.0)  # 20 % slower
    (a / "alerts.jsonl").write_text(
        json.dumps(ALERT) + "\n[1, 2]\n" + json.dumps({**ALERT, "kind": "throttle_onset", "step": "x"}) + "\n"
    )
    page_path = tmp_path / "report.html"
    argv = ["report", str(sweep), "--out", str(tmp_path / "out"), "--html", str(page_path),
            "--compare", str(a), str(b), "--grid-g-per-kwh", "400", "--pue", "1.2"]  # fmt: skip
    assert main(argv) == 0
    page = page_path.read_text()
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    sections = re.findall(r"<h2>([^<]+)</h2>", page)
    for name in ("Caveats", "Alerts", "Advice", "Energy", "Comparison", "Figures"):
        assert name in sections, (name, sections)
    assert sections.index("Alerts") < sections.index("Figures")
    # Alerts: the good line, and the one whose step had the wrong type kept without it; the
    # line that is not an object named as a problem.
    assert "1 alert(s)" not in page and "2 alert(s) in 2 run(s)" in page
    assert "holds a JSON list, not an object" in page and "field &#x27;step&#x27; is string" in page
    assert "charllm advise" in page  # the advice's own text
    assert "MLPerf Training power rules" in page and "g CO2e" in page and "PUE 1.2" in page
    # The comparison: run b's 20 % longer steps, one run a side: no verdict on a time-like
    # figure, and the reason; the 200 W higher peak power is found worse.
    row = re.search(r"<tr>[^\n]*?step_time_s.*?</tr>", page)
    assert row is not None and "no verdict" in row.group(0) and "one run on both sides" in row.group(0)
    row = re.search(r"<tr>[^\n]*?power_peak_w.*?</tr>", page)
    assert row is not None and "worse" in row.group(0)
    # Every figure carries its paper figure and the data quality behind it.
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", page)
    assert captions and all("Data: " in c for c in captions)
    assert any("the paper&#x27;s Fig. 4" in c for c in captions)
    assert any("timeline_run_a" in c and "Data: 1 run(s)" in c for c in captions)


def test_report_refuses_a_comparison_of_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    constant_run(tmp_path / "run=a")
    assert main(["report", str(tmp_path), "--compare", str(tmp_path / "run=a")]) == 2
    assert "at least two runs" in capsys.readouterr().err


def test_run_alerts_are_read_through_the_hardened_reader(tmp_path: Path) -> None:
    run = tmp_path / "run=a"
    constant_run(run)
    (run / "alerts.jsonl").write_text(
        "".join(json.dumps({**ALERT, "step": i}) + "\n" for i in range(250))
        + json.dumps({"severity": "warning"})
        + "\n"
        + "{not json\n"
    )
    problems: list[str] = []
    kept, total = run_alerts(load_run(run), problems)
    assert total == 250 and len(kept) == 200 and kept[0]["run"] == load_run(run).key
    assert any("without a kind or a message" in p for p in problems)
    assert any(":252" in p for p in problems)  # the line that does not parse, by number
    (run / "alerts.jsonl").unlink()
    (run / "alerts.jsonl").symlink_to(tmp_path / "elsewhere")
    problems = []
    assert run_alerts(load_run(run), problems) == ([], 0)
    assert load_run(run).files.alerts is None  # a link is not a run's file


def test_figure_quality_names_the_gap_and_its_rank(tmp_path: Path) -> None:
    layout = [{"pp_stage": 0, "tp_rank": 0, "dp_rank": d} for d in range(2)]
    phased_run(tmp_path / "run=gap", layout, clocks=[1800, 1800], hole=(1, 1.6, 2.2))
    phased_run(tmp_path / "run=ok", layout, clocks=[1800, 1800])
    analysis = analyze(tmp_path)
    keys = {r.key.split("=")[-1]: r.key for r in analysis.runs}
    gap = figure_quality(analysis, [keys["gap"]])
    assert "sampling gap" in gap and f"{keys['gap']} rank 1" in gap and "lowest coverage" in gap
    ok = figure_quality(analysis, [keys["ok"]])
    assert "sampled throughout" in ok and "rank 1" not in ok
    assert "Data: 2 run(s)" in figure_quality(analysis, figure_runs("configs", analysis))
    assert figure_runs(f"timeline_{figures.figure_slug(keys['ok'])}", analysis) == [keys["ok"]]


def _capture(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[Any]:
    """Keep the figures ``module`` saves instead of writing them."""
    kept: list[Any] = []
    monkeypatch.setattr(module, "save", lambda fig, stem: kept.append(fig) or [stem])
    return kept


def test_timeline_draws_the_clock_on_its_own_axis_and_explains_every_encoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    constant_run(tmp_path / "run=a")
    kept = _capture(monkeypatch, figures_run)
    figures_run.timeline_figure(load_run(tmp_path / "run=a"), tmp_path / "t")
    (fig,) = kept
    labels = [ax.get_ylabel() for ax in fig.axes]
    assert sum("SM clock (MHz)" in s for s in labels) == 2  # one clock axis per rank
    assert not any("/20" in s for s in labels)
    clock_axes = [ax for ax in fig.axes if "SM clock" in ax.get_ylabel()]
    assert all(ax.get_ylim()[0] < 1300 < ax.get_ylim()[1] for ax in clock_axes)  # MHz, not MHz/20
    # one range per quantity across ranks (rank 1 runs 10 MHz lower: it must look lower)
    assert clock_axes[0].get_ylim() == clock_axes[1].get_ylim()
    temp_axes = [ax for ax in fig.axes if "GPU temp" in ax.get_ylabel()]
    assert len(temp_axes) == 2 and temp_axes[0].get_ylim() == temp_axes[1].get_ylim()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    for words in ("power", "temperature", "SM clock", "training step", "microbatch"):
        assert any(words in t for t in legend), (words, legend)


def test_throttle_slowdown_figure_plots_each_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = pa.Table.from_pylist(
        [
            {"run": "a", "rank": 0, "pp_stage": 0, "throttle_any_limiting_share": 0.0,
             "slowdown_vs_fastest": 0.0, "slowdown_baseline": "fastest_device_clock"},
            {"run": "a", "rank": 1, "pp_stage": 1, "throttle_any_limiting_share": 0.8,
             "slowdown_vs_fastest": 0.236, "slowdown_baseline": "fastest_device_clock"},
            {"run": "b", "rank": 0, "pp_stage": 0, "throttle_any_limiting_share": None,
             "slowdown_vs_fastest": 0.1, "slowdown_baseline": "none"},
        ]
    )  # fmt: skip
    kept = _capture(monkeypatch, figures)
    assert figures.throttle_slowdown_figure(table, tmp_path / "ts") == [tmp_path / "ts"]
    ax = kept[0].axes[0]
    points = np.concatenate([c.get_offsets() for c in ax.collections])
    assert sorted(map(tuple, points.tolist())) == [(0.0, 0.0), (80.0, pytest.approx(23.6))]
    assert "r1 PP1" in [t.get_text() for t in ax.texts]
    assert "fastest_device_clock" in ax.get_ylabel()
    assert figures.throttle_slowdown_figure(table.slice(2), tmp_path / "none") == []


def test_docs_list_every_figure_with_its_paper_figure() -> None:
    text = (ROOT / "docs" / "analysis.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+?)(?:_<run>)?` \| ([^|]+) \|", text, re.M)}
    for stem, (paper, _) in figures.PAPER_FIGURES.items():
        assert stem in rows, stem
        assert rows[stem].strip() == paper, (stem, rows[stem], paper)
