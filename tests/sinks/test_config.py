"""logger.* selection (conf/logger/*.yaml, build_sink) and the console sink."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from charllm_nemo.errors import ConfigError
from charllm_nemo.sinks.base import AsyncSink
from charllm_nemo.sinks.config import LoggerConfig, build_sink, validate_logger_config

CONF = Path(__file__).resolve().parents[2] / "conf" / "logger"
HAVE_WANDB = importlib.util.find_spec("wandb") is not None


@pytest.mark.parametrize("name", ["wandb", "console", "none"])
def test_each_logger_yaml_mirrors_logger_config(name):
    raw = OmegaConf.load(CONF / f"{name}.yaml")
    fields = [f.name for f in dataclasses.fields(LoggerConfig)]
    assert list(raw.keys()) == fields
    typed = OmegaConf.merge(OmegaConf.structured(LoggerConfig), raw)
    cfg = OmegaConf.to_object(typed)
    assert isinstance(cfg, LoggerConfig) and cfg.name == name
    if name != "wandb" or HAVE_WANDB:
        validate_logger_config(cfg)


def test_an_unknown_logger_names_the_field_and_the_choices():
    with pytest.raises(ConfigError, match=r"logger\.name='tensorboard'.*console, wandb, none"):
        build_sink(LoggerConfig(name="tensorboard"), rank=0)
    with pytest.raises(ConfigError, match=r"logger\.mode='shared'"):
        validate_logger_config(LoggerConfig(name="wandb", mode="shared"))
    with pytest.raises(ConfigError, match=r"logger\.queue_size"):
        validate_logger_config(LoggerConfig(queue_size=0))


@pytest.mark.skipif(not HAVE_WANDB, reason="wandb not installed")
def test_only_rank0_gets_a_sink(tmp_path):
    env = {"NETRC": str(tmp_path / "missing"), "WANDB_MODE": "offline"}
    assert build_sink(LoggerConfig(name="none"), rank=0) is None
    assert build_sink(LoggerConfig(name="console"), rank=1) is None
    assert build_sink(LoggerConfig(name="wandb"), rank=3, env=env) is None
    # shared mode adds a writer per node only for an online run
    shared = LoggerConfig(name="wandb", shared=True)
    assert build_sink(shared, rank=8, local_rank=0, node_rank=1, env=env) is None
    online = {"WANDB_API_KEY": "x", "NETRC": str(tmp_path / "missing")}
    second = build_sink(shared, rank=8, local_rank=0, node_rank=1, env=online)
    assert isinstance(second, AsyncSink) and second.name == "wandb-secondary"
    assert second.sink.primary is False and second.sink.label.startswith("node1-")  # type: ignore[attr-defined]
    second.finish(None, timeout_s=5)
    assert build_sink(shared, rank=9, local_rank=1, node_rank=1, env=online) is None
    # logger=console is the training loop's own per-step line: no sink at all
    assert build_sink(LoggerConfig(name="console", queue_size=7), rank=0) is None


def test_logger_wandb_without_the_package_is_a_config_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"logger\.name='wandb' needs the wandb package.*logger=console"):
        validate_logger_config(LoggerConfig(name="wandb"))
    validate_logger_config(LoggerConfig(name="console"))


def test_importing_the_sinks_needs_neither_wandb_nor_torch():
    import subprocess
    import sys

    code = (
        "import sys, charllm_nemo.sinks.config, charllm_nemo.sinks.keys, charllm_nemo.sinks.wandb"
        "; print(sorted(m for m in ('wandb', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
