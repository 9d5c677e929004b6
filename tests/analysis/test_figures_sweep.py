"""The configuration figure's grouping and labels, gaps in place, heatmap colour scales."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pyarrow as pa
import pytest

from charllm_nemo.analysis.analyze import analyze
from charllm_nemo.analysis.figures import write_figures
from charllm_nemo.analysis.figures_sweep import colour_range, config_labels, configurations
from charllm_nemo.analysis.run_info import gap_row

from .helpers import constant_run


def row(run: str, **kw: object) -> dict[str, object]:
    base = {"run": run, "model": "tiny_gpt", "layout": "PP2-DP1", "pp": 2, "tp": 1, "dp": 1,
            "world_size": 2, "micro_batch_size": 1, "measured_steps": 3, "energy_j": 10.0,
            "tokens_per_s": 100.0}  # fmt: skip
    base.update(kw)
    return base


def test_differing_configurations_get_distinct_labels_and_repeats_aggregate() -> None:
    rows = [
        row("a1", layers_per_stage="[4,4]"),
        row("a2", layers_per_stage="[4,4]", tokens_per_s=120.0),  # a repeat of a1
        row("b", layers_per_stage="[7,1]"),
        row("c", layers_per_stage="[4,4]", micro_batch_size=2),
        row("d", layers_per_stage="[4,4]", optim="recompute"),
    ]
    configs = configurations(rows, by_microbatch=False)
    assert len(configs) == 4
    labels = config_labels(configs)
    assert len(set(labels)) == 4, labels
    rep = next(c for c in configs if len(c.runs) == 2)
    assert rep.values("tokens_per_s") == [100.0, 120.0]
    assert any("[7,1]" in label for label in labels) and any("mb2" in label for label in labels)
    assert any("recompute" in label for label in labels) and any("n=2" in label for label in labels)


def test_an_oom_gap_from_a_layout_preset_takes_its_model_and_place() -> None:
    # '+layout=tiny_gpt_pp2' names the model and parallelism only through conf/layout/.
    over = {"layout": "tiny_gpt_pp2"}
    gap = gap_row("cpu_parallelism", "sweep=cpu_parallelism/run=x", "out_of_memory", over, [])
    assert gap["model"] == "tiny_gpt" and gap["pp"] == 2 and gap["dp"] == 1
    assert gap["layout"] == "PP2-DP1" and gap["micro_batch_size"] == 1
    rows = [
        row("dp", layout="DP2", pp=1, dp=2),
        {**gap, "measured_steps": None, "energy_j": None},
        row("tp", layout="TP2-DP1", pp=1, tp=2),
        row("other", model="tiny_moe", layout="EP2-DP2", pp=1, ep=2, dp=2),
    ]
    configs = configurations(rows, by_microbatch=False)
    models = [c.fields["model"] for c in configs]
    assert models == ["tiny_gpt", "tiny_gpt", "tiny_gpt", "tiny_moe"]  # the gap among its model's
    assert [c.gap for c in configs] == [None, None, "OOM", None]  # ordered by pp: after DP2, TP2


def test_colour_scale_has_a_minimum_span() -> None:
    assert colour_range(np.array([50.0, 50.2]), 10.0) == (45.1, 55.1)
    assert colour_range(np.array([40.0, 80.0]), 10.0) == (40.0, 80.0)


def test_sweep_figures_are_written(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep=s"
    constant_run(sweep / "run=a", ranks=2, temps=[50.0, 50.2])
    constant_run(sweep / "run=b", ranks=2, power_w=600.0)
    (sweep / "sweep.json").write_text(json.dumps({"runs": [
        {"key": "c", "state": "out_of_memory", "overrides": ["+layout=tiny_gpt_pp2"]},
    ]}))  # fmt: skip
    a = analyze(tmp_path)
    runs = {r["run"]: r for r in a.tables["runs"].to_pylist()}
    assert runs["sweep=s/run=c"]["model"] == "tiny_gpt"
    written = {p.name for p in write_figures(a, tmp_path / "fig")}
    assert {"configs.png", "configs_normalised.png", "heatmaps.png"} <= written
    assert isinstance(a.tables["runs"], pa.Table)


def test_log_colour_bars_are_labelled_in_plain_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mathtext is off for names from the data, so a formatter's ``$10^{9}$`` would be drawn
    raw: the traffic panel's log colour bar carries plain numbers."""
    from charllm_nemo.analysis import figures_sweep

    constant_run(tmp_path / "run=a", ranks=2)
    kept: list[Any] = []
    monkeypatch.setattr(figures_sweep, "save", lambda fig, stem: kept.append(fig) or [stem])
    with matplotlib.rc_context({"text.parse_math": False}):
        a = analyze(tmp_path)
        figures_sweep.heatmaps_figure(a.tables["ranks"], a.tables["runs"], {}, tmp_path / "h")
        (fig,) = kept
        fig.canvas.draw()
    labels = [
        t.get_text()
        for ax in fig.axes
        for t in ax.get_yticklabels(minor=False) + ax.get_yticklabels(minor=True)
    ]
    assert any(label for label in labels) and not any("$" in label for label in labels), labels
