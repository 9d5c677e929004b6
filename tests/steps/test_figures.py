"""The one table of step figures (charllm_nemo.telemetry.figures): every place a figure appears
is derived from it, so a figure added there appears everywhere, and the docs list it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from charllm_nemo.sinks.keys import STEP_FIGURE_KEYS, SUMMARY_KEYS, step_metrics
from charllm_nemo.steps.observers import format_report
from charllm_nemo.steps.report import VECTOR_WIDTH, StepReport, apply_rank_figures, pack_rank_vector
from charllm_nemo.telemetry import figures as F
from charllm_nemo.telemetry.filecheck import STEP_SPEC, SUMMARY_SPEC, validate_step
from charllm_nemo.train.report import SUMMARY_FIELDS

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_docs_list_every_field_and_key_of_the_table() -> None:
    for page in ("store.md", "wandb.md"):
        text = (DOCS / page).read_text(encoding="utf-8")
        assert text == F.render_docs(text), f"docs/{page} is stale: run scripts/figure_docs.py"
    assert "<!-- figures:steps -->" in (DOCS / "store.md").read_text(encoding="utf-8")
    assert "<!-- figures:wandb -->" in (DOCS / "wandb.md").read_text(encoding="utf-8")


def test_a_report_row_and_the_readers_checks_name_the_same_fields() -> None:
    # STEP_SPEC once lacked mfu_attention and num_microbatches: the row and the check now agree.
    row = StepReport(step=0, loss=1.0, step_time_s=0.1).to_dict()
    apply_rank_figures(report := StepReport(step=1, loss=None, step_time_s=0.1), [pack_rank_vector()])
    assert set(row) == set(STEP_SPEC) == set(report.to_dict())
    assert {"mfu_attention", "num_microbatches", "coverage", "gap_max_s", "sampling_gap"} <= set(STEP_SPEC)
    assert set(SUMMARY_FIELDS) <= set(STEP_SPEC)
    assert {f"{f}_median" for f in SUMMARY_FIELDS} <= set(SUMMARY_SPEC)
    assert set(SUMMARY_KEYS) <= set(STEP_SPEC)


def test_a_sampling_gap_is_flagged_in_the_row_and_on_the_console() -> None:
    ranks = [{"coverage": 1.0, "gap_max_s": 0.01, "energy_j": 1.0},
             {"coverage": 0.4, "gap_max_s": 0.72, "energy_j": 1.0}]  # fmt: skip
    r = StepReport(step=3, loss=1.0, step_time_s=1.2)
    apply_rank_figures(r, [pack_rank_vector(step_time_s=1.2, figures=f) for f in ranks])
    row = r.to_dict()
    assert (row["coverage"], row["gap_max_s"], row["sampling_gap"]) == (0.4, 0.72, True)  # min, max
    assert "sampled 40% (gap 0.72 s)" in format_report(r, 10, 2)
    keys = step_metrics(3, per_rank=r.per_rank)
    assert (keys["all/coverage_min"], keys["all/gap_max_s"], keys["rank/1/coverage"]) == (0.4, 0.72, 0.4)
    whole = StepReport(step=4, loss=1.0, step_time_s=1.0)
    apply_rank_figures(whole, [pack_rank_vector(step_time_s=1.0, figures={"coverage": 1.0})])
    assert whole.sampling_gap is False and "sampled" not in format_report(whole, 10, 1)


def test_a_missing_attribution_column_is_an_unknown_figure_omitted_everywhere() -> None:
    # A figure whose column the attribution does not give (yet) travels as NaN and is left out.
    r = StepReport(step=0, loss=None, step_time_s=0.5)
    apply_rank_figures(r, [pack_rank_vector(step_time_s=0.5, figures={"energy_j": 2.0})])
    assert math.isnan(r.per_rank[0]["coverage"]) and r.to_dict()["coverage"] is None
    assert r.sampling_gap is None
    assert not any("coverage" in k or "gap_max" in k for k in step_metrics(0, per_rank=r.per_rank))


# A figure added to the table in a fresh interpreter, before anything derives from it.
_ADD_ONE = """
import json, math, sys, tempfile
from pathlib import Path
import charllm_nemo.telemetry.figures as F
F.RANK_FIGURES = (*F.RANK_FIGURES, F.RankFigure("fan_peak_rpm", "rpm", "peak fan speed", column="fan_rpm",
                  report="max", median=True, aggregates=(("all/fan_max_rpm", "max"),)))
