"""The W&B workspace (``charllm wandb-dashboard``): built and checked without a server."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("wandb_workspaces")

from charllm_nemo.cli import main
from charllm_nemo.errors import CharllmError, ConfigError
from charllm_nemo.sinks import dashboard as d
from charllm_nemo.sinks.keys import STEP_FIGURE_KEYS, STEP_KEY, THROTTLE_FIGURES, step_metrics


def _spec(**kw: Any) -> dict[str, Any]:
    return d.workspace_spec(d.build_workspace(d.DashboardOptions(entity="e", project="p", **kw)))


def _sections(spec: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    return {s["name"]: s["panels"] for s in spec["spec"]["section"]["panelBankConfig"]["sections"]}


def test_every_panel_draws_keys_the_sink_logs() -> None:
    spec = _spec()
    assert d.spec_problems(spec) == []
    sections = _sections(spec)
    assert list(sections) == [
        "Throughput and MFU",
        "Power",
        "Energy",
        "Temperature",
        "Clocks",
        "Throttle",
        "Traffic",
        "Sampling",
        "Alerts",
    ]
    # every key a 4-rank step logs is drawn by some panel, but the step axis itself and the
    # per-reason throttle times of ranks other than the detail rank (0)
    logged = {k for k in d.all_keys(4) - {STEP_KEY} if not re.fullmatch(r"rank/[1-3]/throttle_.*_s", k)}
    logged |= {f"rank/{r}/throttle_any_limiting_s" for r in range(4)}
    assert d.panel_key_count(spec, sorted(logged)) == len(logged)
    # per-rank patterns draw one line per rank whatever the world size, and only that figure
    power = [p["config"] for p in sections["Power"] if p["config"].get("metricRegex")]
    regex = re.compile(power[0]["metricRegex"])
    assert regex.search("rank/0/power_avg_w") and regex.search("rank/1023/power_avg_w")
    assert not regex.search("rank/0/power_avg_w_x") and not regex.search("all/power_mean_w")
    for panels in sections.values():
        for p in panels:
            if p["viewType"] == "Run History Line Plot":
                assert p["config"]["xAxis"] == STEP_KEY
    settings = spec["spec"]["section"]["settings"]
    assert settings["xAxis"] == STEP_KEY and settings["shouldAutoGeneratePanels"] is False
    # every section shows all its panels on one page (3 a row)
    for s in spec["spec"]["section"]["panelBankConfig"]["sections"]:
        assert s["flowConfig"]["columnsPerPage"] * s["flowConfig"]["rowsPerPage"] >= len(s["panels"])


def test_a_renamed_or_unknown_key_is_caught() -> None:
    spec = _spec()
    panels = list(d.spec_panels(spec))
    cfg = next(p["config"] for _, p in panels if p["config"].get("metrics") == ["perf/mfu"])
    cfg["metrics"] = ["perf/model_flops_utilization"]
    regex_cfg = next(
        p["config"] for _, p in panels if p["config"].get("metricRegex", "").endswith("energy_j$")
    )
    regex_cfg["metricRegex"] = r"^rank/\d+/energy_kj$"
    problems = d.spec_problems(spec)
    assert len(problems) == 2
    assert "perf/model_flops_utilization" in problems[0] and "energy_kj" in problems[1]
    # keys.py is the truth: with a figure missing from the sink's key set the panel is flagged
    fewer = frozenset(k for k in d.all_keys() if not k.endswith("/temp_hbm_peak_c"))
    assert any("temp_hbm_peak_c" in p for p in d.spec_problems(_spec(), fewer))


def test_alerts_section_is_keyed_on_the_alerts_prefix() -> None:
    alerts = _sections(_spec())["Alerts"]
    assert alerts[0]["viewType"] == "Markdown Panel"
    pattern = alerts[1]["config"]["metricRegex"]
    assert pattern.startswith("^" + re.escape(d.ALERTS_PREFIX))
    assert re.search(pattern, "alerts/throttle_onset") and not re.search(pattern, "perf/mfu")
    # alerts keys are not keys.py's: the pattern may match none of them, but no non-alert key
    assert not any(re.search(pattern, k) for k in d.all_keys())


def test_throttle_reasons_are_stacked_for_the_detail_rank() -> None:
    throttle = _sections(_spec(detail_rank=3))["Throttle"]
    stacked = [p["config"] for p in throttle if p["config"].get("plotType") == "stacked-area"]
    assert len(stacked) == 1
    expected = [f"rank/3/{n}" for n in THROTTLE_FIGURES if n != "throttle_any_limiting_s"]
    assert stacked[0]["metrics"] == expected
    assert set(expected) <= set(step_metrics(0, per_rank=[{n: 1.0 for n in STEP_FIGURE_KEYS}] * 4))


def test_sweep_and_group_filter_and_group_the_runs() -> None:
    runset = _spec()["spec"]["section"]["runSets"][0]
    assert runset["grouping"] == [] and runset["filters"]["filters"] == []

    runset = _spec(sweep="cpu_microbatch")["spec"]["section"]["runSets"][0]
    (f,) = runset["filters"]["filters"]
    assert (
        f["key"] == {"section": "run", "name": "tags"}
        and f["op"] == "IN"
        and f["value"] == ["sweep:cpu_microbatch"]
    )
    assert runset["grouping"] == [
        {"section": "config", "name": "model.value.name"},
        {"section": "config", "name": "parallel.value.name"},
        {"section": "config", "name": "optim.value.name"},
        {"section": "config", "name": "batch.value.micro_batch_size"},
    ]

    spec = _spec(group="optim-sweep", group_by=("optim.name",), name="mine")
    assert spec["displayName"] == "mine"
    runset = spec["spec"]["section"]["runSets"][0]
    (f,) = runset["filters"]["filters"]
    assert f["key"] == {"section": "run", "name": "group"} and f["value"] == "optim-sweep"
    assert runset["grouping"] == [{"section": "config", "name": "optim.value.name"}]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"entity": " "}, "--entity"),
        ({"project": ""}, "--project"),
        ({"sweep": "a", "group": "b"}, "not both"),
        ({"detail_rank": -1}, "--detail-rank"),
        ({"max_runs": 0}, "--max-runs"),
        ({"group_by": ("model name",)}, "--group-by"),
    ],
)
def test_bad_options_name_the_flag(kw: dict[str, Any], match: str) -> None:
    base: dict[str, Any] = {"entity": "e", "project": "p"}
    with pytest.raises(ConfigError, match=match):
        d.DashboardOptions(**{**base, **kw})


def test_cli_dry_run_writes_the_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ws.json"
    assert main(["wandb-dashboard", "--project", "p", "--sweep", "s1", "--dry-run", "--json", str(out)]) == 0
    spec = json.loads(out.read_text())
    assert spec["project"] == "p" and spec["displayName"] == "charllm telemetry: sweep s1"
    assert d.spec_problems(spec) == []
    err = capsys.readouterr().err
    assert "9 sections" in err and "dry run: not saved" in err

    assert main(["wandb-dashboard", "--entity", "e", "--project", "p", "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["entity"] == "e"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_saving_without_a_server_is_a_clear_error(
    wandb_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # no --entity
    assert main(["wandb-dashboard", "--project", "p"]) == 2
    assert "--entity is required" in capsys.readouterr().err
    # no credentials
    assert main(["wandb-dashboard", "--entity", "e", "--project", "p"]) == 2
    assert "WANDB_API_KEY" in capsys.readouterr().err
    # credentials, but the server does not answer
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_closed_port()}")
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    assert main(["wandb-dashboard", "--entity", "e", "--project", "p"]) == 2
    assert "W&B server unreachable: 127.0.0.1" in capsys.readouterr().err


def test_a_refused_save_names_entity_and_project(monkeypatch: pytest.MonkeyPatch) -> None:
    workspace = d.build_workspace(d.DashboardOptions(entity="nobody", project="p"))
    monkeypatch.setattr("charllm_nemo.sinks.wandb.has_api_key", lambda env=None: True)
    monkeypatch.setattr("charllm_nemo.sinks.wandb.server_problem", lambda **kw: None)

    def refuse(self: Any) -> None:
        raise ValueError("entity nobody not found")

    monkeypatch.setattr(type(workspace), "save", refuse)
    with pytest.raises(CharllmError, match=r"--entity 'nobody' --project 'p'.*entity nobody not found"):
        d.save_workspace(workspace)
