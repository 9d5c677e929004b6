"""The alert observer's memory does not grow with a run of weeks (issue 48)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from charllm_nemo.alerts.config import AlertsConfig
from charllm_nemo.alerts.observer import ALERTS_KEPT, AlertObserver


def test_the_observer_keeps_the_last_alerts_and_the_file_every_one(tmp_path: Path) -> None:
    obs = AlertObserver(replace(AlertsConfig(), console=False), run_dir=tmp_path)
    for k in range(ALERTS_KEPT + 5):  # every alert a run raises (they came at most 8 a step)
        obs._deliver({"kind": "straggler", "step": k, "message": f"alert {k}"})
    obs.close("complete")
    assert len(obs.alerts) == ALERTS_KEPT and obs.alerts[0]["step"] == 5  # was: every one kept
    assert len((tmp_path / "alerts.jsonl").read_text().splitlines()) == ALERTS_KEPT + 5