F.STEP_FIELDS = F.step_fields(F.RANK_FIGURES)
from charllm_nemo.sinks.keys import STEP_FIGURE_KEYS, step_metrics
from charllm_nemo.steps.observers import StepsFileObserver
from charllm_nemo.steps.report import VECTOR_WIDTH, StepReport, apply_rank_figures, pack_rank_vector
from charllm_nemo.telemetry.filecheck import STEP_SPEC, SUMMARY_SPEC, validate_step
from charllm_nemo.train.report import SUMMARY_FIELDS, run_summary
out = {"keys": STEP_FIGURE_KEYS[-1], "width": VECTOR_WIDTH}
vec = pack_rank_vector(step_time_s=1.0, figures=[{"fan_rpm": 900.0}, {"fan_rpm": 1200.0}])
out["vector"] = vec[-1]
r = StepReport(step=0, loss=None, step_time_s=1.0)
apply_rank_figures(r, [vec, pack_rank_vector(step_time_s=1.0, figures={"fan_rpm": 800.0})])
path = Path(tempfile.mkdtemp()) / "steps.jsonl"
obs = StepsFileObserver(path); obs.on_step(r); obs.close("complete")
line = json.loads(path.read_text())
out["line"] = line["fan_peak_rpm"]
problems = []
validate_step({"step": 0, "fan_peak_rpm": "fast"}, "steps.jsonl:1", problems)
out["problems"] = problems
out["spec"] = STEP_SPEC["fan_peak_rpm"]
out["median"] = run_summary([line])["fan_peak_rpm_median"]
out["summary_spec"] = "fan_peak_rpm_median" in SUMMARY_SPEC and "fan_peak_rpm" in SUMMARY_FIELDS
keys = step_metrics(0, per_rank=r.per_rank)
out["wandb"] = [keys["rank/0/fan_peak_rpm"], keys["rank/1/fan_peak_rpm"], keys["all/fan_max_rpm"]]
out["docs"] = ["`fan_peak_rpm`" in F.steps_table(), "`rank/<r>/fan_peak_rpm`" in F.wandb_table(),
               "`all/fan_max_rpm`" in F.wandb_table()]
print(json.dumps(out))
"""


def test_a_figure_added_to_the_table_appears_in_every_place() -> None:
    done = subprocess.run([sys.executable, "-c", _ADD_ONE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["keys"] == "fan_peak_rpm" and out["width"] == VECTOR_WIDTH + 1  # the rank vector
    assert out["vector"] == 1200.0  # the rank's devices combined by the entry's rule (max)
    assert out["line"] == 1200.0  # steps.jsonl: max over ranks
    assert out["spec"] == ["number", "null"] and len(out["problems"]) == 1  # the reader's check
    assert "fan_peak_rpm" in out["problems"][0] and "expected number or null" in out["problems"][0]
    assert out["median"] == 1200.0 and out["summary_spec"]  # summary.json
    assert out["wandb"] == [1200.0, 800.0, 1200.0]  # W&B: per rank and the aggregate
    assert out["docs"] == [True, True, True]
    assert "fan_peak_rpm" not in STEP_FIGURE_KEYS  # this interpreter's table is untouched


def test_json_rows_hold_only_json_kinds() -> None:
    r = StepReport(step=0, loss=1.0, step_time_s=0.1)
    problems: list[str] = []
    assert validate_step(json.loads(json.dumps(r.to_dict())), "x", problems) and problems == []
