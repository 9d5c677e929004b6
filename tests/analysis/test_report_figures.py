"""What a reader sees at a glance (issue #47): single-run bars marked and counted, every
configuration label readable, timelines chosen by interest, no title under a legend, the
kernel figure's caption naming CPU time for CPU events."""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from charllm_nemo.analysis import figures_run, figures_sweep
from charllm_nemo.analysis.analyze import analyze
from charllm_nemo.analysis.figures_sweep import config_labels, configurations
from charllm_nemo.analysis.run_info import gap_row
from charllm_nemo.analysis.timeline_choice import choose_timelines
from charllm_nemo.cli import main

from .helpers import constant_run


def row(run: str, **kw: object) -> dict[str, object]:
    base = {"run": run, "model": "tiny_gpt", "layout": "DP2", "pp": 1, "tp": 1, "cp": 1, "ep": 1, "dp": 2,
            "world_size": 2, "micro_batch_size": 1, "global_batch_size": 16, "seq_length": 64,
            "device": "cpu", "layers_per_stage": "[4]", "measured_steps": 3, "energy_j": 10.0,
            "tokens_per_s": 100.0}  # fmt: skip
    base.update(kw)
    return base


def _kept(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[Any]:
    kept: list[Any] = []
    monkeypatch.setattr(module, "save", lambda fig, stem: kept.append(fig) or [stem])
    return kept


def test_single_run_bars_are_hatched_without_a_whisker_and_the_caption_counts_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = [row("a1"), row("a2", tokens_per_s=120.0), row("b", micro_batch_size=2)]
    kept = _kept(monkeypatch, figures_sweep)
    figures_sweep.configs_figure(pa.Table.from_pylist(rows), tmp_path / "c")
    (fig,) = kept
    ax = fig.axes[0]  # throughput: one series, one bar a configuration
    bars = [p for p in ax.patches if p.get_width() > 0]
    assert [bool(b.get_hatch()) for b in bars] == [False, True]  # mb1: 2 runs; mb2: one
    whiskers = [seg for coll in ax.collections for seg in coll.get_segments()]
    assert whiskers and {round(float(s[0][0]), 6) for s in whiskers} == {0.0}  # only the repeats'
    labels = [t.get_text() for t in fig.axes[-1].get_xticklabels()]
    assert labels == ["DP2\nmb1\nn=2", "DP2\nmb2\nn=1"]
    caption = fig.axes[-1].get_xlabel()
    assert "1-2 runs a bar" in caption and "hatched: a single run (1 of 2)" in caption


def test_an_oom_gap_is_labelled_from_the_fields_that_differ_and_no_labels_overlap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # cpu_microbatch's OOM configuration: only its micro batch is overridden; the sweep names no
    # parallelism (train.yaml's default). Its label was its path, overprinting its neighbours.
    gap = gap_row("cpu_microbatch", "sweep=cpu_microbatch/run=micro_batch_size-8", "out_of_memory",
                  {"batch.micro_batch_size": "8"}, [])  # fmt: skip
    rows = [row(f"mb{m}", micro_batch_size=m) for m in (1, 2, 4)]
    rows.append({**gap, "measured_steps": None, "energy_j": None})
    labels = config_labels(configurations(rows, by_microbatch=True))
    assert labels == ["DP2\nmb1\nn=1", "DP2\nmb2\nn=1", "DP2\nmb4\nn=1", "DP2\nmb8"]
    kept = _kept(monkeypatch, figures_sweep)
    figures_sweep.configs_figure(pa.Table.from_pylist(rows), tmp_path / "c", normalise=True)
    (fig,) = kept
    fig.canvas.draw()
    ticks = fig.axes[-1].get_xticklabels()
    assert [t.get_text() for t in ticks] == labels
    boxes = [t.get_window_extent() for t in ticks]
    for (i, a), (j, b) in combinations(enumerate(boxes), 2):
        assert not a.overlaps(b), (labels[i], labels[j])


def _sweep(root: Path) -> Path:
    sweep = root / "sweep=s"
    for name in ("a", "b"):
        constant_run(sweep / f"run={name}", steps=2, seconds=3.0)
    constant_run(sweep / "run=hot", steps=2, seconds=3.0, temps=[80.0, 81.0])
    constant_run(sweep / "run=zz_alerted", steps=2, seconds=3.0)
    alert = {"kind": "straggler", "severity": "warning", "step": 1, "rank": 1, "host": "node0",
             "local_rank": 1, "gpu_index": 1, "gpu_uuid": "SYN-1", "pp_stage": 0, "wall_ns": 1,
             "message": "rank 1 straggles"}  # fmt: skip
    (sweep / "run=zz_alerted" / "alerts.jsonl").write_text(json.dumps(alert) + "\n")
    return sweep


def test_timelines_go_to_the_runs_worth_one_and_the_others_are_listed_with_how_to_draw_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from charllm_nemo.analysis import timeline_choice

    monkeypatch.setattr(timeline_choice, "MAX_TIMELINES", 2)  # 4 by default: fewer to draw here
    sweep = _sweep(tmp_path)
    a = analyze(tmp_path)
    choice = choose_timelines(a)
    # the run with alerts first, the hottest next: the first by name ("a") had one before
    assert list(choice.chosen) == ["sweep=s/run=zz_alerted", "sweep=s/run=hot"]
    assert "1 alert(s)" in choice.why("sweep=s/run=zz_alerted") and "hottest" in choice.why("sweep=s/run=hot")
    # the lowest, not the highest: the hot run's clock is the lowest (constant_run: 1800 - 10 x temp)
    assert "lowest average SM clock" in choice.why("sweep=s/run=hot")
    assert sorted(choice.left_out) == [f"sweep=s/run={k}" for k in "ab"]
    page_path = tmp_path / "report.html"
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "out"), "--html", str(page_path)]) == 0
    page = page_path.read_text()
    drawn = {p.name for p in (tmp_path / "out" / "figures").glob("timeline_*.png")}
    assert drawn == {"timeline_sweep_s_run_zz_alerted.png", "timeline_sweep_s_run_hot.png"}
    assert "Without a timeline: sweep=s/run=a, sweep=s/run=b" in page
    assert f"charllm report {sweep}/run=a" in page
    assert "Drawn for: 1 alert(s)" in page


def test_the_timeline_title_sits_above_its_legend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    constant_run(tmp_path / "run=a", ranks=2, steps=2, seconds=3.0)
    run = analyze(tmp_path).runs[0]
    kept = _kept(monkeypatch, figures_run)
    figures_run.timeline_figure(run, tmp_path / "t")
    (fig,) = kept
    fig.canvas.draw()
    title = fig._suptitle  # matplotlib keeps the suptitle there
    assert title is not None and title.get_text() == run.key
    t_box, l_box = title.get_window_extent(), fig.legends[0].get_window_extent()
    assert not t_box.overlaps(l_box) and t_box.y0 >= l_box.y1


def test_the_kernel_figure_of_cpu_events_says_cpu_time(tmp_path: Path) -> None:
    from charllm_nemo.analysis import report

    constant_run(tmp_path / "run=a", ranks=1, steps=2, seconds=3.0)
    a = analyze(tmp_path)
    a.tables["kernels"] = pa.Table.from_pylist(
        [
            {
                "run": "run=a",
                "rank": 0,
                "pp_stage": 0,
                "category": "gemm",
                "seconds": 1.0,
                "share": 1.0,
                "source": "cpu_op",
            }
        ]
    )
    png = tmp_path / "kernels_run_a.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n")
    caption = report._img(png, a)
    assert "CPU time" in caption and "GPU time" not in caption
