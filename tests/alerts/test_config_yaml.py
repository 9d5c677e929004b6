"""conf/alerts/*.yaml and AlertsConfig declare the same defaults (issue 44): Hydra composes the
YAML, the library reads the dataclass, and a run must not depend on which one it was given."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from charllm_nemo.alerts.config import AlertsConfig

CONF = Path(__file__).resolve().parents[2] / "conf"


def _composed(option: str) -> dict[str, Any]:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        got = OmegaConf.to_container(compose("train", overrides=[f"alerts={option}"]).alerts)
    assert isinstance(got, dict)
    return got


@pytest.mark.parametrize(("option", "changed"), [("default", {}), ("off", {"enabled": False})])
def test_each_alerts_yaml_holds_the_dataclass_defaults(option: str, changed: dict[str, Any]) -> None:
    assert _composed(option) == {**asdict(AlertsConfig()), **changed}


def test_every_alerts_yaml_is_checked() -> None:
    assert sorted(p.stem for p in (CONF / "alerts").glob("*.yaml")) == ["default", "off"]
